"""A wrong artifact that no latency or error gate can tell apart: the embedded SmolLM2 GGUF
with one float32 norm tensor scaled. Same shapes, same size, same speed, a different manifest
hash, and different greedy answers: what answer agreement (`OutputAgreement`) must stop."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from kvfleet.engine.model.gguf_reader import GGUFFile

# Measured on the embedded model (bench/output_agreement.py): greedy probes agree on well under
# half their tokens with the original, where two replicas of the original agree on all.
DEFAULT_TENSOR = "blk.0.attn_norm.weight"
DEFAULT_SCALE = 1.5


def scale_norm(source: Path, target: Path, tensor: str = DEFAULT_TENSOR,
               scale: float = DEFAULT_SCALE) -> Path:
    """Copy `source` to `target` with `tensor` (a float32 tensor) multiplied by `scale`."""
    infos = {info.name: info for info in GGUFFile(source).tensors}
    info = infos.get(tensor)
    if info is None or info.ggml_type.name != "F32":
        raise ValueError(f"{source}: no float32 tensor {tensor!r} to scale (float32 ones: "
                         f"{sorted(n for n, i in infos.items() if i.ggml_type.name == 'F32')[:6]}"
                         " ...)")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    values = np.memmap(target, dtype=np.float32, mode="r+", offset=info.offset,
                       shape=(info.nbytes // 4,))
    values *= np.float32(scale)
    values.flush()
    del values
    return target
