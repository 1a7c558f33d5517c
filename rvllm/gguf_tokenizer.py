"""Building a tokenizer from the vocabulary a GGUF file carries in its metadata.

A GGUF has no tokenizer.json: it stores tokens, merges or scores, token types and
special ids under llama.cpp's `tokenizer.ggml.*` keys. We rebuild from those the
`tokenizers` pipeline of the model's original tokenizer.json (or, where transformers 5
rebuilds that pipeline in code, of its tokenizer class), so ids and decoded text match
transformers on the original model.

For a byte-level vocabulary (`tokenizer.ggml.model` "gpt2") the pre-tokenizer is not
stored; llama.cpp's converter names it in `tokenizer.ggml.pre`, and `_PRE_TOKENIZERS`
maps those names to the original split (from llama.cpp's src/llama-vocab.cpp, checked
against the models' tokenizer.json where llama.cpp adapts a regex). A SentencePiece
vocabulary ("llama") adds a leading "▁" unless `tokenizer.ggml.add_space_prefix` is false
(Gemma); Phi-3 adds it with a normalizer, as its tokenizer.json does.
"""

import logging
import os
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

from rvllm.models.gguf_file import GGUFFile, open_gguf

logger = logging.getLogger(__name__)

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
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# DeepSeek's Split chains, as in the tokenizer.json of deepseek-ai/deepseek-llm-7b-base
# (also DeepSeek-V2), deepseek-coder-6.7b-base and DeepSeek-V3; llama.cpp's
# src/llama-vocab.cpp (LLAMA_VOCAB_PRE_TYPE_DEEPSEEK_LLM, _DEEPSEEK_CODER, _DEEPSEEK3_LLM)
# carries the same regexes. The letter class below is spelled with escapes only.
_DEEPSEEK_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK_LLM_SPLITS = (
    r"[\r\n]",
    "\\s?[A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
    "\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5"
    "\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a"
    "\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d"
    "\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3"
    "\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115"
    "\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
    "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f"
    "\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    r"\s+$",
    _DEEPSEEK_CJK,
)
_DEEPSEEK_CODER_SPLITS = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _DEEPSEEK_CJK)
_DEEPSEEK_V3_SPLITS = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)


@dataclass(frozen=True)
class _PreTokenizer:
    """A byte-level pre-tokenizer: `splits` (each an isolating Split), then, with `digits`,
    every digit on its own, then ByteLevel, which applies GPT-2's regex itself when
    `gpt2_regex`. `ignore_merges`: a piece that is a whole token is kept (Llama 3)."""

    splits: tuple[str, ...] = ()
    digits: bool = False
    gpt2_regex: bool = False
    ignore_merges: bool = False


_GPT2 = _PreTokenizer(gpt2_regex=True)
# tokenizer.ggml.pre -> the pre-tokenizer its merges were learned with; the names and
# groups are llama.cpp's (llama_vocab::impl::load). Anything else gets _GPT2, with a warning.
# fmt: off
_PRE_TOKENIZERS = {
    **dict.fromkeys(
        ("gpt-2", "phi-2", "mpt", "olmo", "jais", "trillion", "granite-docling", "gigachat",
         "a.x-4.0", "mellum", "modern-bert", "exaone4", "roberta-bpe", "jina-es", "jina-de",
         "jina-v1-en", "jina-v2-es", "jina-v2-de", "jina-v2-code"),
        _GPT2,
    ),
    # StarCoder, SmolLM, Command-R, ...: Digits(individual_digits) then GPT-2's ByteLevel.
    **dict.fromkeys(
        ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b",
         "mellum2"),
        _PreTokenizer(digits=True, gpt2_regex=True),
    ),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
         "lfm2", "jina-v5-nano", "glm4", "glm5"),
        _PreTokenizer(splits=(_LLAMA3_SPLIT,), ignore_merges=True),
    ),
    **dict.fromkeys(("dbrx", "smaug-bpe", "chatglm-bpe"), _PreTokenizer(splits=(_LLAMA3_SPLIT,))),
    **dict.fromkeys(
        ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan",
         "solar-open", "grok-2"),
        _PreTokenizer(splits=(_QWEN2_SPLIT,)),
    ),
    "qwen35": _PreTokenizer(splits=(_QWEN35_SPLIT,)),
    **dict.fromkeys(
        ("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"),
        _PreTokenizer(splits=(_GPT4O_SPLIT,)),
    ),
    "tekken": _PreTokenizer(splits=(_TEKKEN_SPLIT,), ignore_merges=True),
    "deepseek-llm": _PreTokenizer(splits=_DEEPSEEK_LLM_SPLITS, digits=True),
    "deepseek-coder": _PreTokenizer(splits=_DEEPSEEK_CODER_SPLITS, digits=True),
    **dict.fromkeys(
        ("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"),
        _PreTokenizer(splits=_DEEPSEEK_V3_SPLITS),
    ),
}
# fmt: on
# SentencePiece architectures whose tokenizer.json prepends "▁" with a normalizer rather
# than Metaspace: "  hi" is "▁▁▁hi" there, "▁▁hi" with Metaspace.
_PREPEND_NORMALIZER_ARCHS = frozenset({"phi3"})
# Gemma files store a token of two or more spaces as real spaces, and their scores do not
# follow the merge order; the order of the tokens does (as transformers' GGUF loader reads them).
_GEMMA_ARCHS = frozenset({"gemma", "gemma2", "gemma3", "gemma3n"})


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: printable bytes stand for themselves, the rest for 256 + n."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = iter(range(256, 512))
    return {b: chr(b if b in printable else next(extra)) for b in range(256)}


