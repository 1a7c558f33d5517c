"""Building a tokenizer from the vocabulary a GGUF file carries in its metadata.

A GGUF has no tokenizer.json: it stores tokens, merges or scores, token types and
special ids under llama.cpp's `tokenizer.ggml.*` keys. We rebuild from those the
same `tokenizers` pipeline that transformers' GGUF converter builds, so ids and
decoded text match `AutoTokenizer.from_pretrained(dir, gguf_file=...)` exactly.
"""

import os
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, decoders, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

from rvllm.models.gguf_loader import GGUFFile

if TYPE_CHECKING:
    from rvllm.tokenizer import Tokenizer

# llama.cpp's token types (tokenizer.ggml.token_type).
_CONTROL, _USER_DEFINED = 3, 4
_SPIECE_SPACE = "\u2581"

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the split regex its merges were learned with. Any other
# value (SmolLM2's "smollm", "gpt2", ...) uses the GPT-2 regex built into ByteLevel.
_PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "smaug-bpe", "dbrx", "lfm2"), _LLAMA3_SPLIT
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2_SPLIT),
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2"), _GPT4O_SPLIT),
}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: printable bytes stand for themselves, the rest for 256 + n."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(256, 512))
    return {b: chr(b if b in printable else next(extra)) for b in range(256)}


def _byte_level_backend(
    tokens: list[str], merges: list[tuple[str, str]], pre: str | None
) -> BackendTokenizer:
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    # A token written outside the byte alphabet is stored as text; respell its bytes.
    vocab = {
        tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode()): i
        for i, tok in enumerate(tokens)
    }
    model = BPE(
        vocab, merges, dropout=None,
        continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False, byte_fallback=False,
    )  # fmt: skip
    backend = BackendTokenizer(model)
    if (split := _PRE_TOKENIZER_SPLITS.get(pre or "")) is not None:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])  # fmt: skip
    else:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return backend


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies: every split of a token into
    two tokens, best-scoring result first (ties: longer left, then right piece first)."""
    ids = {tok: i for i, tok in enumerate(tokens)}
    candidates = []
    for tok, score in dict(zip(tokens, scores)).items():
        splits = [(tok[:k], tok[k:]) for k in range(1, len(tok))]
        splits = [(a, b) for a, b in splits if a in ids and b in ids]
        splits.sort(key=lambda ab: (ids[ab[0]], ids[ab[1]]))
        candidates.extend((a, b, score) for a, b in splits)
    candidates.sort(key=lambda c: (c[2], len(c[0]), len(c[1])), reverse=True)
    return [(a, b) for a, b, _ in candidates]


def _merges(metadata: dict[str, Any], tokens: list[str]) -> list[tuple[str, str]]:
    """The merges the file lists, or else the ones its token scores imply."""
    if (merges := metadata.get("tokenizer.ggml.merges")) is not None:
        return [tuple(m.split(" ", 1)) for m in merges]
    scores = metadata.get("tokenizer.ggml.scores")
    return _merges_from_scores(tokens, scores) if scores is not None else []


def _sentencepiece_backend(tokens: list[str], merges: list[tuple[str, str]]) -> BackendTokenizer:
    vocab = {tok: i for i, tok in enumerate(tokens)}
    backend = BackendTokenizer(BPE(vocab, merges, dropout=None, fuse_unk=True, byte_fallback=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_SPIECE_SPACE, prepend_scheme="first", split=False
    )
    backend.decoder = decoders.Sequence([
        decoders.Replace(_SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(content=" ", left=1, right=0),
    ])  # fmt: skip
    return backend


def _add_special_tokens(
    backend: BackendTokenizer, tokens: list[str], token_types: list[int], byte_level: bool,
    named: list[str],
) -> None:  # fmt: skip
    """Control tokens become special added tokens, user-defined ones plain added
    tokens, so both match whole in text; then any named special token not yet added."""
    alphabet = set(_bytes_to_unicode().values()) if byte_level else None
    # A byte-level "control" token outside the byte alphabet is a llama.cpp mislabel.
    control = [
        AddedToken(tok, normalized=False, special=True)
        for tok, kind in zip(tokens, token_types)
        if kind == _CONTROL and (alphabet is None or set(tok) <= alphabet)
    ]
    backend.add_special_tokens(control)
    vocab = backend.get_vocab()
    backend.add_tokens([
        AddedToken(tok, normalized=False, special=False)
        for tok, kind in zip(tokens, token_types)
        if kind == _USER_DEFINED and tok in vocab
    ])  # fmt: skip
    added = {t.content for t in backend.get_added_tokens_decoder().values()}
    missing = [AddedToken(tok, special=True) for tok in dict.fromkeys(named) if tok not in added]
    backend.add_tokens(missing)


def build_gguf_backend(metadata: dict[str, Any]) -> BackendTokenizer:
    """The `tokenizers.Tokenizer` that a GGUF file's tokenizer metadata describes."""
    model = metadata.get("tokenizer.ggml.model")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ValueError("GGUF metadata has no tokenizer.ggml.tokens")
    token_types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = _merges(metadata, tokens)
    if model == "gpt2":
        backend = _byte_level_backend(tokens, merges, metadata.get("tokenizer.ggml.pre"))
    elif model == "llama":
        backend = _sentencepiece_backend(tokens, merges)
    else:
        raise ValueError(
            f"GGUF tokenizer model {model!r} is not supported; supported: 'gpt2', 'llama'"
        )
    named = [_special_token(metadata, tokens, key) for key in ("bos", "eos", "unknown", "padding")]
    _add_special_tokens(backend, tokens, token_types, model == "gpt2", [t for t in named if t])
    return backend


def _special_token(metadata: dict[str, Any], tokens: list[str], key: str) -> str | None:
    token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
    return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None


def tokenizer_from_gguf(source: "str | os.PathLike[str] | GGUFFile") -> "Tokenizer":
    """The rvllm `Tokenizer` described by a GGUF file's metadata, chat template included."""
    # Imported here so rvllm.tokenizer may itself dispatch to this module for .gguf paths.
    from rvllm.tokenizer import Tokenizer

    gguf = source if isinstance(source, GGUFFile) else GGUFFile(source)
    meta = gguf.metadata
    try:
        backend = build_gguf_backend(meta)
    except ValueError as e:
        raise ValueError(f"{gguf.path}: {e}") from None
    tokens = meta["tokenizer.ggml.tokens"]
    eos_id = meta.get("tokenizer.ggml.eos_token_id")
    # End-of-turn / end-of-message tokens also end generation, as in llama.cpp.
    extra_eos = [
        meta[key] for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        if meta.get(key) is not None and meta[key] != eos_id
    ]  # fmt: skip
    # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise.
    add_bos_default = meta.get("tokenizer.ggml.model") == "llama"
    arch = meta.get("general.architecture")
    return Tokenizer(
        backend,
        bos_token=_special_token(meta, tokens, "bos"),
        eos_token=_special_token(meta, tokens, "eos"),
        pad_token=_special_token(meta, tokens, "padding"),
        unk_token=_special_token(meta, tokens, "unknown"),
        chat_template=meta.get("tokenizer.chat_template"),
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", add_bos_default)),
        add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        extra_eos_token_ids=tuple(dict.fromkeys(extra_eos)),
        clean_up_tokenization_spaces=False,
        model_max_length=meta.get(f"{arch}.context_length"),
    )
