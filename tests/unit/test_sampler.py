from __future__ import annotations

import pytest
import torch
from engine_fakes import make_request

from kvfleet.engine.request import Request, SamplingParams
from kvfleet.engine.sampler import Sampler, StepLogits

VOCAB = 32


def request(request_id: str, **params: object) -> Request:
    return make_request(request_id, 4, sampling_params=SamplingParams(**params))  # type: ignore[arg-type]


def logits_for(*requests: Request, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {r.request_id: torch.randn(VOCAB, generator=generator) for r in requests}


def test_temperature_zero_is_argmax() -> None:
    greedy = request("g", temperature=0.0)
    logits = logits_for(greedy)
    assert Sampler().sample(logits, [greedy]) == {"g": int(logits["g"].argmax())}


def test_top_k_one_and_tiny_top_p_are_argmax_too() -> None:
    top_k = request("k", temperature=1.0, top_k=1)
    top_p = request("p", temperature=1.0, top_p=1e-6)
    logits = logits_for(top_k, top_p)
    sampled = Sampler().sample(logits, [top_k, top_p])
    assert sampled == {"k": int(logits["k"].argmax()), "p": int(logits["p"].argmax())}


def test_top_k_restricts_draws_to_the_k_most_likely() -> None:
    sampler = Sampler()
    req = request("k", temperature=5.0, top_k=3, seed=1)
    row = torch.arange(VOCAB, dtype=torch.float32)
    draws = {sampler.sample({"k": row}, [req])["k"] for _ in range(200)}
    assert draws == {VOCAB - 1, VOCAB - 2, VOCAB - 3}


def test_top_p_keeps_the_nucleus() -> None:
    sampler = Sampler()
    req = request("p", temperature=1.0, top_p=0.7, seed=2)
    row = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    draws = {sampler.sample({"p": row}, [req])["p"] for _ in range(300)}
    assert draws == {0, 1}  # 0.5 < 0.7 so token 1 is needed; 0.8 >= 0.7 so no more


def test_seeded_requests_are_reproducible_whatever_the_batch() -> None:
    def draws(batch_size: int) -> list[int]:
        sampler = Sampler()
        target = request("target", temperature=1.0, seed=42)
        others = [request(f"o{i}", temperature=1.0) for i in range(batch_size)]
        out = []
        for step in range(20):
            batch = [*others[: batch_size // 2], target, *others[batch_size // 2:]]
            logits = logits_for(*batch, seed=step)
            logits["target"] = logits_for(target, seed=1000 + step)["target"]
            out.append(sampler.sample(logits, batch)["target"])
        return out

    assert draws(0) == draws(7) == draws(3)
    assert len(set(draws(0))) > 1  # it really samples


def test_different_seeds_give_different_streams() -> None:
    row = torch.zeros(VOCAB)
    streams = []
    for seed in (1, 2):
        sampler = Sampler()
        req = request("r", temperature=1.0, seed=seed)
        streams.append([sampler.sample({"r": row}, [req])["r"] for _ in range(10)])
    assert streams[0] != streams[1]


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    sampler = Sampler(eos_token_ids=[3])
    req = request("r", temperature=0.0, min_tokens=2, stop_token_ids=(5,))
    row = torch.zeros(VOCAB)
    row[3], row[5], row[7] = 10.0, 9.0, 1.0
    assert sampler.sample({"r": row}, [req]) == {"r": 7}
    req.append_output_token(7, 0.0)
    assert sampler.sample({"r": row}, [req]) == {"r": 7}
    req.append_output_token(7, 0.0)
    assert sampler.sample({"r": row}, [req]) == {"r": 3}


def test_ignore_eos_leaves_eos_unmasked_for_min_tokens() -> None:
    sampler = Sampler(eos_token_ids=[3])
    req = request("r", temperature=0.0, min_tokens=2, ignore_eos=True)
    row = torch.zeros(VOCAB)
    row[3] = 10.0
    assert sampler.sample({"r": row}, [req]) == {"r": 3}


def test_forget_drops_the_generator() -> None:
    sampler = Sampler()
    req = request("r", temperature=1.0, seed=3)
    row = torch.zeros(VOCAB)
    first = [sampler.sample({"r": row}, [req])["r"] for _ in range(5)]
    sampler.forget(["r"])
    again = [sampler.sample({"r": row}, [req])["r"] for _ in range(5)]
    assert first == again


def test_step_logits_in_sampling_order_are_read_in_place_and_sample_as_a_mapping_does() -> None:
    eos = 3
    reqs = [request("a", temperature=0.0), request("b", temperature=0.0, min_tokens=1),
            request("c", temperature=1.0, seed=5)]
    rows = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(4))
    rows[1, eos] = 100.0  # b's best token is eos, masked until its first token
    as_dict = {r.request_id: row.clone() for r, row in zip(reqs, rows, strict=True)}
    expected = Sampler(eos_token_ids=[eos]).sample(as_dict, reqs)
    step = StepLogits([r.request_id for r in reqs], rows)
    assert Sampler(eos_token_ids=[eos]).sample(step, reqs) == expected
    assert rows[1, eos] == float("-inf")  # masked in the runner's own tensor: no copy was made
    # Another order (or a subset) is sampled from the rows by id.
    assert Sampler(eos_token_ids=[eos]).sample(step, reqs[::-1]) == expected
    assert Sampler().sample(step, reqs[:1]) == {"a": expected["a"]}
    assert list(step) == ["a", "b", "c"] and torch.equal(step["b"], rows[1])
    assert StepLogits.empty() == {}


def test_step_logits_need_one_row_per_request_id() -> None:
    with pytest.raises(ValueError, match=r"2 request ids for logits of shape \(3, 32\)"):
        StepLogits(["a", "b"], torch.zeros(3, VOCAB))
