"""On the real model's weight shapes, the weight-matmul paths the engine picks on this host are
never much slower than `torch.mm` (the plain path), at any row count a step has."""

from __future__ import annotations

import pytest
import torch

from kvfleet.engine.matmul_plan import candidates, measure, routed, time_paths
from kvfleet.engine.model.loader import default_model_path, load_model
from kvfleet.engine.packed_matmul import TorchWeight, load_packer, load_quant_kernel

pytestmark = pytest.mark.slow


@torch.inference_mode()
def test_the_chosen_paths_are_never_more_than_1_5x_slower_than_torch_mm() -> None:
    model = load_model(default_model_path(), show_progress=False).model
    samples = model.weight_samples()
    packer, quant = load_packer(), load_quant_kernel()
    assert quant is not None, "the quantized matmul did not build (see the log)"
    plan = measure(samples, packer, quant)
    ratios: dict[str, float] = {}
    for sample in samples:
        choice = plan.choice(sample.shape)
        assert choice is not None
        chosen = routed(choice, candidates(sample, packer, quant))
        plain = TorchWeight(sample.weight_t)
        for rows in plan.timings[sample.shape.key]:
            # Timed again here, side by side with torch.mm in turns: a ratio, so it holds on a
            # slow or busy host. A ratio over the bound is timed twice more and the best round
            # counts: a burst of other work on a shared 2-core host can land on one path's
            # turns, a path that is really slower is slower in every round.
            ratio = float("inf")
            for _ in range(3):
                times = time_paths({"chosen": chosen, "torch": plain}, rows,
                                   sample.shape.in_features, repeats=7, min_seconds=0.01)
                ratio = min(ratio, times["chosen"] / times["torch"])
                if ratio <= 1.5:
                    break
            ratios[f"{sample.shape.key} @ {rows} rows"] = ratio
    slow = {where: round(r, 2) for where, r in ratios.items() if r > 1.5}
    assert not slow, f"chosen path more than 1.5x slower than torch.mm: {slow}\n{plan.table()}"
