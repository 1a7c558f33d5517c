"""GGUF tokenizers of the families rvllm loads encode and decode like the original model.

A GGUF carries no tokenizer.json, so for each family we build here a tokenizer the way its
original is built (a SentencePiece BPE like Gemma's or Phi-3's; a byte-level BPE behind the
pre-tokenizer of DeepSeek's, SmolLM's or Qwen 3.5's tokenizer.json), write its vocabulary
to a GGUF the way llama.cpp's converter does, and hold rvllm's GGUF tokenizer to
transformers (or SentencePiece itself) on the original. llama.cpp's vocabulary files of
real models (scripts/fetch_test_data.py fetches them) are checked too, against the ids
transformers gave on the original models.
"""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import gguf
import pytest
from llama_cpp_data import require_llama_cpp_dir

from rvllm.tokenizer import tokenizer_from_gguf

TEXTS = [
    "Hello world",
    " leading space",
    "   three leading spaces, then  two and a tab\there",
    "trailing spaces   ",
    "a      b         c",
    "Line one\n\nLine three\r\n\n\n   indented\n",
    "1234567890 3.14159 -42 x2 2023-10-01 1,000,000 ½",
    "The café déjà vu: naïve façade, Straße, ÆØÅ.",
    "Привет, мир! Быстрая коричневая лиса. Ελληνικά γράμματα.",
    "快速的棕色狐狸跳过了懒狗。東京は日本の首都です。カタカナ",
    "안녕하세요 세계",
    "مرحبا بالعالم नमस्ते दुनिया",
    "Emoji: 🚀🔥😀👍🏽 and ✨, flags 🇫🇷, family 👨‍👩‍👧",
    "def add(a, b):\n    return a + b  # sum\n",
    "for (int i = 0; i < n; ++i) { x[i] = y[i] * 2.5e-3; }",
    '{"key": [1, 2, 3], "nested": {"ok": true}}',
    "Wait... really?! (yes) -- 'quoted' \"double\" ~tilde~ 100% $5 #tag @user",
    "全角：！？（括号）　空格“引号”",
    "I'm sure they'll say it's fine, don't you think? We've seen it.",
    "",
]
# The vocabularies are learned from the ASCII texts, so the others need byte fallback.
TRAIN = [t for t in TEXTS if t.isascii()] * 8


def write_vocab_gguf(path: Path, arch: str, meta: dict) -> Path:
    """A metadata-only GGUF holding a tokenizer, keyed as llama.cpp's converter writes it."""
    writer = gguf.GGUFWriter(path, arch)
    writer.add_tokenizer_model(meta["model"])
    if "pre" in meta:
        writer.add_tokenizer_pre(meta["pre"])
    writer.add_token_list(meta["tokens"])
    writer.add_token_types(meta["types"])
    if "scores" in meta:
        writer.add_token_scores(meta["scores"])
    if "merges" in meta:
        writer.add_token_merges(meta["merges"])
    for key in ("bos", "eos", "unk", "pad"):
        if (token_id := meta.get(key)) is not None:
            getattr(writer, f"add_{key}_token_id")(token_id)
    writer.add_add_bos_token(meta["add_bos"])
    writer.add_add_eos_token(False)
    if "add_space_prefix" in meta:
        writer.add_add_space_prefix(meta["add_space_prefix"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def assert_same_codec(ours, hf, texts=TEXTS) -> None:
    for text in texts:
        ids = hf.encode(text)
        assert ours.encode(text) == ids, text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            ), text


# ---------------------------------------------------------------- SentencePiece: Gemma, Phi-3


def train_sentencepiece(add_dummy_prefix: bool, controls: list[str], user_defined: list[str]):
    """A small SentencePiece BPE with byte fallback; Gemma's ids for the special pieces
    when `add_dummy_prefix` is off (Gemma's tokenizer.model has it off), Llama's otherwise."""
    import sentencepiece as spm

    specials = (
        {"pad_id": 0, "eos_id": 1, "bos_id": 2, "unk_id": 3, "pad_piece": "<pad>",
         "eos_piece": "<eos>", "bos_piece": "<bos>", "unk_piece": "<unk>"}
        if not add_dummy_prefix else {"unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": -1}
    )  # fmt: skip
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TRAIN), model_writer=model, model_type="bpe", vocab_size=420,
        byte_fallback=True, add_dummy_prefix=add_dummy_prefix, remove_extra_whitespaces=False,
        normalization_rule_name="identity", split_digits=True, character_coverage=1.0,
        allow_whitespace_only_pieces=True, control_symbols=controls,
        user_defined_symbols=user_defined, num_threads=1, minloglevel=2, **specials,
    )  # fmt: skip
    return spm.SentencePieceProcessor(model_proto=model.getvalue()), model.getvalue()


