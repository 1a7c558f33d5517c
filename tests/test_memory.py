"""KV-cache sizing: the budget arithmetic (pure logic, as on a GPU) and the profiling pass
that measures the activations of the largest step (runs on the CPU too)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from test_engine import greedy, make_prompts, reference

from rvllm import LLM
from rvllm.cli import build_parser
from rvllm.cli_args import engine_args_from_namespace
from rvllm.config import CacheConfig, ModelConfig, SchedulerConfig
from rvllm.executor.kv_cache import (
    blocks_for_budget,
    bytes_per_block,
    empty_cpu_cache,
    estimate_weight_bytes,
    gpu_kv_budget,
)

GiB = 1 << 30


def _smaps_field(address: int, field: str) -> list[str]:
    """The words after ``field:`` in the kernel's entry for the mapping of this process
    that holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split()[0] if line.split() else ""
        if "-" in first and not line.startswith("VmFlags"):
            lo, hi = (int(x, 16) for x in first.split("-"))
            inside = lo <= address < hi
        elif inside and line.startswith(f"{field}:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def _vm_flags(address: int) -> list[str]:
    return _smaps_field(address, "VmFlags")


def _huge_kib(address: int) -> int:
    """AnonHugePages (KiB) of the mapping that holds ``address``."""
    return int(_smaps_field(address, "AnonHugePages")[0])


def test_the_cpu_cache_is_an_uninitialised_tensor_of_its_shape() -> None:
    cache = empty_cpu_cache((8, 2, 1 << 18), torch.float32)  # 16 MiB
    assert cache.shape == (8, 2, 1 << 18) and cache.dtype == torch.float32
    cache.fill_(2.0)
    assert float(cache.sum()) == 2.0 * cache.numel()
    assert empty_cpu_cache((3, 5), torch.bfloat16).shape == (3, 5)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")
def test_weight_panels_ask_for_huge_pages() -> None:
    """The one-row GEMV streams its panels (``kernels.cpu.gemv``): they sit in huge pages
    too, and hold the weight's numbers."""
    from rvllm.kernels.cpu.gemv import PANEL, panels

    weight = torch.randn(1024, 1024)  # 4 MiB of panels
    copy = panels(weight)
    assert "hg" in _vm_flags(copy.weight.ctypes.data + (2 << 20))
    assert torch.equal(torch.from_numpy(copy.weight[3, :, 5]), weight[3 * PANEL + 5])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")
def test_memory_already_written_collapses_into_huge_pages_where_it_is() -> None:
    """Panels made in a weight's own memory (a server's start) sit in 4 KiB pages; the
    deferred reorder moves them into huge pages, same addresses, same numbers."""
    import numpy as np

    from rvllm.host_memory import collapse_huge_pages

    array = np.arange(3 << 20, dtype=np.float32)  # 12 MiB, written
    before = array.copy()
    if not collapse_huge_pages(array):
        pytest.skip("this kernel has no MADV_COLLAPSE")
    assert _huge_kib(array.ctypes.data + (6 << 20)) >= 2048
    assert np.array_equal(array, before)
    assert not collapse_huge_pages(array[:100])  # no whole huge page in it


def test_budget_is_the_smaller_of_utilization_and_reserve_less_the_peak() -> None:
    assert gpu_kv_budget(100 * GiB, 20 * GiB, 0.9, 0) == 70 * GiB
    # Utilization 1.0 is safe with a reserve: the reserve wins.
    assert gpu_kv_budget(100 * GiB, 20 * GiB, 1.0, 2 * GiB) == 78 * GiB
    # A reserve below what utilization already leaves free changes nothing.
    assert gpu_kv_budget(100 * GiB, 20 * GiB, 0.9, 5 * GiB) == 70 * GiB
    assert gpu_kv_budget(100 * GiB, 95 * GiB, 0.9, 0) < 0


def test_blocks_for_budget_caps_at_what_the_sequences_can_use(llama_dir: Path) -> None:
    model = ModelConfig.from_path(str(llama_dir), torch.float32, 128)
    cache = CacheConfig(block_size=16)
    per_block = bytes_per_block(model, 16)
    sched = SchedulerConfig(max_num_seqs=4)
    assert blocks_for_budget(10 * per_block + 5, per_block, model, cache, sched) == 10
    assert blocks_for_budget(10**6 * per_block, per_block, model, cache, sched) == 4 * 8
    with pytest.raises(ValueError, match="gpu-memory-reserve-gb"):
        blocks_for_budget(-5.0, per_block, model, cache, sched)


def test_weight_estimate_is_the_checkpoint_size(llama_dir: Path) -> None:
    model = ModelConfig.from_path(str(llama_dir), torch.float32, 128)
    size = sum(f.stat().st_size for f in llama_dir.glob("*.safetensors"))
    assert estimate_weight_bytes(model) == size


def test_reserve_flag_reaches_the_cache_config() -> None:
    ns = build_parser().parse_args(["serve", "--gpu-memory-utilization", "1.0",
                                    "--gpu-memory-reserve-gb", "2.5"])
    args = engine_args_from_namespace(ns)
    assert args.gpu_memory_utilization == 1.0 and args.gpu_memory_reserve_gb == 2.5
    with pytest.raises(ValueError, match="gpu_memory_reserve_gb"):
        CacheConfig(gpu_memory_reserve_gb=-1)


def test_profile_run_covers_the_largest_step_and_leaves_no_cache(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), dtype="float32", max_model_len=128, max_num_batched_tokens=300)
    engine, runner = llm.engine, llm.engine.runner
    mc = engine.model_config
    caches = [attn.kv_cache for attn in engine.model.attention_layers()]
    # 300 tokens in sequences of at most 128 (128 + 128 + 44), logits for 8 rows.
    runner.profile_run(300, 8, 128, mc.num_kv_heads, mc.head_dim, mc.dtype)
    assert all(attn.kv_cache is None for attn in engine.model.attention_layers())
    for attn, cache in zip(engine.model.attention_layers(), caches):
        attn.kv_cache = cache
    assert greedy(llm, make_prompts()) == reference(llama_dir)
