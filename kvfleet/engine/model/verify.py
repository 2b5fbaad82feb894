"""Refuse weights, a tokenizer or a chat template other than the ModelArtifact manifest's.

The operator passes the manifest's digests (`KVFLEET_EXPECTED_SHA256`, comma-separated, in the
artifact's file order) to every engine pod. A mismatch means the pod would serve something
other than what was reviewed and admitted, so the engine does not start: it exits non-zero and
its last log line names the file, both digests and what to do, which the operator surfaces on
the ServingPool.

For a checkpoint directory the comparison is by set: every expected digest must belong to a
file there (the artifact may list config and tokenizer files too), and every weight file must
be expected (the artifact lists them all). The tokenizer and the template are compared after
loading (`KVFLEET_EXPECTED_TOKENIZER_SHA256`, `KVFLEET_EXPECTED_CHAT_TEMPLATE_SHA256`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvfleet.engine.errors import ModelVerificationError
from kvfleet.engine.model.loader import LoadedModel, file_sha256

WEIGHT_SUFFIXES = (".gguf", ".safetensors", ".bin")


def verify_weights(path: Path, expected: Sequence[str]) -> None:
    """Raise ModelVerificationError unless `path`'s weight files have exactly these digests."""
    if not expected:
        return
    remedy = ("Point the ModelArtifact at the right file, or publish a new ModelArtifact "
              "with the file's real sha256")
    if path.is_file():
        actual = file_sha256(path)
        if len(expected) != 1 or actual != expected[0]:
            raise ModelVerificationError(
                path, f"sha256 {actual} does not match the manifest's {', '.join(expected)}",
                remedy)
        return
    files = sorted(p for p in path.iterdir() if p.is_file())
    actual_by_file = {p.name: file_sha256(p) for p in files}
    unexpected = {n: d for n, d in actual_by_file.items()
                  if d not in expected and Path(n).suffix in WEIGHT_SUFFIXES}
    missing = [d for d in expected if d not in actual_by_file.values()]
    if unexpected or missing:
        parts = [f"{n} has sha256 {d}, not in the manifest" for n, d in unexpected.items()]
        parts += [f"no file has the manifest's sha256 {d}" for d in missing]
        raise ModelVerificationError(path, "; ".join(parts), remedy)


def verify_manifest(loaded: LoadedModel, *, tokenizer_sha256: str | None,
                    chat_template_sha256: str | None) -> None:
    """Raise ModelVerificationError unless the loaded tokenizer and chat template are the ones
    the manifest names (`LoadedModel.tokenizer_sha256` says how each is hashed). A wrong
    tokenizer serves fluent nonsense; a wrong template changes every answer's format."""
    remedy = ("Point the ModelArtifact at the right files, or publish a new ModelArtifact with "
              "their real digests (`kvfleet artifact from-gguf` / `from-hf` compute them)")
    problems = []
    if tokenizer_sha256 and loaded.tokenizer_sha256 != tokenizer_sha256:
        problems.append(f"tokenizer sha256 {loaded.tokenizer_sha256} does not match the "
                        f"manifest's {tokenizer_sha256}")
    if chat_template_sha256 and loaded.chat_template_sha256 != chat_template_sha256:
        found = loaded.chat_template_sha256 or "(the model has no chat template)"
        problems.append(f"chat template sha256 {found} does not match the manifest's "
                        f"{chat_template_sha256}")
    if problems:
        raise ModelVerificationError(loaded.path, "; ".join(problems), remedy)
