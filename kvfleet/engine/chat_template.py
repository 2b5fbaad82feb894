"""Chat template: renders a list of chat messages into the model's prompt text.

The template is the Jinja2 source shipped with the model (GGUF `tokenizer.chat_template`, or
`chat_template` in an HF `tokenizer_config.json`). It is rendered the way HF transformers'
`apply_chat_template` renders it, in a sandboxed environment, so a template from a model file
cannot touch Python internals: `trim_blocks`/`lstrip_blocks`, the variables `messages`,
`add_generation_prompt`, `bos_token`, `eos_token`, and the helpers `raise_exception`,
`strftime_now` and the `tojson` filter.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvfleet.engine.errors import ChatTemplateRejected, InvalidRequestError, ModelLoadError

_VALID_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


class TemplateRaisedError(Exception):
    """Raised by the template's own `raise_exception(...)`: the conversation is invalid."""


def _raise_exception(message: str) -> NoReturn:
    raise TemplateRaisedError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def validate_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Plain-dict copies of `messages`, or InvalidRequestError naming the bad message field."""
    if not messages:
        raise InvalidRequestError(
            "messages", "the conversation is empty", "Send at least one message"
        )
    checked: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequestError(
                f"messages[{index}]", "a message must be an object with 'role' and 'content'"
            )
        role = message.get("role")
        if role not in _VALID_ROLES:
            raise InvalidRequestError(
                f"messages[{index}].role",
                f"unknown role {role!r}",
                f"Use one of {sorted(_VALID_ROLES)}",
            )
        if not isinstance(message.get("content"), str):
            raise InvalidRequestError(f"messages[{index}].content", "content must be a string")
        checked.append(dict(message))
    return checked


class ChatTemplate:
    """A compiled chat template plus the special-token text it may reference."""

    def __init__(
        self, source: str, *, bos_token: str = "", eos_token: str = "", origin: str = "<template>"
    ) -> None:
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        # Identifies the template version, e.g. for the prefix-cache salt.
        self.sha256 = hashlib.sha256(source.encode("utf-8")).hexdigest()
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ModelLoadError(
                origin,
                f"the chat template does not compile ({exc.message}, line {exc.lineno})",
                "Fix or remove the model's chat template",
            ) from exc

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **extra: Any,
    ) -> str:
        """Prompt text for `messages`; InvalidRequestError if the template rejects them."""
        checked = validate_messages(messages)
        try:
            return self._template.render(
                messages=checked,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **extra,
            )
        except TemplateRaisedError as exc:
            raise ChatTemplateRejected(
                "messages",
                f"rejected by the model's chat template: {exc}",
                "Change the conversation to the shape the model expects",
            ) from exc
        except jinja2.TemplateError as exc:
            raise ChatTemplateRejected(
                "messages", f"the chat template failed on this conversation ({exc})"
            ) from exc
