"""The offline API on the real SmolLM2-135M-Instruct: text, chat, sampling, errors, CLI."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvfleet.cli import main
from kvfleet.engine.errors import InvalidRequestError, ModelLoadError
from kvfleet.engine.llm import LLM
from kvfleet.engine.model.loader import load_model
from kvfleet.engine.request import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    # Batch-invariant: the seeded-sampling test compares a request alone and in a batch.
    yield LLM(show_progress=False, kv_cache_memory_bytes=64 * 2**20, batch_invariant=True)


def test_chat_and_plain_prompts(llm: LLM) -> None:
    chat, plain = llm.generate(
        [[{"role": "user", "content": "What is the capital of France?"}],
         "The capital of France is"],
        SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)
    assert "Paris" in chat.text
    assert chat.finish_reason in ("stop", "length") and plain.finish_reason == "length"
    assert len(plain.token_ids) == 24 and plain.text
    for output in (chat, plain):
        assert output.first_token_time is not None and output.finish_time is not None
        assert output.arrival_time <= output.first_token_time <= output.finish_time
    stats = llm.stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0.0


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(llm: LLM) -> None:
    seeded = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234,
                            ignore_eos=True)
    other = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    (alone,) = llm.generate("Once upon a time", seeded, use_tqdm=False)
    batch = llm.generate(["A long time ago", "Once upon a time", "In a cluster far away"],
                         [other, seeded, other], use_tqdm=False)
    assert batch[1].token_ids == alone.token_ids


def test_stop_string_cuts_the_text(llm: LLM) -> None:
    (full,) = llm.generate("1, 2, 3, 4,", SamplingParams(max_tokens=16, temperature=0.0),
                           use_tqdm=False)
    assert " 6" in full.text, full.text
    (cut,) = llm.generate("1, 2, 3, 4,", SamplingParams(max_tokens=16, temperature=0.0,
                                                        stop=(" 6",)), use_tqdm=False)
    assert cut.finish_reason == "stop" and cut.text == full.text[:full.text.index(" 6")]


def test_prompt_plus_max_tokens_beyond_the_context_is_refused(llm: LLM) -> None:
    context = llm.model.config.max_context
    with pytest.raises(InvalidRequestError, match="exceeds the model's context") as exc:
        llm.generate("Hello", SamplingParams(max_tokens=context), use_tqdm=False)
    assert exc.value.field == "sampling_params.max_tokens"
    with pytest.raises(InvalidRequestError) as exc:
        llm.generate("", use_tqdm=False)
    assert exc.value.field == "prompt"


def test_unknown_and_corrupt_model_files(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such file"):
        load_model(tmp_path / "missing.gguf", show_progress=False)
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(ModelLoadError) as exc:
        load_model(corrupt, show_progress=False)
    assert str(corrupt) in str(exc.value)


def test_cli_generate_prints_the_completion(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["generate", "--no-progress", "--chat", "--max-tokens", "16",
                 "What is the capital of France?"])
    assert code == 0
    assert "Paris" in capsys.readouterr().out


def test_int8_activations_stay_close_to_float32_and_refuse_batch_invariance() -> None:
    prompts = ["The capital of France is", "def fibonacci(n):\n", "Kubernetes operators watch",
               "Once upon a time,", "1, 2, 3, 4,", "The GPU is a", "SQL joins are"]
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    llm = LLM(show_progress=False, kv_cache_memory_bytes=64 * 2**20)

    def alone() -> list[tuple[int, ...]]:  # one request at a time: 1-row decode steps
        return [llm.generate([p], greedy, use_tqdm=False)[0].token_ids for p in prompts]

    exact = alone()
    llm.model.model.use_activation_rounding(2, False)
    rounded = alone()
    # Measured on this model (bench/kv_dtype.py): ~0.7 of positions agree, about half of the
    # continuations are identical; a wrong nibble or scale would agree on next to none.
    agreement = sum(sum(x == y for x, y in zip(a, b, strict=True)) / len(a)
                    for a, b in zip(exact, rounded, strict=True)) / len(prompts)
    assert agreement > 0.4, (agreement, exact, rounded)
    assert exact != rounded  # the 8-bit path really ran
    with pytest.raises(ValueError, match="--int8-activations round"):
        LLM(show_progress=False, batch_invariant=True, int8_activations=True)
    with pytest.raises(ValueError, match="drop --int16-activations or --batch-invariant"):
        LLM(show_progress=False, batch_invariant=True, int16_activations=True)
