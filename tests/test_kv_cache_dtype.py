"""``--kv-cache-dtype bfloat16``: keys and values stored as bfloat16 under a float32
model. The numba kernels' rounding against torch's, bit for bit; every CPU path (the
one-call decoder step, the batch step, the layers with numba attention, plain torch)
against each other over the same rounded cache; the cache's size; bad values."""

from __future__ import annotations

from pathlib import Path

import numba
import numpy as np
import pytest
import torch
from conftest import hf_greedy

from rvllm import LLM, SamplingParams
from rvllm.cli import build_parser
from rvllm.cli_args import engine_args_from_namespace
from rvllm.config import resolve_kv_cache_dtype

# rvllm.kernels is imported inside the tests: test_kernels.py must be first to import it
# (it sets TRITON_INTERPRET=1 before), and pytest imports every test module up front.

PROMPTS = [[5, 6, 7], [11, 3, 99, 42, 8, 17, 250, 31, 64, 2, 77, 19, 5, 5, 300, 12, 40, 41]]
# More rows than the one-call step takes, so the batch step runs; the same 9-token head
# twice, so the second run of it hits the prefix cache (block size 8).
BATCH = [[3, 40, 9, 21, 22, 23, 24, 25, 26] + list(range(11, 11 + i)) for i in range(10)]
NEW_TOKENS = 24


def _bits_of_every_kind() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    scaled = torch.randn(50_000, generator=g) * 10.0 ** torch.randint(-40, 39, (50_000,),
                                                                      generator=g)
    patterns = torch.randint(-2**31, 2**31 - 1, (100_000,), generator=g, dtype=torch.int64)
    edges = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 3.4e38, -3.4e38, 1e-45,
                          1.00390625, 1.01171875, -1.00390625])  # ties round to even
    values = torch.cat([scaled, patterns.to(torch.int32).view(torch.float32), edges])
    return values[~torch.isnan(values)]


def test_numba_rounding_to_bfloat16_is_torchs() -> None:
    from rvllm.kernels.cpu.numerics import kv_array, narrow_kv, widen_kv

    @numba.njit(fastmath=True)
    def narrow(x, out):  # noqa: ANN001, ANN202
        for i in range(x.shape[0]):
            out[i] = narrow_kv(x[i], out)

    @numba.njit(fastmath=True)
    def widen(x, out):  # noqa: ANN001, ANN202
        for i in range(x.shape[0]):
            out[i] = widen_kv(x[i])

    x = _bits_of_every_kind()
    torch_bits = kv_array(x.to(torch.bfloat16))
    ours = np.empty(x.shape[0], np.uint16)
    narrow(x.numpy(), ours)
    np.testing.assert_array_equal(ours, torch_bits)
    back = np.empty(x.shape[0], np.float32)
    widen(torch_bits, back)
    np.testing.assert_array_equal(back, x.to(torch.bfloat16).float().numpy())


def _generate(llm: LLM, prompts: list[list[int]], one_at_a_time: bool) -> list:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    if one_at_a_time:
        return [llm.generate([p], params)[0].outputs[0] for p in prompts]
    return [o.outputs[0] for o in llm.generate(prompts, params)]


def _batch_twice(llm: LLM) -> list:
    """BATCH, then BATCH again: the second pass finds the prompts' first blocks in the
    prefix cache, so its prefill chunks read their context back from the cache."""
    first = _generate(llm, BATCH, one_at_a_time=False)
    hits = llm.engine.block_manager.prefix_cache_hits
    second = _generate(llm, BATCH, one_at_a_time=False)
    assert llm.engine.block_manager.prefix_cache_hits > hits
    return first + second


def _counted(kernel, name: str, calls: list[str]):  # noqa: ANN001, ANN202
    def run(*args):  # noqa: ANN002, ANN202
        calls.append(name)
        return kernel(*args)
    return run


@pytest.mark.parametrize("one_at_a_time", [True, False], ids=["decoder-step", "batch-step"])
def test_every_cpu_path_agrees_over_a_bfloat16_cache(llama_dir: Path,
                                                     one_at_a_time: bool) -> None:
    """The numba steps (one row at a time: the one-call step; ten rows: the batch step,
    with a prefix-cache hit on the second pass) against plain torch over the same cache;
    each rounds the new keys and values to bfloat16 the same way and computes in
    float32, so only summation order differs."""
    from rvllm.models import cpu_step

    runs = {}
    for backend in ("numba", "torch"):
        llm = LLM(str(llama_dir), kernel_backend=backend, block_size=8,
                  kv_cache_dtype="bfloat16")
        assert all(c.dtype == torch.bfloat16 for a in llm.engine.model.attention_layers()
                   for c in a.kv_cache)
        calls: list[str] = []
        # A decode step of a few rows runs as decode_logits (the runner's compiled decode).
        step, batch = cpu_step.decode_logits, cpu_step.batch_step
        cpu_step.decode_logits = _counted(step, "step", calls)
        cpu_step.batch_step = _counted(batch, "batch", calls)
        try:
            runs[backend] = (_generate(llm, PROMPTS, one_at_a_time=True) if one_at_a_time
                             else _batch_twice(llm))
        finally:
            cpu_step.decode_logits, cpu_step.batch_step = step, batch
        if backend == "numba":
            assert ("step" if one_at_a_time else "batch") in calls
        else:
            assert not calls
    for fast, ref in zip(runs["numba"], runs["torch"]):
        assert fast.token_ids == ref.token_ids
        assert fast.cumulative_logprob == pytest.approx(ref.cumulative_logprob, abs=1e-3)


def test_bfloat16_cache_stays_close_to_float32(llama_dir: Path) -> None:
    """On the test model the rounded cache changes no greedy token against transformers
    in float32, and each sequence's log-probability by little."""
    want = hf_greedy(llama_dir, PROMPTS, NEW_TOKENS)
    runs = {kv: _generate(LLM(str(llama_dir), block_size=8, kv_cache_dtype=kv), PROMPTS,
                          one_at_a_time=False)
            for kv in ("auto", "bfloat16")}
    assert [o.token_ids for o in runs["bfloat16"]] == want
    for rounded, exact in zip(runs["bfloat16"], runs["auto"]):
        assert rounded.cumulative_logprob == pytest.approx(exact.cumulative_logprob, abs=0.05)


def test_bfloat16_cache_holds_twice_the_blocks(llama_dir: Path) -> None:
    sizes = {}
    for kv in ("auto", "bfloat16"):
        llm = LLM(str(llama_dir), kv_cache_memory=0.001, kv_cache_dtype=kv,
                  max_model_len=64)
        sizes[kv] = llm.engine.block_manager.num_blocks
    assert sizes["bfloat16"] == 2 * sizes["auto"]


def test_unknown_or_unsupported_kv_cache_dtypes_are_refused(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, bfloat16"):
        resolve_kv_cache_dtype("fp8_e5m2", torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="fp8 KV cache needs a CUDA GPU"):
        resolve_kv_cache_dtype("fp8", torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="CPU only"):
        resolve_kv_cache_dtype("bfloat16", torch.float16, torch.device("cuda"))
    assert resolve_kv_cache_dtype("bfloat16", torch.bfloat16, torch.device("cuda")) \
        == torch.bfloat16
    assert resolve_kv_cache_dtype("auto", torch.float32, torch.device("cpu")) == torch.float32
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8_e5m2"])
    assert exit_.value.code != 0
    assert "--kv-cache-dtype" in capsys.readouterr().err
    ns = build_parser().parse_args(["serve", "--kv-cache-dtype", "bfloat16"])
    assert engine_args_from_namespace(ns).kv_cache_dtype == "bfloat16"
