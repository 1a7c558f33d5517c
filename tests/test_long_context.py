"""Long contexts generate exactly what transformers generates: prompts of thousands of
tokens, past the sliding windows many times over, prefilled in many chunks, over block
tables of hundreds of blocks, hitting a long cached prefix, and preempted mid-sequence."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import ARCH_CONFIGS, hf_greedy
from test_model_families import FAMILIES, build_family

from rvllm import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NEW_TOKENS = 24
LONG = dict(max_position_embeddings=4096)

# name -> config overrides. Windows far below the prompts' lengths, and Gemma's not a
# multiple of the block size, so that windows start mid-block. Gemma's LM head is untied:
# tied, a random Gemma's scaled input embedding dominates its own logit on long prompts and
# greedy decoding repeats one token, which would hide any error in attention.
MODELS: dict[str, dict[str, Any]] = {
    # Llama 3's RoPE scaling, from an original context (64) far below these prompts.
    "llama": {**ARCH_CONFIGS["llama"], **LONG},
    "mistral": {**ARCH_CONFIGS["mistral"], **LONG, "sliding_window": 256},
    "gemma2": {**FAMILIES["gemma2"][0], **LONG, "sliding_window": 100,
               "tie_word_embeddings": False},
    "gemma3": {**FAMILIES["gemma3"][0], **LONG, "sliding_window": 150,
               "tie_word_embeddings": False},
}


def random_ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 400, (n,), generator=g).tolist()


SHARED_PREFIX = random_ids(1500, seed=10)
PROMPTS: dict[str, list[int]] = {
    "2k": random_ids(2000, seed=1),
    "2.4k": random_ids(2400, seed=2),
    "3k": random_ids(3000, seed=3),
    "prefix_a": SHARED_PREFIX + random_ids(100, seed=11),
    "prefix_b": SHARED_PREFIX + random_ids(100, seed=12),
    "1k": random_ids(1000, seed=4),
    "1.1k": random_ids(1100, seed=5),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            built[name] = build_family(name, tmp_path_factory.mktemp(f"long-{name}"),
                                       (MODELS[name], 0))
        return built[name]

    return get


@pytest.fixture(scope="module")
def reference(model_dir: Callable[[str], Path]) -> Callable[[str, str], list[int]]:
    """transformers' greedy tokens for (model, prompt), each computed once."""
    done: dict[tuple[str, str], list[int]] = {}

    def get(model: str, prompt: str) -> list[int]:
        if (model, prompt) not in done:
            tokens = hf_greedy(model_dir(model), [PROMPTS[prompt]], NEW_TOKENS)[0]
            # A continuation stuck on one token would match whatever attention computed.
            assert len(set(tokens)) > 3, f"{model} degenerates on {prompt}: {tokens}"
            done[model, prompt] = tokens
        return done[model, prompt]

    return get


def engine(path: Path, **kwargs: Any) -> LLM:
    # An eighth of a GiB still holds over 100k tokens of these models, and its blocks' books
    # are set up faster than the default 2 GiB's.
    return LLM(str(path), device="cpu", dtype="float32",
               **{"kernel_backend": "numba", "kv_cache_memory": 0.125, **kwargs})


