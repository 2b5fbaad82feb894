"""Wrong artifacts that no latency or error gate can tell apart, made from the embedded
SmolLM2 GGUF. `scale_norm`: one float32 norm tensor scaled; same shapes, same size, same speed,
a different manifest hash, and different greedy answers: what answer agreement
(`OutputAgreement`) must stop (scaled a little, it stands for a legitimate new checkpoint
instead). `set_eos`: the wrong end-of-sequence id; answers that never end: what the live
answers' signs must stop when OutputAgreement is off for a model upgrade."""

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


EOS_KEY = b"tokenizer.ggml.eos_token_id"
_GGUF_UINT32, _GGUF_INT32 = 4, 5


def set_eos(source: Path, target: Path, token_id: int) -> Path:
    """Copy `source` to `target` with another end-of-sequence token id in its metadata: a
    conversion that names the wrong end token. Its model never stops on its own (every
    answer runs to max_tokens), at the same speed and with the same first tokens: what the
    live answers' `unfinished` sign must catch (kvfleet.router.answers)."""
    data = bytearray(source.read_bytes())
    at = data.find(len(EOS_KEY).to_bytes(8, "little") + EOS_KEY)
    if at < 0:
        raise ValueError(f"{source}: no {EOS_KEY.decode()} in its metadata")
    at += 8 + len(EOS_KEY)
    kind = int.from_bytes(data[at:at + 4], "little")
    if kind not in (_GGUF_UINT32, _GGUF_INT32):
        raise ValueError(f"{source}: {EOS_KEY.decode()} has GGUF type {kind}, not a 32-bit int")
    data[at + 4:at + 8] = token_id.to_bytes(4, "little")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(bytes(data))
    return target
