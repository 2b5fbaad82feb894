"""Typed errors of the inference engine.

Every error a caller of the engine can see is one of these, and its message says what was
wrong, where (the file, or the request field), and what to do about it.

    KvfleetEngineError                 base of everything the engine raises on purpose
    ├── ModelLoadError                 a model file/dir cannot be used (missing, corrupt, ...)
    │   ├── UnsupportedModelError      readable, but an architecture/tensor type we do not run
    │   └── ModelVerificationError     the weights' sha256 differs from the artifact manifest
    └── InvalidRequestError            a request field is invalid (`.field` names it)
        └── ChatTemplateRejected       the model's chat template refuses the conversation
"""

from __future__ import annotations

from pathlib import Path


class KvfleetEngineError(Exception):
    """Base class of all errors the engine raises deliberately."""


class ModelLoadError(KvfleetEngineError):
    """The model at `path` cannot be loaded; the message says why and what to do."""

    def __init__(self, path: str | Path, problem: str, remedy: str) -> None:
        self.path = str(path)
        self.problem = problem
        self.remedy = remedy
        super().__init__(f"cannot load model {self.path!r}: {problem}. {remedy}")


class UnsupportedModelError(ModelLoadError):
    """The file is well-formed but describes something this engine does not run."""


class ModelVerificationError(ModelLoadError):
    """The weight files are not the ones the ModelArtifact manifest names (sha256 differs)."""


class InvalidRequestError(KvfleetEngineError):
    """A request is invalid; `field` is the request field at fault (e.g. `sampling.top_p`)."""

    code = "invalid_request_error"  # the error object's code in the HTTP answer

    def __init__(self, field: str, problem: str, remedy: str = "") -> None:
        self.field = field
        self.problem = problem
        self.remedy = remedy
        message = f"invalid request field {field!r}: {problem}"
        if remedy:
            message += f". {remedy}"
        super().__init__(message)


class ChatTemplateRejected(InvalidRequestError):
    """The model's chat template raised on a well-formed conversation (e.g. one that refuses
    a `system` message). A 400 to the client, but the model's doing, not the request's: the
    router counts it against the revision, so a canary whose template refuses what stable's
    accepts is caught by its error rate."""

    code = "chat_template_rejected"
