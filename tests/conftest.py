"""Set for the whole test process before anything imports Triton.

Triton decides when `triton.language` is imported whether its functions run compiled or
interpreted, so the interpreter (`TRITON_INTERPRET=1`: the GPU kernels run on this CPU, on CPU
tensors) must be on before the first import. On a machine with a GPU, `TRITON_INTERPRET=0`
runs the same tests compiled on the device.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
