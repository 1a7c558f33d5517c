"""Each Triton kernel against its plain-torch reference.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (set before
triton is imported); with CUDA they compile and run natively. The interpreter's
bf16 tl.dot is wrong (it multiplies the raw bits), so attention is tested there
in float32 and float16 only; bf16 attention is covered on GPU.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":
    # triton.jit reads this when a kernel is defined, so it must precede every kernel import.
    if any(name.startswith("rvllm.kernels.triton.") for name in sys.modules):
        raise RuntimeError("rvllm.kernels.triton was imported before TRITON_INTERPRET=1 was set; "
                           "set it in tests/conftest.py or import the kernels lazily.")
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="the Triton kernels need the triton package (test extras)")

from rvllm.kernels import triton as kernels  # noqa: E402
from rvllm.kernels.triton import KERNEL_NAMES, check, check_kernels  # noqa: E402
from rvllm.kernels.triton.activation import silu_and_mul, silu_and_mul_ref  # noqa: E402
from rvllm.kernels.triton.decode_attention import (  # noqa: E402
    paged_decode_attention,
    paged_decode_attention_ref,
)
from rvllm.kernels.triton.fused_gemv import (  # noqa: E402
    gemv,
    norm_gemv,
    norm_gemv_ref,
    silu_mul_gemv,
    silu_mul_gemv_ref,
)
from rvllm.kernels.triton.greedy import greedy_sample, greedy_sample_ref  # noqa: E402
from rvllm.kernels.triton.prefill_attention import (  # noqa: E402
    paged_prefill_attention,
    paged_prefill_attention_ref,
)
from rvllm.kernels.triton.rms_norm import (  # noqa: E402
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
)
from rvllm.kernels.triton.rotary_kv import (  # noqa: E402
    rotary_embedding_with_kv_cache,
    rotary_embedding_with_kv_cache_ref,
)

ON_GPU = DEVICE.type == "cuda"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ATTN_DTYPES = [torch.float16, torch.bfloat16] if ON_GPU else [torch.float32, torch.float16]
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def _close(got: torch.Tensor, want: torch.Tensor, tol: float | None = None) -> None:
    tol = TOL[want.dtype] if tol is None else tol
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def _close_attn(got: torch.Tensor, want: torch.Tensor) -> None:
    # On GPU, tl.dot runs float32 inputs as TF32 (a 10-bit mantissa).
    tf32 = ON_GPU and want.dtype == torch.float32
    _close(got, want, 5e-3 if tf32 else None)


def _randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, device=DEVICE, dtype=dtype)


# --- RMSNorm -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_reference(dtype: torch.dtype) -> None:
    x, w = _randn(2, 3, 96, dtype=dtype), _randn(96, dtype=dtype)
    _close(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_returns_norm_and_new_residual(dtype: torch.dtype) -> None:
    x, res, w = _randn(4, 96, dtype=dtype), _randn(4, 96, dtype=dtype), _randn(96, dtype=dtype)
    x0, res0 = x.clone(), res.clone()
    out, new_res = fused_add_rms_norm(x, res, w, 1e-5)
    want_out, want_res = fused_add_rms_norm_ref(x, res, w, 1e-5)
    _close(out, want_out)
    if dtype == torch.bfloat16 and not ON_GPU:
        _close(new_res, want_res)  # the interpreter truncates to bf16 instead of rounding
    else:
        assert torch.equal(new_res, want_res)
    assert torch.equal(x, x0) and torch.equal(res, res0)


# --- SiLU * mul ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference_across_column_blocks(dtype: torch.dtype) -> None:
    x = _randn(3, 2 * 80, dtype=dtype) * 4
    _close(silu_and_mul(x, block=32), silu_and_mul_ref(x))


# --- greedy sampling -----------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_sample_matches_argmax_and_its_logprob(dtype: torch.dtype) -> None:
    logits = _randn(4, 1000, dtype=dtype) * 3
    ids, logprobs = greedy_sample(logits, block=256)
    want_ids, want_logprobs = greedy_sample_ref(logits)
    assert torch.equal(ids, want_ids)
    _close(logprobs, want_logprobs, 1e-5)


def test_greedy_sample_breaks_ties_to_the_first_index() -> None:
    logits = _randn(3, 1000)
    logits[0, [700, 5]] = 50.0  # different lanes
    logits[1, [5 + 256, 5 + 512]] = 50.0  # same lane, later tiles
    logits[2, [999, 3]] = 50.0
    ids, _ = greedy_sample(logits, block=256)
    assert ids.tolist() == [5, 261, 3]


def test_greedy_sample_of_a_one_hot_row_has_logprob_zero() -> None:
    logits = torch.full((1, 300), -1e4, device=DEVICE)
    logits[0, 123] = 0.0
    ids, logprobs = greedy_sample(logits, block=128)
    assert ids.tolist() == [123] and abs(logprobs.item()) < 1e-6


# --- RoPE + KV-cache write -----------------------------------------------------------

def _rope_tables(head_dim: int, max_pos: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1e4 ** -(torch.arange(0, head_dim, 2, device=DEVICE) / head_dim)
    freqs = torch.outer(torch.arange(max_pos, device=DEVICE, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _run_rotary(fn, q, k, v, positions, slots, head_dim, num_kv_heads, dtype):
    caches = [torch.full((3, 8, num_kv_heads, head_dim), 7.0, device=DEVICE, dtype=dtype)
              for _ in range(2)]
    q_out, k_out = fn(positions, q.clone(), k.clone(), v, *_rope_tables(head_dim), *caches,
                      slots)
    return q_out, k_out, *caches


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"),
                         [(2, 2, 32), (4, 1, 24)])
def test_rotary_with_kv_cache_matches_reference(dtype: torch.dtype, num_heads: int,
                                                num_kv_heads: int, head_dim: int) -> None:
    q = _randn(5, num_heads, head_dim, dtype=dtype)
    k, v = _randn(5, num_kv_heads, head_dim, dtype=dtype), _randn(5, num_kv_heads, head_dim,
                                                                  dtype=dtype)
    positions = torch.tensor([0, 1, 8, 31, 63], device=DEVICE)
    slots = torch.tensor([0, 7, 8, 23, 12], device=DEVICE)  # crosses cache blocks
    got = _run_rotary(rotary_embedding_with_kv_cache, q, k, v, positions, slots, head_dim,
                      num_kv_heads, dtype)
    want = _run_rotary(rotary_embedding_with_kv_cache_ref, q, k, v, positions, slots, head_dim,
                       num_kv_heads, dtype)
    for g, w in zip(got, want):
        _close(g, w, 1e-5 if dtype == torch.float32 else 2 * TOL[dtype])


def test_rotary_with_kv_cache_works_on_fused_qkv_views_and_skips_negative_slots() -> None:
    head_dim, num_heads, num_kv_heads = 16, 4, 2
    qkv = _randn(3, (num_heads + 2 * num_kv_heads) * head_dim)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                         num_kv_heads * head_dim], dim=-1)
    q, k, v = (t.view(3, -1, head_dim) for t in (q, k, v))
    positions = torch.tensor([3, 4, 5], device=DEVICE)
    slots = torch.tensor([1, -1, 20], device=DEVICE)
    got = _run_rotary(rotary_embedding_with_kv_cache, q, k, v, positions, slots, head_dim,
                      num_kv_heads, torch.float32)
    want = _run_rotary(rotary_embedding_with_kv_cache_ref, q.contiguous(), k.contiguous(),
                       v.contiguous(), positions, slots, head_dim, num_kv_heads, torch.float32)
    for g, w in zip(got, want):
        _close(g, w)
    key_cache = got[2].view(-1, num_kv_heads, head_dim)
    assert (key_cache[[0, 2, 3, 19, 21]] == 7.0).all()  # only slots 1 and 20 written


# --- paged decode attention ----------------------------------------------------------

def _paged_cache(num_seqs: int, num_kv_heads: int, head_dim: int, block_size: int,
                 blocks_per_seq: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    num_blocks = num_seqs * blocks_per_seq + 2
    key_cache = _randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    value_cache = _randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    tables = torch.randperm(num_blocks, device=DEVICE)[: num_seqs * blocks_per_seq]
    return key_cache, value_cache, tables.view(num_seqs, blocks_per_seq).int()


def _decode_case(dtype: torch.dtype, num_heads: int, num_kv_heads: int, seq_lens: list[int],
                 block_size: int = 16, blocks_per_seq: int = 4, head_dim: int = 32):
    key_cache, value_cache, tables = _paged_cache(len(seq_lens), num_kv_heads, head_dim,
                                                  block_size, blocks_per_seq, dtype)
    q = _randn(len(seq_lens), num_heads, head_dim, dtype=dtype)
    lens = torch.tensor(seq_lens, device=DEVICE, dtype=torch.int32)
    return q, key_cache, value_cache, tables, lens, 1 / math.sqrt(head_dim)


@pytest.mark.parametrize("split", [False, True], ids=["single", "split_kv"])
@pytest.mark.parametrize("sliding_window", [None, 20])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (4, 1)], ids=["mha", "gqa4"])
def test_decode_attention_matches_reference(num_heads: int, num_kv_heads: int,
                                            sliding_window: int | None, split: bool) -> None:
    # Lengths around the 16-token block boundary, a one-token context, and a full table.
    args = _decode_case(torch.float32, num_heads, num_kv_heads, [1, 15, 16, 17, 64])
    got = paged_decode_attention(*args, sliding_window=sliding_window,
                                 partition_size=32 if split else None, block_n=16)
    _close_attn(got, paged_decode_attention_ref(*args, sliding_window=sliding_window))


@pytest.mark.parametrize("dtype", ATTN_DTYPES)
def test_decode_attention_in_half_precision(dtype: torch.dtype) -> None:
    args = _decode_case(dtype, 8, 2, [5, 40, 64])
    got = paged_decode_attention(*args, partition_size=32, block_n=16)
    _close_attn(got, paged_decode_attention_ref(*args))


def test_decode_attention_with_gqa_group_of_seven_and_small_blocks() -> None:
    # Qwen2.5-7B's ratio (28 / 4): the group does not fill the 16-row tile.
    args = _decode_case(torch.float32, 7, 1, [9, 30], block_size=4, blocks_per_seq=8)
    got = paged_decode_attention(*args, partition_size=16, block_n=16)
    _close_attn(got, paged_decode_attention_ref(*args))


def test_decode_attention_auto_partitions_by_batch() -> None:
    from rvllm.kernels.triton.decode_attention import auto_partition_size

    assert auto_partition_size(1, 4) == 128  # one 7B sequence: cut its context finer
    assert auto_partition_size(128, 4) == 512
    # The default ("auto") at a small batch: 300 tokens cross three 128-token partitions.
    args = _decode_case(torch.float32, 4, 2, [150, 300], blocks_per_seq=20)
    _close_attn(paged_decode_attention(*args), paged_decode_attention_ref(*args))


@pytest.mark.parametrize("split", [False, True], ids=["single", "split_kv"])
def test_decode_attention_padding_rows_give_zeros(split: bool) -> None:
    args = _decode_case(torch.float32, 2, 1, [0, 20])
    got = paged_decode_attention(*args, partition_size=32 if split else None, block_n=16)
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    _close_attn(got[1], paged_decode_attention_ref(*args)[1])


# --- paged prefill attention ---------------------------------------------------------

def _prefill_case(dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                  chunks: list[tuple[int, int]], head_dim: int = 32):
    """chunks: (cached context length, new tokens) per sequence."""
    key_cache, value_cache, tables = _paged_cache(len(chunks), num_kv_heads, head_dim, 16, 4,
                                                  dtype)
    q_lens = [n for _, n in chunks]
    starts = torch.tensor([0, *q_lens], device=DEVICE).cumsum(0).int()
    lens = torch.tensor([c + n for c, n in chunks], device=DEVICE, dtype=torch.int32)
    q = _randn(sum(q_lens), num_heads, head_dim, dtype=dtype)
    return (q, key_cache, value_cache, tables, starts, lens, max(q_lens),
            1 / math.sqrt(head_dim))


# A one-token prompt, a prompt crossing a block, prefix hits ending mid-block and on a block
# boundary, and a short chunk after a long cached prefix.
CHUNKS = [(0, 1), (0, 17), (5, 12), (16, 16), (45, 3)]


@pytest.mark.parametrize("sliding_window", [None, 6])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (4, 1)], ids=["mha", "gqa4"])
def test_prefill_attention_matches_reference(num_heads: int, num_kv_heads: int,
                                             sliding_window: int | None) -> None:
    args = _prefill_case(torch.float32, num_heads, num_kv_heads, CHUNKS)
    got = paged_prefill_attention(*args, sliding_window=sliding_window, block_m=16,
                                  block_n=16)
    _close_attn(got, paged_prefill_attention_ref(*args, sliding_window=sliding_window))


@pytest.mark.parametrize("dtype", ATTN_DTYPES)
def test_prefill_attention_in_half_precision(dtype: torch.dtype) -> None:
    args = _prefill_case(dtype, 4, 2, [(0, 20), (10, 7)])
    got = paged_prefill_attention(*args, block_m=16, block_n=16)
    _close_attn(got, paged_prefill_attention_ref(*args))


def test_prefill_of_one_token_equals_decode() -> None:
    q, key_cache, value_cache, tables, starts, lens, _, scale = _prefill_case(
        torch.float32, 4, 2, [(20, 1), (0, 1), (40, 1)])
    prefill = paged_prefill_attention(q, key_cache, value_cache, tables, starts, lens, 1, scale,
                                      block_m=16, block_n=16)
    decode = paged_decode_attention(q, key_cache, value_cache, tables, lens, scale, block_n=16)
    _close_attn(prefill, decode)


# --- fused decode GEMVs ----------------------------------------------------------------

# (rows, outputs, inputs): one to four rows; outputs no multiple of a program's 4-32;
# inputs past one tile and no multiple of it.
GEMV_SHAPES = [(1, 37, 300), (3, 72, 96), (4, 5, 1030)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n,k", GEMV_SHAPES)
def test_norm_gemv_matches_reference_and_returns_the_new_residual(
        dtype: torch.dtype, rows: int, n: int, k: int) -> None:
    x, res = _randn(rows, k, dtype=dtype), _randn(rows, k, dtype=dtype)
    norm_w, bias = _randn(k, dtype=dtype), _randn(n, dtype=dtype)
    weight = _randn(n, k, dtype=dtype) / math.sqrt(k)
    x0, res0 = x.clone(), res.clone()
    for residual in (res, None):
        out, new_res = norm_gemv(x, residual, norm_w, 1e-6, weight, bias)
        want_out, _ = norm_gemv_ref(x, residual, norm_w, 1e-6, weight, bias)
        _close(out, want_out, 2 * TOL[dtype])
        # The new residual is the separate norm kernel's, bit for bit.
        want_res = x if residual is None else fused_add_rms_norm(x, residual, norm_w, 1e-6)[1]
        assert torch.equal(new_res, want_res)
    assert torch.equal(x, x0) and torch.equal(res, res0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n,k", GEMV_SHAPES)
def test_silu_mul_gemv_is_the_gemv_of_silu_and_mul(dtype: torch.dtype, rows: int, n: int,
                                                    k: int) -> None:
    x, bias = _randn(rows, 2 * k, dtype=dtype), _randn(n, dtype=dtype)
    weight = _randn(n, k, dtype=dtype) / math.sqrt(k)
    out = silu_mul_gemv(x, weight, bias, block_n=8)
    _close(out, silu_mul_gemv_ref(x, weight, bias), 2 * TOL[dtype])
    # The activation rounds as the separate kernel does: its GEMV's input is the same.
    assert torch.equal(out, gemv(silu_and_mul(x), weight, bias, block_n=8))


def test_fused_gemvs_refuse_more_than_four_rows() -> None:
    with pytest.raises(ValueError, match="at most 4 rows"):
        gemv(_randn(5, 8), _randn(3, 8))


# --- start-up self-check -------------------------------------------------------------

def test_check_kernels_passes_and_names_every_kernel() -> None:
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    assert check_kernels(DEVICE, dtype) == list(KERNEL_NAMES)
    assert check_kernels(DEVICE, dtype, ["fused_gemv"]) == ["fused_gemv"]


def test_check_kernels_names_the_kernel_that_does_not_match(monkeypatch) -> None:
    def wrong(dev, dtype):
        x = torch.ones(3, device=dev)
        return (x + 1,), (x,)

    monkeypatch.setitem(check.CASES, "silu_and_mul", wrong)
    monkeypatch.setattr(kernels, "_CHECKED", set())  # forget earlier passes
    with pytest.raises(RuntimeError, match="silu_and_mul does not match"):
        check_kernels(DEVICE, torch.float32, ["silu_and_mul"])


def test_check_kernels_names_the_kernel_that_fails_to_run(monkeypatch) -> None:
    def broken(dev, dtype):
        raise ValueError("boom")

    monkeypatch.setitem(check.CASES, "greedy_sample", broken)
    monkeypatch.setattr(kernels, "_CHECKED", set())
    with pytest.raises(RuntimeError, match="greedy_sample failed to compile or run.*boom"):
        check_kernels(DEVICE, torch.float32, ["greedy_sample"])