def _pre_tokenizer_for(pre: str | None) -> _PreTokenizer:
    if (known := _PRE_TOKENIZERS.get(pre or "")) is not None:
        return known
    logger.warning(
        "GGUF tokenizer.ggml.pre %r is not a pre-tokenizer rvllm knows; splitting text with "
        "GPT-2's regex, which may tokenize differently from the original model",
        pre,
    )
    return _GPT2


def _byte_level_backend(
    tokens: list[str], token_types: list[int], merges: list[tuple[str, str]], pre: str | None
) -> BackendTokenizer:
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    # A token written outside the byte alphabet is stored as text; respell its bytes. Not an
    # added (control or user-defined) one, like DeepSeek's "<｜begin▁of▁sentence｜>": it is
    # matched whole in the text, so its own spelling must name its id.
    if set("".join(tokens)) <= alphabet:  # the usual case, checked at once (49k tokens)
        vocab = {tok: i for i, tok in enumerate(tokens)}
    else:
        vocab = {
            tok if set(tok) <= alphabet or kind in (_CONTROL, _USER_DEFINED)
            else "".join(spelling[b] for b in tok.encode()): i
            for i, (tok, kind) in enumerate(zip(tokens, token_types))
        }  # fmt: skip
    spec = _pre_tokenizer_for(pre)
    model = BPE(
        vocab, merges, dropout=None, continuing_subword_prefix="", end_of_word_suffix="",
        fuse_unk=False, byte_fallback=False, ignore_merges=spec.ignore_merges,
    )  # fmt: skip
    backend = BackendTokenizer(model)
    steps = [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in spec.splits]
    if spec.digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=spec.gpt2_regex)
    backend.pre_tokenizer = pre_tokenizers.Sequence([*steps, byte_level]) if steps else byte_level
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


def _merges(
    metadata: dict[str, Any], tokens: list[str], by_position: bool = False
) -> list[tuple[str, str]]:
    """The merges the file lists, or else the ones its token scores (or, `by_position`,
    the order of its tokens) imply."""
    if (merges := metadata.get("tokenizer.ggml.merges")) is not None:
        return [tuple(m.split(" ", 1)) for m in merges]
    if by_position:
        return _merges_from_scores(tokens, [-float(i) for i in range(len(tokens))])
    scores = metadata.get("tokenizer.ggml.scores")
    return _merges_from_scores(tokens, scores) if scores is not None else []