def sentencepiece_gguf_vocab(sp, user_defined: list[str]) -> dict:
    """convert_hf_to_gguf's _create_vocab_sentencepiece, plus what Gemma's added_tokens_decoder
    does to it: user-defined pieces become USER_DEFINED, their "▁" written as a space."""
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        piece = sp.IdToPiece(i)
        kind = 2 if sp.IsUnknown(i) else 3 if sp.IsControl(i) else 6 if sp.IsByte(i) else 1
        if piece in user_defined:
            kind, piece = 4, piece.replace("\u2581", " ")
        tokens.append(piece)
        scores.append(sp.GetScore(i))
        types.append(kind)
    return {"model": "llama", "tokens": tokens, "scores": scores, "types": types}


GEMMA_CONTROLS = ["<start_of_turn>", "<end_of_turn>"]
# Gemma's tokenizer.model has runs of newlines and of spaces as user-defined pieces.
GEMMA_USER_DEFINED = ["\n\n", "\n\n\n", *("\u2581" * n for n in range(2, 9))]


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory):
    sp, proto = train_sentencepiece(False, GEMMA_CONTROLS, GEMMA_USER_DEFINED)
    root = tmp_path_factory.mktemp("gemma")
    (root / "tokenizer.model").write_bytes(proto)
    (root / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": True}))
    return sp, root


@pytest.mark.parametrize("arch", ["gemma", "gemma2", "gemma3"])
def test_gemma_gguf_tokenizer_matches_transformers_gemma_tokenizer(
    arch: str, gemma, tmp_path: Path
) -> None:
    from transformers import GemmaTokenizer

    sp, root = gemma
    vocab = sentencepiece_gguf_vocab(sp, GEMMA_USER_DEFINED)
    assert vocab["types"][vocab["tokens"].index("  ")] == 4, "stored as llama.cpp does"
    meta = {**vocab, "bos": 2, "eos": 1, "unk": 3, "pad": 0, "add_bos": True,
            "add_space_prefix": False}  # fmt: skip
    ours = tokenizer_from_gguf(write_vocab_gguf(tmp_path / "gemma.gguf", arch, meta))
    hf = GemmaTokenizer.from_pretrained(root)
    texts = [*TEXTS, "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"]
    assert_same_codec(ours, hf, texts)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (2, 1, 0)
    # No "▁" is prepended. (SentencePiece itself agrees except on runs of spaces, which it
    # cuts at the user-defined pieces, where transformers merges them as BPE.)
    assert ours.convert_ids_to_tokens(ours.encode(" Hello"))[1].startswith("\u2581")
    assert not ours.convert_ids_to_tokens(ours.encode("Hello"))[1].startswith("\u2581")


def test_phi3_gguf_tokenizer_prepends_a_space_to_every_stretch_like_phi3s_tokenizer_json(
    tmp_path: Path,
) -> None:
    """Phi-3's tokenizer.json prepends "▁" with a normalizer (Prepend, then spaces -> "▁"),
    and transformers 5 loads it as written: "  hi" is "▁▁▁hi", as in SentencePiece itself."""
    from tokenizers import Tokenizer, normalizers, processors
    from transformers import LlamaTokenizer, PreTrainedTokenizerFast

    sp, proto = train_sentencepiece(True, ["<|user|>", "<|end|>"], [])
    (tmp_path / "tokenizer.model").write_bytes(proto)
    # LlamaTokenizer reads the vocabulary and merges; the pipeline is Phi-3's tokenizer.json.
    llama = LlamaTokenizer.from_pretrained(tmp_path)
    backend = Tokenizer.from_str(llama.backend_tokenizer.to_str())
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    backend.pre_tokenizer = None
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")
    meta = {**sentencepiece_gguf_vocab(sp, []), "bos": 1, "eos": 2, "unk": 0, "add_bos": True}
    ours = tokenizer_from_gguf(write_vocab_gguf(tmp_path / "phi3.gguf", "phi3", meta))
    assert_same_codec(ours, hf, [*TEXTS, "<|user|>\n  hi<|end|>"])
    for text in TEXTS:
        assert ours.encode(text, add_special_tokens=False) == sp.encode(text), text


# ---------------------------------------------------------------- byte-level pre-tokenizers


def split(regex: str) -> dict:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


DIGITS = {"type": "Digits", "individual_digits": True}


def byte_level(use_regex: bool) -> dict:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
            "use_regex": use_regex}  # fmt: skip


