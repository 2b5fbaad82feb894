"""Llama, Mistral, Qwen2 and Qwen3 checkpoints vs HF transformers' own implementation of each.

Each test makes a small random-weight model with transformers (`<Arch>ForCausalLM` from a
config, every weight, bias and norm drawn at random so none is a no-op), saves it with
`save_pretrained` beside the SmolLM2 tokenizer (HF files: tokenizer.json, tokenizer_config.json,
chat_template.jinja), loads the directory with kvfleet, and compares prompt logits (chunked
prefill over the paged cache) and greedy continuations token for token. The reference runs
HF's eager attention over the whole sequence at every step: no cache of its own to trust.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvfleet.engine.config import CacheConfig, SchedulerConfig
from kvfleet.engine.engine import build_engine_core
from kvfleet.engine.errors import InvalidRequestError
from kvfleet.engine.llm import LLM
from kvfleet.engine.model.loader import LoadedModel, load_model
from kvfleet.engine.model_runner import ModelRunner
from kvfleet.engine.request import SamplingParams
from kvfleet.engine.scheduler_output import ScheduledChunk, SchedulerOutput

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16
NUM_NEW_TOKENS = 24
# float32 rounding of two implementations; a wrong bias, norm or RoPE moves logits by O(1)
# (logits here spread over about +-6).
LOGIT_ATOL = 1e-4
SHAPE = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "initializer_range": 0.2,
         "max_position_embeddings": 256, "rms_norm_eps": 1e-6}
# What each architecture adds to Llama, made visible: Llama with biases on all four
# projections, Mistral with a sliding window (capping the context), Qwen2 (q/k/v biases,
# tied embeddings), Qwen3 (q/k head norms, a head_dim that is not hidden / heads).
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "llama": {"attention_bias": True, "rope_theta": 500000.0},
    "mistral": {"sliding_window": 96},
    "qwen2": {"tie_word_embeddings": True},
    "qwen3": {"head_dim": 32, "rope_theta": 1000000.0},
}
CHATS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "What color is the sky?"}],
    [{"role": "user", "content": "Kubernetes operators watch custom resources and take "
                                 "small, idempotent steps."}],
]


def hf_model(arch: str, vocab_size: int, seed: int) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(arch, vocab_size=vocab_size, **SHAPE, **ARCHITECTURES[arch])
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:  # around 1, as trained norms are; not all ones
                parameter.copy_(1 + 0.3 * torch.randn_like(parameter))
            else:
                parameter.normal_(0, 0.2)
    return model


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
               hf_smollm_tokenizer: Any) -> tuple[str, Any, LoadedModel]:
    arch = request.param
    reference = hf_model(arch, len(hf_smollm_tokenizer), seed=sorted(ARCHITECTURES).index(arch))
    directory = tmp_path_factory.mktemp(arch)
    reference.save_pretrained(directory)
    hf_smollm_tokenizer.save_pretrained(directory)
    assert list(directory.glob("*.safetensors"))
    return arch, reference, load_model(directory, show_progress=False)


def prompts(tokenizer: Any) -> list[list[int]]:
    return [list(tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True,
                                               return_dict=False)) for c in CHATS]


def test_config_says_what_each_architecture_adds(
        checkpoint: tuple[str, Any, LoadedModel]) -> None:
    arch, reference, loaded = checkpoint
    config = loaded.config
    assert config.architecture == arch
    hf = reference.config
    assert config.head_dim == getattr(hf, "head_dim", hf.hidden_size // hf.num_attention_heads)
    assert config.attention_bias == (arch in ("llama", "qwen2"))
    assert config.output_bias == (arch == "llama")
    assert config.qk_norm == (arch == "qwen3")
    assert config.tie_word_embeddings == (arch == "qwen2")
    assert config.max_context == (96 if arch == "mistral" else 256)
    ours = sum(p.numel() for p in loaded.model.parameters())  # a tied head counted once
    assert config.num_params() == sum(p.numel() for p in reference.parameters()) == ours


@torch.inference_mode()
def test_prompt_logits_match_hf(checkpoint: tuple[str, Any, LoadedModel],
                                hf_smollm_tokenizer: Any) -> None:
    """All prompts prefilled together in chunks that end inside blocks; the logits at each
    chunk's end against HF's at that position."""
    arch, reference, loaded = checkpoint
    ids = prompts(hf_smollm_tokenizer)
    expected = [reference(torch.tensor([p])).logits[0] for p in ids]
    tables, next_block = [], 0
    for p in ids:
        count = -(-len(p) // BLOCK_SIZE)
        tables.append(tuple(range(next_block, next_block + count)))
        next_block += count
    runner = ModelRunner(loaded, num_blocks=next_block, block_size=BLOCK_SIZE)
    worst = 0.0
    for lo, hi in ((0, 7), (7, 21), (21, None)):
        chunks = []
        for i, p in enumerate(ids):
            end = len(p) if hi is None else min(hi, len(p))
            if lo < end:
                chunks.append(ScheduledChunk(str(i), tuple(p[lo:end]), lo,
                                             tables[i][: -(-end // BLOCK_SIZE)], sample=True))
        logits = runner.execute(SchedulerOutput(
            chunks=tuple(chunks), num_scheduled_tokens=sum(len(c.token_ids) for c in chunks)))
        for c in chunks:
            theirs = expected[int(c.request_id)][c.start_position + len(c.token_ids) - 1]
            diff = (logits[c.request_id] - theirs).abs().max().item()
            worst = max(worst, diff)
            assert diff <= LOGIT_ATOL, (arch, c.request_id, c.start_position, diff)
            assert int(logits[c.request_id].argmax()) == int(theirs.argmax())
    print(f"{arch}: max |logit - HF logit| = {worst:.2e}")


def test_greedy_continuations_match_hf_token_for_token(
        checkpoint: tuple[str, Any, LoadedModel], hf_smollm_tokenizer: Any) -> None:
    arch, reference, loaded = checkpoint
    core = build_engine_core(loaded, CacheConfig(block_size=BLOCK_SIZE, num_blocks=64),
                             SchedulerConfig(max_num_batched_tokens=32,
                                             long_prefill_token_threshold=16))
    llm = LLM.from_core(core, loaded.tokenizer, loaded.chat_template)
    ids = prompts(hf_smollm_tokenizer)
    # Within Mistral's 96-token window, where HF's sliding attention equals full attention.
    new_tokens = min(NUM_NEW_TOKENS, loaded.config.max_context - max(map(len, ids)))
    assert new_tokens >= 8
    greedy = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(list(CHATS), greedy, use_tqdm=False)  # the engine's own template
    assert [list(o.prompt_token_ids) for o in outputs] == ids
    with torch.inference_mode():
        for output, prompt in zip(outputs, ids, strict=True):
            sequence = list(prompt)
            for _ in range(new_tokens):
                sequence.append(int(reference(torch.tensor([sequence])).logits[0, -1].argmax()))
            assert list(output.token_ids) == sequence[len(prompt):], arch
    assert core.stats().num_running == 0


@pytest.mark.parametrize("checkpoint", ["mistral"], indirect=True)
def test_a_sliding_window_caps_the_context(checkpoint: tuple[str, Any, LoadedModel]) -> None:
    """Mistral's window (96) is the longest sequence it serves: a request that would outgrow
    it is refused up front, naming the limit, instead of attending wrongly past it."""
    _, _, loaded = checkpoint
    core = build_engine_core(loaded, CacheConfig(block_size=BLOCK_SIZE, num_blocks=64),
                             SchedulerConfig())
    llm = LLM.from_core(core, loaded.tokenizer, loaded.chat_template)
    with pytest.raises(InvalidRequestError, match="96"):
        llm.generate(prompt_token_ids=[[5] * 80], sampling_params=SamplingParams(max_tokens=32),
                     use_tqdm=False)


def test_hf_files_layout(checkpoint: tuple[str, Any, LoadedModel]) -> None:
    """What transformers saved is what the loader read: the template from chat_template.jinja
    (not tokenizer_config.json, where older versions kept it)."""
    _, _, loaded = checkpoint
    assert loaded.chat_template is not None
    directory = Path(loaded.path)
    assert (directory / "chat_template.jinja").is_file() or "chat_template" in (
        directory / "tokenizer_config.json").read_text()


def test_bring_your_own_checkpoint_describe_fetch_verify_and_serve(
        checkpoint: tuple[str, Any, LoadedModel], tmp_path: Path) -> None:
    """`kvfleet artifact from-hf` describes the saved folder (every file the engine reads,
    its digests, shapes as the engine sees them), the compatibility matrix accepts it, `fetch`
    brings the files into a cache folder, and that folder loads and passes the engine's own
    checks against the manifest: weights, tokenizer and chat template."""
    from kvfleet.api.hf_artifact import artifact_from_hf
    from kvfleet.compat import check
    from kvfleet.engine.fetch import Cache, FileSpec, fetch
    from kvfleet.engine.model.verify import verify_manifest, verify_weights

    arch, reference, loaded = checkpoint
    directory = Path(loaded.path)
    artifact = artifact_from_hf(directory, name=f"tiny-{arch}", uri_base="s3://models/tiny")
    spec = artifact.spec
    names = sorted(f.uri.rsplit("/", 1)[1] for f in spec.weights.files)
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
            "model.safetensors"} <= set(names)
    assert all(f.uri.startswith("s3://models/tiny/") for f in spec.weights.files)
    config = loaded.config
    assert (spec.architecture.name, spec.architecture.head_dim,
            spec.architecture.max_context_length) == (arch, config.head_dim, config.max_context)
    assert spec.architecture.num_parameters == sum(p.numel() for p in reference.parameters())
    assert spec.tokenizer.sha256 == loaded.tokenizer_sha256
    assert spec.chat_template is not None
    assert spec.chat_template.sha256 == loaded.chat_template_sha256
    assert spec.special_tokens.eos_token_id == loaded.tokenizer.eos_token_id
    assert check(spec) == []

    local = artifact_from_hf(directory, name=f"tiny-{arch}")  # file:// URIs
    files = [FileSpec(f.uri, f.sha256, f.size_bytes) for f in local.spec.weights.files]
    folder = fetch(files, Cache(tmp_path / "cache"), progress=lambda *_: None)
    verify_weights(folder, [f.sha256 for f in files])
    fetched = load_model(folder, show_progress=False)
    verify_manifest(fetched, tokenizer_sha256=spec.tokenizer.sha256,
                    chat_template_sha256=spec.chat_template.sha256)
    assert torch.equal(fetched.model.embed_tokens, loaded.model.embed_tokens)

    # The command line writes the same object.
    from kvfleet.api import ModelArtifact, load_objects, manifest_hash
    from kvfleet.cli import main

    out = tmp_path / "artifact.yaml"
    assert main(["artifact", "from-hf", str(directory), "--name", f"tiny-{arch}",
                 "--uri-base", "s3://models/tiny", "-o", str(out)]) == 0
    (written,) = load_objects(out)
    assert isinstance(written, ModelArtifact)
    assert manifest_hash(written.spec) == manifest_hash(spec)
