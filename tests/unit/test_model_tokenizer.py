"""Tokenizer (from GGUF metadata), incremental detokenizer and chat template, on the tiny vocab."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_llama import CHAT_TEMPLATE, MERGES, vocab_tokens

from kvfleet.engine.chat_template import ChatTemplate
from kvfleet.engine.errors import InvalidRequestError, ModelLoadError, UnsupportedModelError
from kvfleet.engine.tokenizer import GGUFTokenizerSpec, IncrementalDetokenizer, Tokenizer


def spec(**overrides: object) -> GGUFTokenizerSpec:
    tokens, types = vocab_tokens()
    fields: dict[str, object] = dict(
        model="gpt2",
        tokens=tokens,
        token_types=types,
        merges=MERGES,
        bos_token_id=1,
        eos_token_id=2,
        add_bos_token=False,
        pre="smollm",
    )
    fields.update(overrides)
    return GGUFTokenizerSpec(**fields)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(spec(), "tiny.gguf")


def test_bpe_merges_and_special_tokens(tokenizer: Tokenizer) -> None:
    hello, world = tokenizer.token_to_id("hello"), tokenizer.token_to_id("Ġworld")
    assert hello is not None and world is not None
    assert tokenizer.encode("hello world") == [hello, world]
    # Special tokens in the text are matched whole, never split into bytes.
    assert tokenizer.encode("<|im_start|>hello<|im_end|>") == [1, hello, 2]
    assert tokenizer.special_token_ids == {0, 1, 2}
    assert tokenizer.decode([1, hello, 2]) == "<|im_start|>hello<|im_end|>"
    assert tokenizer.decode([1, hello, 2], skip_special_tokens=True) == "hello"


@pytest.mark.parametrize("text", ["", " ", "héllo", "日本語 🤖", "tabs\tand\nlines\r\n", "ÿ\x00"])
def test_roundtrip_of_arbitrary_unicode(tokenizer: Tokenizer, text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_bos_is_added_only_when_the_file_says_so() -> None:
    with_bos = Tokenizer.from_gguf(spec(add_bos_token=True), "tiny.gguf")
    assert with_bos.encode("hello")[0] == 1
    assert with_bos.encode("hello", add_special_tokens=False)[0] != 1


def test_unsupported_vocabulary_type_is_a_typed_error() -> None:
    with pytest.raises(UnsupportedModelError, match=r"tokenizer\.ggml\.model is 'llama'"):
        Tokenizer.from_gguf(spec(model="llama"), "x.gguf")
    with pytest.raises(ModelLoadError, match="malformed BPE merge"):
        Tokenizer.from_gguf(spec(merges=["nospace"]), "x.gguf")


def test_missing_tokenizer_json_is_a_typed_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"unreadable tokenizer\.json"):
        Tokenizer.from_hf_files(
            tmp_path / "tokenizer.json", bos_token=None, eos_token=None, add_bos_token=False
        )


def test_incremental_detokenizer_holds_back_split_utf8(tokenizer: Tokenizer) -> None:
    text = "hello wörld 🤖!"
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=tokenizer.encode("prompt"))
    deltas = [detok.add_tokens([token]) for token in ids]
    # The emoji is 4 byte-tokens: nothing may be emitted until its last byte arrives.
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text == detok.text
    emoji_start = deltas.index("🤖") if "🤖" in deltas else -1
    assert emoji_start > 0 and deltas[emoji_start - 3 : emoji_start] == ["", "", ""]


def test_incremental_detokenizer_flushes_an_incomplete_tail(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ok 🤖")
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add_tokens(ids[:-1]) == "ok "
    assert detok.flush() == "\ufffd"
    assert detok.text == "ok \ufffd"


def test_incremental_detokenizer_skips_special_tokens(tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add_tokens(tokenizer.encode("hello")) == "hello"
    assert detok.add_tokens([2]) == ""
    assert detok.text == "hello"


# --- chat template ----------------------------------------------------------------------------


def test_chat_template_renders_messages_and_generation_prompt() -> None:
    template = ChatTemplate(CHAT_TEMPLATE)
    messages = [{"role": "user", "content": "hi"}]
    assert template.render(messages) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert (
        template.render(messages, add_generation_prompt=False) == "<|im_start|>user\nhi<|im_end|>\n"
    )


def test_chat_template_exposes_special_tokens_and_raise_exception() -> None:
    source = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}"
        "{% endif %}{{ bos_token }}{{ messages[0]['content'] | tojson }}{{ eos_token }}"
    )
    template = ChatTemplate(source, bos_token="<s>", eos_token="</s>")
    assert template.render([{"role": "user", "content": 'a"b'}]) == '<s>"a\\"b"</s>'
    with pytest.raises(InvalidRequestError, match="first must be user") as info:
        template.render([{"role": "assistant", "content": "x"}])
    assert info.value.field == "messages"
    # The template's refusal of a well-formed conversation is the model's, not the client's:
    # its own code, which the router counts against the revision.
    assert info.value.code == "chat_template_rejected"
    from kvfleet.router.outcome import Outcome, classify

    assert classify(400, info.value.code) is Outcome.REVISION_REFUSED
    assert classify(400, "invalid_request_error") is Outcome.CLIENT_ERROR


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        ([], "messages"),
        ([{"role": "wizard", "content": "x"}], "messages[0].role"),
        (
            [{"role": "user", "content": "ok"}, {"role": "user", "content": 3}],
            "messages[1].content",
        ),
        (["just a string"], "messages[0]"),
    ],
)
def test_invalid_conversations_name_the_field(messages: list[object], field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        ChatTemplate(CHAT_TEMPLATE).render(messages)  # type: ignore[arg-type]
    assert info.value.field == field


def test_template_cannot_reach_python_internals() -> None:
    template = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(InvalidRequestError, match="chat template failed"):
        template.render([{"role": "user", "content": "x"}])


def test_broken_template_source_is_a_load_error() -> None:
    with pytest.raises(ModelLoadError, match="does not compile"):
        ChatTemplate("{% for m in messages %}", origin="model.gguf")
