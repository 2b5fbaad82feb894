"""Reading kvfleet objects from YAML/JSON files and dicts.

YAML is read with the YAML 1.2 core schema for numbers, as the Kubernetes apiserver does:
PyYAML alone implements YAML 1.1, where `1e0` is a string and `0o17` is not octal, so the same
file would mean different things to `kubectl apply` and to `kvfleet check`.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from kvfleet.api.modelartifact import ModelArtifact
from kvfleet.api.rollout import Rollout
from kvfleet.api.servingpool import ServingPool
from kvfleet.api.tenantquota import TenantQuota

KvfleetObject = ModelArtifact | ServingPool | TenantQuota | Rollout
KINDS: dict[str, type[ModelArtifact] | type[ServingPool] | type[TenantQuota] | type[Rollout]] = {
    "ModelArtifact": ModelArtifact,
    "ServingPool": ServingPool,
    "TenantQuota": TenantQuota,
    "Rollout": Rollout,
}


class DocumentError(ValueError):
    """A file or document that is not a valid kvfleet object; the message names where."""


class _Yaml12Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 core-schema floats (1e0, .5, -1E+3 are numbers)."""


_Yaml12Loader.yaml_implicit_resolvers = {
    key: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:float"]
    for key, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.copy().items()
}
_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)


def _float_or_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> Any:
    # The float resolver above also matches plain integers ("12"); keep those ints.
    text = loader.construct_scalar(node)
    if re.fullmatch(r"[-+]?[0-9]+", text):
        return int(text)
    special = {".inf": math.inf, "+.inf": math.inf, "-.inf": -math.inf, ".nan": math.nan}
    lowered = text.lower()
    return special[lowered] if lowered in special else float(text)


_Yaml12Loader.add_constructor("tag:yaml.org,2002:float", _float_or_int)


def load_yaml_documents(text: str, source: str = "<string>") -> list[dict[str, Any]]:
    """All non-empty documents of a YAML (or JSON) stream, each a mapping."""
    try:
        documents = [d for d in yaml.load_all(text, Loader=_Yaml12Loader) if d is not None]
    except yaml.YAMLError as error:
        raise DocumentError(f"{source}: not valid YAML: {error}") from error
    for index, document in enumerate(documents):
        if not isinstance(document, dict):
            raise DocumentError(f"{source}: document {index} is not a mapping")
    return documents


def parse_object(data: dict[str, Any], source: str = "<object>") -> KvfleetObject:
    """The typed object for a dict with apiVersion/kind; DocumentError says what is wrong."""
    kind = data.get("kind")
    cls = KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise DocumentError(
            f"{source}: kind {kind!r} is not a kvfleet kind (one of {', '.join(KINDS)})"
        )
    try:
        return cls.model_validate(data)
    except ValidationError as error:
        details = format_validation_error(error)
        raise DocumentError(f"{source}: invalid {kind}:\n{details}") from error


def load_objects(path: Path) -> list[KvfleetObject]:
    """Every kvfleet object in a YAML file."""
    documents = load_yaml_documents(path.read_text(encoding="utf-8"), str(path))
    return [parse_object(doc, f"{path} document {i}") for i, doc in enumerate(documents)]


def dump_object(obj: KvfleetObject) -> str:
    """YAML of an object as a user would write it: camelCase, no nulls, no spelled-out defaults."""
    data = obj.model_dump(mode="json", by_alias=True, exclude_none=True, exclude_defaults=True)
    ordered = {"apiVersion": obj.api_version, "kind": obj.kind, **data}
    return yaml.safe_dump(ordered, sort_keys=False, width=100)


def error_path(loc: tuple[int | str, ...]) -> str:
    """A pydantic error location as a Kubernetes field path: spec.steps[1].weight."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path


def format_validation_error(error: ValidationError) -> str:
    return "\n".join(
        f"  {error_path(tuple(e['loc'])) or '(object)'}: {e['msg']}" for e in error.errors()
    )