def greedy(llm: LLM, *prompts: str) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([PROMPTS[p] for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


@dataclass
class Step:
    scheduled: list[tuple[int, list[int]]]  # per sequence: tokens this step, block table
    preempted: list[tuple[int, int]]  # per sequence: its tokens, of which generated


def record_schedules(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[Step]:
    """Every step the scheduler makes, as it left its sequences."""
    scheduler, steps = llm.engine.scheduler, []
    schedule = scheduler.schedule

    def recorded() -> Any:
        out = schedule()
        steps.append(Step([(s.num_new_tokens, list(s.seq.block_table)) for s in out.scheduled],
                          [(s.num_tokens, s.num_output_tokens) for s in out.preempted]))
        return out

    monkeypatch.setattr(scheduler, "schedule", recorded)
    return steps


def slow(*values: Any) -> Any:
    return pytest.param(*values, marks=pytest.mark.slow)


@pytest.mark.parametrize("model", ["llama", "mistral", "gemma2", "gemma3"])
def test_long_prompt_past_sliding_windows(model_dir: Callable[[str], Path],
                                          reference: Callable, model: str) -> None:
    assert greedy(engine(model_dir(model)), "2k") == [reference(model, "2k")]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama", "mistral", "gemma2", "gemma3"])
def test_3k_prompt_in_small_blocks_and_chunks(model_dir: Callable[[str], Path],
                                              reference: Callable, model: str) -> None:
    llm = engine(model_dir(model), block_size=8, max_num_batched_tokens=200)
    assert greedy(llm, "3k") == [reference(model, "3k")]


@pytest.fixture
def two_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("model", ["mistral", slow("llama"), slow("gemma2"), slow("gemma3")])
def test_long_prompt_on_two_threads(model_dir: Callable[[str], Path], reference: Callable,
                                    model: str, two_threads: None) -> None:
    # Decode attention splits one sequence's context in twice as many parts as threads,
    # shared out by their lengths: paths a single thread never takes.
    assert greedy(engine(model_dir(model)), "2k") == [reference(model, "2k")]


@pytest.mark.parametrize("model", ["gemma2", slow("llama"), slow("mistral"), slow("gemma3")])
def test_long_prompt_on_the_torch_backend(model_dir: Callable[[str], Path],
                                          reference: Callable, model: str) -> None:
    llm = engine(model_dir(model), kernel_backend="torch")
    assert greedy(llm, "2k") == [reference(model, "2k")]


@pytest.mark.parametrize("model", ["mistral", "gemma2", "gemma3", slow("llama")])
def test_prefill_in_many_chunks(model_dir: Callable[[str], Path], reference: Callable,
                                model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # 120 tokens a step: chunk boundaries fall mid-block, and on both sides of the windows.
    llm = engine(model_dir(model), max_num_batched_tokens=120)
    steps = record_schedules(llm, monkeypatch)
    assert greedy(llm, "2k") == [reference(model, "2k")]
    assert sum(1 for step in steps if step.scheduled[0][0] > 1) >= 16


@pytest.mark.parametrize("model", ["mistral", slow("llama"), slow("gemma2"), slow("gemma3")])
def test_block_table_of_hundreds_of_blocks_out_of_order(
        model_dir: Callable[[str], Path], reference: Callable, model: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A first request leaves its cached blocks at the back of the free queue, last block
    # first; the pool is then just large enough that the long request takes fresh blocks
    # and then those, so its table runs up and then down through the pool.
    llm = engine(model_dir(model), block_size=8, num_gpu_blocks=320, max_model_len=2560)
    greedy(llm, "1k")
    steps = record_schedules(llm, monkeypatch)
    assert greedy(llm, "2.4k") == [reference(model, "2.4k")]
    table = max((t for step in steps for _, t in step.scheduled), key=len)
    assert len(table) >= 300
    assert table != sorted(table)


@pytest.mark.parametrize("model", ["gemma3", slow("llama"), slow("mistral"), slow("gemma2")])
def test_long_shared_prefix_hits_the_cache(model_dir: Callable[[str], Path],
                                           reference: Callable, model: str) -> None:
    llm = engine(model_dir(model))
    [first] = greedy(llm, "prefix_a")
    bm = llm.engine.block_manager
    hits_before = bm.prefix_cache_hits
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    out = llm.generate([PROMPTS["prefix_b"]], params)[0]
    cached = len(SHARED_PREFIX) // bm.block_size * bm.block_size
    assert out.num_cached_tokens == cached
    assert bm.prefix_cache_hits - hits_before == cached
    assert [first, out.outputs[0].token_ids] == [reference(model, "prefix_a"),
                                                 reference(model, "prefix_b")]


PREEMPTION = {
    # Without the prefix cache, the preempted sequence is recomputed from its first token.
    "recompute": dict(preemption_mode="recompute", enable_prefix_caching=False),
    "swap": dict(preemption_mode="swap", num_cpu_blocks=128),
}


@pytest.mark.parametrize("model, mode", [
    ("mistral", "recompute"), ("mistral", "swap"),
    slow("llama", "recompute"), slow("llama", "swap"),
    slow("gemma2", "recompute"), ("gemma2", "swap"),
    slow("gemma3", "recompute"), slow("gemma3", "swap"),
])
def test_preemption_mid_long_sequence(model_dir: Callable[[str], Path], reference: Callable,
                                      model: str, mode: str,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # Both prompts fit the pool (63 + 69 blocks of 16) but not their continuations: the
    # newer is preempted once it decodes past its last block.
    llm = engine(model_dir(model), num_gpu_blocks=132, max_model_len=2048,
                 **PREEMPTION[mode])
    steps = record_schedules(llm, monkeypatch)
    assert greedy(llm, "1k", "1.1k") == [reference(model, "1k"), reference(model, "1.1k")]
    preempted = [p for step in steps for p in step.preempted]
    assert preempted and all(n > 1100 and 0 < out < NEW_TOKENS for n, out in preempted)
    scheduler = llm.engine.scheduler
    assert scheduler.num_swap_outs == (len(preempted) if mode == "swap" else 0)
