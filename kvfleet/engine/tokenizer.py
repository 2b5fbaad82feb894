"""Tokenizer: text <-> token ids, built from GGUF metadata or a HF `tokenizer.json`.

GGUF files carry their vocabulary as metadata (`tokenizer.ggml.*`). For byte-level BPE
vocabularies (`tokenizer.ggml.model == "gpt2"`, e.g. SmolLM2) we rebuild the exact
`tokenizers` pipeline HF transformers builds from the same file: BPE over the byte-level
alphabet, GPT-2 split regex, byte-level decoder, and every CONTROL token added as a special
token so it is matched whole (`<|im_start|>` is one token, not seven).

`IncrementalDetokenizer` turns a growing list of generated ids into text deltas for streaming
and stop-string checks, holding back text while a multi-byte UTF-8 character is incomplete.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from kvfleet.engine.errors import ModelLoadError, UnsupportedModelError

# llama.cpp token types (gguf.TokenType): 3 = CONTROL (special), 4 = USER_DEFINED (added).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# How many prompt tokens the detokenizer keeps as left context: enough for any tokenizer whose
# decoding of a token depends on its neighbours (leading-space rules), small enough to be cheap.
_DETOKENIZER_CONTEXT = 5

_REPLACEMENT_CHAR = "\ufffd"

# Split rules for `tokenizer.ggml.pre` values whose merges were learned on a non-GPT-2 split.
# The GGUF names the rule; the rule itself is not in the file.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars, strict=True)}


@dataclass(frozen=True, slots=True)
class GGUFTokenizerSpec:
    """The `tokenizer.ggml.*` metadata of a GGUF file, as read by the loader."""

    model: str
    tokens: Sequence[str]
    token_types: Sequence[int]
    merges: Sequence[str]
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos_token: bool
    pre: str | None = None


class Tokenizer:
    """Encodes and decodes text for one model; special-token ids come from the model file."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        add_bos_token: bool,
    ) -> None:
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.add_bos_token = add_bos_token
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.special_token_ids: frozenset[int] = frozenset(
            token_id
            for token_id, added in backend.get_added_tokens_decoder().items()
            if added.special
        )

    @property
    def bos_token(self) -> str:
        return self._token_text(self.bos_token_id)

    @property
    def eos_token(self) -> str:
        return self._token_text(self.eos_token_id)

    def _token_text(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return self._backend.id_to_token(token_id) or ""

    def token_to_id(self, token: str) -> int | None:
        token_id: int | None = self._backend.token_to_id(token)
        return token_id

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, BOS is prepended if the model says so.

        Special-token text in `text` (e.g. `<|im_start|>` from a chat template) becomes its id.
        """
        ids: list[int] = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        text: str = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return text

    def to_json(self) -> str:
        """The pipeline as HF `tokenizer.json` text (what `tokenizers.Tokenizer.from_str`
        reads back): served to the router, which counts prompt tokens with it."""
        text: str = self._backend.to_str()
        return text

    def save(self, path: str | Path) -> None:
        """Write the pipeline as an HF `tokenizer.json` (e.g. to ship it next to safetensors)."""
        self._backend.save(str(path))

    @classmethod
    def from_gguf(cls, spec: GGUFTokenizerSpec, path: str | Path) -> Tokenizer:
        """Rebuild the tokenizer a GGUF file describes; `path` is only used in error messages."""
        if spec.model != "gpt2":
            raise UnsupportedModelError(
                path,
                f"tokenizer.ggml.model is {spec.model!r}; only byte-level BPE ('gpt2') "
                "vocabularies are supported",
                "Use a GGUF with a byte-level BPE vocabulary or an "
                "HF checkpoint directory with tokenizer.json",
            )
        if len(spec.token_types) not in (0, len(spec.tokens)):
            raise ModelLoadError(
                path,
                "tokenizer.ggml.token_type and tokenizer.ggml.tokens differ in length",
                "The file is corrupt; re-download or re-convert it",
            )
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        # Tokens stored as raw text (e.g. special tokens with non-alphabet characters) are
        # respelled in the byte alphabet, as HF does, so BPE can look them up.
        vocab = {
            (
                token
                if set(token) <= alphabet
                else "".join(spelling[b] for b in token.encode("utf-8"))
            ): index
            for index, token in enumerate(spec.tokens)
        }
        merges: list[tuple[str, str]] = []
        for merge in spec.merges:
            left, sep, right = merge.partition(" ")
            if not sep:
                raise ModelLoadError(
                    path,
                    f"malformed BPE merge {merge!r}",
                    "The file is corrupt; re-download or re-convert it",
                )
            merges.append((left, right))
        backend = BackendTokenizer(
            models.BPE(
                vocab=vocab,
                merges=merges,
                dropout=None,
                continuing_subword_prefix="",
                end_of_word_suffix="",
                fuse_unk=False,
            )
        )
        split = _PRE_TOKENIZER_SPLITS.get(spec.pre or "")
        if split is None:
            backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        else:
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(split), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        backend.decoder = decoders.ByteLevel()
        types = spec.token_types or [1] * len(spec.tokens)
        # A CONTROL token spelled outside the byte alphabet is a llama.cpp mislabel; adding it
        # would grow the vocabulary past the embedding, so (like HF) it is skipped.
        backend.add_special_tokens(
            [
                AddedToken(token, normalized=False, special=True)
                for token, kind in zip(spec.tokens, types, strict=True)
                if kind == _TOKEN_TYPE_CONTROL and set(token) <= alphabet
            ]
        )
        backend.add_tokens(
            [
                AddedToken(token, normalized=False, special=False)
                for token, kind in zip(spec.tokens, types, strict=True)
                if kind == _TOKEN_TYPE_USER_DEFINED and token in vocab
            ]
        )
        return cls(
            backend,
            bos_token_id=spec.bos_token_id,
            eos_token_id=spec.eos_token_id,
            add_bos_token=spec.add_bos_token,
        )

    @classmethod
    def from_hf_files(
        cls,
        tokenizer_json: Path,
        *,
        bos_token: str | None,
        eos_token: str | None,
        add_bos_token: bool,
    ) -> Tokenizer:
        """Load an HF `tokenizer.json`; special tokens are named by `tokenizer_config.json`."""
        try:
            backend = BackendTokenizer.from_file(str(tokenizer_json))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed JSON
            raise ModelLoadError(
                tokenizer_json,
                f"unreadable tokenizer.json ({exc})",
                "Re-export the tokenizer with transformers' save_pretrained",
            ) from exc
        # The HF post-processor may already add BOS; encode() adds it itself, so drop it.
        backend.post_processor = None
        bos_id = backend.token_to_id(bos_token) if bos_token else None
        eos_id = backend.token_to_id(eos_token) if eos_token else None
        return cls(backend, bos_token_id=bos_id, eos_token_id=eos_id, add_bos_token=add_bos_token)


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


class IncrementalDetokenizer:
    """Text of a growing list of generated token ids, delivered as deltas.

    Decoding token by token is wrong for byte-level vocabularies (one character may span
    tokens) and for tokenizers whose spacing depends on neighbours, so each step decodes a
    small window `[prefix_offset:]` and emits only what extends the already-emitted window
    `[prefix_offset:read_offset]`. A window ending in U+FFFD is an incomplete UTF-8 sequence:
    nothing is emitted until a later token completes it (or `flush()` at the end).
    """

    def __init__(
        self, tokenizer: Decoder, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-_DETOKENIZER_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def add_tokens(self, new_ids: Iterable[int]) -> str:
        """Append generated ids; return the newly complete text (possibly empty)."""
        self._ids.extend(new_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        # Longest run of the new ids whose text is complete: a batch of ids ending mid-character
        # still releases the characters before it.
        for end in range(len(self._ids), self._read_offset, -1):
            new_text = self._decode(self._ids[self._prefix_offset : end])
            if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT_CHAR):
                delta = new_text[len(prefix_text) :]
                self._prefix_offset = self._read_offset
                self._read_offset = end
                self.text += delta
                return delta
        return ""

    def flush(self) -> str:
        """At the end of generation: emit whatever is held back, incomplete bytes as U+FFFD."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        delta = new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
        self._prefix_offset = self._read_offset = len(self._ids)
        self.text += delta
        return delta