# The pre_tokenizer of each model's tokenizer.json, as published with the model on the
# Hugging Face Hub (llama.cpp's src/llama-vocab.cpp carries the same regexes):
# - deepseek-llm: deepseek-ai/deepseek-llm-7b-base, DeepSeek-V2 and DeepSeek-V2-Lite;
# - deepseek-coder: deepseek-ai/deepseek-coder-6.7b-base;
# - deepseek-v3: deepseek-ai/DeepSeek-V3 (and R1);
# - smollm: HuggingFaceTB/SmolLM2-* (as bigcode/starcoder2);
# - qwen35: transformers' models/qwen3_5/tokenization_qwen3_5.py PRETOKENIZE_REGEX.
DEEPSEEK_LETTERS = (
    "A-Za-z\xb5\xc0-\xd6\xd8-\xf6\xf8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
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
    "\U000118a0-\U000118df\U0001e900-\U0001e943"
)
DEEPSEEK_HAN_HANGUL = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
ORIGINAL_PRE_TOKENIZERS = {
    "deepseek-llm": [
        split("[\r\n]"),
        split(f"\\s?[{DEEPSEEK_LETTERS}]+"),
        split("\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"),
        split("\\s+$"),
        split(DEEPSEEK_HAN_HANGUL),
        DIGITS,
        byte_level(False),
    ],
    "deepseek-coder": [
        split("[\r\n]"),
        split("\\s?\\p{L}+"),
        split("\\s?\\p{P}+"),
        split(DEEPSEEK_HAN_HANGUL),
        DIGITS,
        byte_level(False),
    ],
    "deepseek-v3": [
        split("\\p{N}{1,3}"),
        split("[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"),
        split(
            "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+"
            "|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+"
            "|\\s+(?!\\S)|\\s+"
        ),
        byte_level(False),
    ],
    "smollm": [DIGITS, byte_level(True)],
    "qwen35": [
        split(
            "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}"
            "| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
        ),
        byte_level(False),
    ],
}
# DeepSeek's, spelled outside the byte alphabet.
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"


@pytest.fixture(scope="module")
def byte_level_bpe() -> tuple[dict, list]:
    """Vocabulary and merges of a byte-level BPE learned with GPT-2's split, so it has the
    merges (" 12", " (", "..") that a different pre-tokenizer must keep from happening."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=600, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(TRAIN, trainer)
    model = json.loads(bpe.to_str())["model"]
    return model["vocab"], model["merges"]


def original_tokenizer(vocab: dict, merges: list, pre: str):
    """transformers' tokenizer for a tokenizer.json with this vocabulary and `pre`'s
    original pre-tokenizer, DeepSeek's special tokens, and BOS added as DeepSeek's does."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    n = len(vocab)
    added = [
        {"id": n + i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": special}
        for i, (tok, special) in enumerate([(BOS, True), (EOS, True), ("<think>", False)])
    ]  # fmt: skip
    tokenizer_json = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": ORIGINAL_PRE_TOKENIZERS[pre]},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": BOS, "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {BOS: {"id": BOS, "ids": [n], "tokens": [BOS]}},
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }  # fmt: skip
    backend = Tokenizer.from_str(json.dumps(tokenizer_json))
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=BOS, eos_token=EOS)


def byte_level_gguf(path: Path, vocab: dict, merges: list, pre: str, arch: str) -> Path:
    """The GGUF llama.cpp's converter writes for `original_tokenizer`: added tokens
    spelled as text, special ones CONTROL, the others USER_DEFINED."""
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])] + [BOS, EOS, "<think>"]
    types = [1] * len(vocab) + [3, 3, 4]
    meta = {"model": "gpt2", "pre": pre, "tokens": tokens, "types": types,
            "merges": [" ".join(m) for m in merges], "bos": len(vocab), "eos": len(vocab) + 1,
            "add_bos": True}  # fmt: skip
    return write_vocab_gguf(path, arch, meta)