def _sentencepiece_backend(
    tokens: list[str], merges: list[tuple[str, str]], *, space_prefix: str | None,
    unk_token: str | None,
) -> BackendTokenizer:  # fmt: skip
    """`space_prefix`: "metaspace" prepends "▁" to the text's first piece (transformers'
    LlamaTokenizer), "normalizer" to every stretch between added tokens (Phi-3's
    tokenizer.json), None never (Gemma: add_space_prefix false)."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    unk = unk_token if unk_token in vocab else None
    backend = BackendTokenizer(
        BPE(vocab, merges, dropout=None, fuse_unk=True, byte_fallback=True, unk_token=unk)
    )
    strip = [decoders.Strip(content=" ", left=1, right=0)]
    if space_prefix == "metaspace":
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=_SPIECE_SPACE, prepend_scheme="first", split=False
        )
    elif space_prefix == "normalizer":
        backend.normalizer = normalizers.Sequence([
            normalizers.Prepend(_SPIECE_SPACE), normalizers.Replace(" ", _SPIECE_SPACE),
        ])  # fmt: skip
    else:  # GemmaTokenizer's pipeline: spaces become "▁", nothing is prepended or stripped.
        backend.normalizer = normalizers.Replace(" ", _SPIECE_SPACE)
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
        strip = []
    backend.decoder = decoders.Sequence([
        decoders.Replace(_SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), *strip,
    ])  # fmt: skip
    return backend


def _add_special_tokens(
    backend: BackendTokenizer, tokens: list[str], token_types: list[int], named: list[str]
) -> None:
    """Control tokens become special added tokens, user-defined ones plain added
    tokens, so both match whole in text; then any named special token not yet added."""
    control = [
        AddedToken(tok, normalized=False, special=True)
        for tok, kind in zip(tokens, token_types)
        if kind == _CONTROL
    ]
    backend.add_special_tokens(control)
    user = [tok for tok, kind in zip(tokens, token_types) if kind == _USER_DEFINED]
    if user:  # the whole vocabulary as a dict is a 50 ms call: only when needed
        vocab = backend.get_vocab()
        backend.add_tokens([AddedToken(tok, normalized=False, special=False)
                            for tok in user if tok in vocab])
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
    arch = metadata.get("general.architecture")
    if model == "gpt2":
        merges = _merges(metadata, tokens)
        pre = metadata.get("tokenizer.ggml.pre")
        backend = _byte_level_backend(tokens, token_types, merges, pre)
    elif model == "llama":
        gemma = arch in _GEMMA_ARCHS
        # llama.cpp's Gemma converter writes added whitespace tokens ("▁▁") as spaces.
        pieces = [
            _SPIECE_SPACE * len(t) if gemma and " " in t and not t.strip() else t for t in tokens
        ]
        if not metadata.get("tokenizer.ggml.add_space_prefix", True):
            space_prefix = None
        elif arch in _PREPEND_NORMALIZER_ARCHS:
            space_prefix = "normalizer"
        else:
            space_prefix = "metaspace"
        backend = _sentencepiece_backend(
            pieces, _merges(metadata, pieces, by_position=gemma), space_prefix=space_prefix,
            unk_token=_special_token(metadata, pieces, "unknown"),
        )  # fmt: skip
    else:
        raise ValueError(
            f"GGUF tokenizer model {model!r} is not supported; supported: 'gpt2', 'llama'"
        )
    named = [_special_token(metadata, tokens, key) for key in ("bos", "eos", "unknown", "padding")]
    _add_special_tokens(backend, tokens, token_types, [t for t in named if t])
    return backend


def _special_token(metadata: dict[str, Any], tokens: list[str], key: str) -> str | None:
    token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
    return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None


# Byte-level pre-tokenizers for which llama.cpp adds BOS when the file does not say.
_ADD_BOS_PRE = frozenset(
    ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
     "jina-v5-nano", "tekken", "chameleon")
)  # fmt: skip


def gguf_tokenizer_args(source: "str | os.PathLike[str] | GGUFFile") -> dict[str, Any]:
    """The arguments of the rvllm `Tokenizer` that a GGUF file's metadata describes, chat
    template included (``tokenizer.tokenizer_from_gguf`` makes it)."""
    gguf = open_gguf(source)
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
    # llama.cpp adds BOS to a SentencePiece vocabulary, and to Llama 3's byte-level one,
    # unless the file says otherwise.
    add_bos_default = (
        meta.get("tokenizer.ggml.model") == "llama"
        or meta.get("tokenizer.ggml.pre") in _ADD_BOS_PRE
    )
    arch = meta.get("general.architecture")
    return dict(
        backend=backend,
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