def rvllm_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("rvllm")]


BYTE_LEVEL_TEXTS = [*TEXTS, f"{BOS}User: 2+2?\n\nAssistant: <think>4</think>{EOS}"]


@pytest.mark.parametrize(
    ("pre", "arch"),
    [("deepseek-llm", "deepseek2"), ("deepseek-coder", "llama"), ("deepseek-v3", "deepseek2"),
     ("smollm", "llama"), ("qwen35", "qwen35")],
)  # fmt: skip
def test_byte_level_gguf_tokenizer_splits_text_like_the_original_pre_tokenizer(
    pre: str, arch: str, byte_level_bpe, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    vocab, merges = byte_level_bpe
    hf = original_tokenizer(vocab, merges, pre)
    with caplog.at_level(logging.WARNING, logger="rvllm"):
        ours = tokenizer_from_gguf(byte_level_gguf(tmp_path / "v.gguf", vocab, merges, pre, arch))
    assert not rvllm_records(caplog), "a known pre-tokenizer logs nothing"
    assert_same_codec(ours, hf, BYTE_LEVEL_TEXTS)
    assert (ours.bos_token_id, ours.eos_token_id) == (len(vocab), len(vocab) + 1)
    assert ours.vocab_size == len(vocab) + 3, "the special tokens keep their ids"
    # The test can tell: GPT-2's split, the fallback, tokenizes some of these differently.
    gpt2 = tokenizer_from_gguf(byte_level_gguf(tmp_path / "g.gguf", vocab, merges, "gpt-2", arch))
    assert any(gpt2.encode(t) != hf.encode(t) for t in BYTE_LEVEL_TEXTS)


def test_unknown_pre_tokenizer_falls_back_to_gpt2_and_warns_naming_it(
    byte_level_bpe, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    vocab, merges = byte_level_bpe
    gpt2 = tokenizer_from_gguf(byte_level_gguf(tmp_path / "g.gguf", vocab, merges, "gpt-2", "gpt2"))
    path = byte_level_gguf(tmp_path / "u.gguf", vocab, merges, "brand-new-pre", "gpt2")
    with caplog.at_level(logging.WARNING, logger="rvllm"):
        ours = tokenizer_from_gguf(path)
    records = rvllm_records(caplog)
    assert [r.levelno for r in records] == [logging.WARNING]
    assert "'brand-new-pre'" in records[0].getMessage()
    for text in BYTE_LEVEL_TEXTS:
        assert ours.encode(text) == gpt2.encode(text), text


# ---------------------------------------------------------------- llama.cpp's vocabularies


# Real models' vocabularies from llama.cpp's test data: ggml-vocab-NAME.gguf (written by
# its converter) with NAME.gguf.inp and .out, the ids transformers gave on the original
# model (convert_hf_to_gguf_update.py), for the families rvllm loads. Left out: gemma-4
# (its "gemma4" tokenizer model is not one rvllm reads) and llama-spm, whose ids come from
# the SentencePiece-era tokenizer that prepends "▁" even to a text that starts with a
# space, where rvllm follows transformers' current LlamaTokenizer (Metaspace, "first").
@pytest.mark.parametrize(
    "name", ["deepseek-llm", "deepseek-coder", "phi-3", "qwen2", "llama-bpe", "starcoder", "gpt-2",
             "qwen35"]
)
def test_llama_cpp_vocabularies_encode_like_transformers_on_the_original_model(name: str) -> None:
    path = require_llama_cpp_dir() / "models" / f"ggml-vocab-{name}.gguf"
    inp = path.with_suffix(".gguf.inp").read_text(encoding="utf-8")
    texts = inp.split("\n__ggml_vocab_test__\n")
    texts[-1] = texts[-1].removesuffix("\n__ggml_vocab_test__\n")
    expected = path.with_suffix(".gguf.out").read_text(encoding="utf-8").split("\n")
    backend = tokenizer_from_gguf(path).backend
    assert len(texts) <= len(expected)
    for text, ids in zip(texts, expected):
        assert backend.encode(text, add_special_tokens=False).ids == [int(i) for i in ids.split()]
