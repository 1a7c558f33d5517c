"""The GPU's quantized paths against their plain-torch references: the int4 (W4A16) and
FP8 (W8A16) linear kernels, the FP8 KV cache's write and the attention kernels reading
it, the attention layer's scale calibration, the model-level packing
(``layers.gpu_quant``), and the CPU's refusal of an FP8 cache.

Without CUDA the kernels run in Triton's interpreter on CPU tensors. Its bfloat16
``tl.dot`` is wrong (test_kernels.py), so the GEMMs are tested there in float32 and
float16, and bfloat16 through the GEMVs only (no tl.dot); bfloat16 GEMMs are covered by
the start-up check on a GPU (``kernels.triton.check``).

Tolerances (atol = rtol, on outputs of order 1), against a float32 reference on the same
quantized weights: float32 1e-4 with float32-packed scales, 3e-3 with float16-packed ones
(each scale rounded by up to 2^-11); float16 5e-3; bfloat16 3e-2 (one rounding of the
output, 2^-9, on sums of order 1-10). The FP8 cache: bit-exact writes where the kernel
and the reference quantize the same numbers; attention over it within 1e-4 (float32) /
5e-3 (float16) of the reference on the same cache, and within 8% (relative, in norm) of
attention over the unquantized keys and values (E4M3 keeps 3 mantissa bits).
"""

from __future__ import annotations

import math
import os
import sys
from types import SimpleNamespace

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu":
    # triton.jit reads this when a kernel is defined, so it must precede every kernel import.
    if any(name.startswith("rvllm.kernels.triton.") for name in sys.modules) and \
            os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("rvllm.kernels.triton was imported before TRITON_INTERPRET=1 was set.")
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="the Triton kernels need the triton package (test extras)")

from rvllm.config import resolve_kv_cache_dtype  # noqa: E402
from rvllm.kernels.triton import check, kv_fp8  # noqa: E402
from rvllm.kernels.triton.decode_attention import (  # noqa: E402
    paged_decode_attention,
    paged_decode_attention_ref,
)
from rvllm.kernels.triton.fp8_linear import (  # noqa: E402
    fp8_linear,
    fp8_linear_reference,
    quantize_fp8_weight,
)
from rvllm.kernels.triton.prefill_attention import (  # noqa: E402
    paged_prefill_attention,
    paged_prefill_attention_ref,
)
from rvllm.kernels.triton.rotary_kv import (  # noqa: E402
    rotary_embedding_with_kv_cache,
    rotary_embedding_with_kv_cache_ref,
)
from rvllm.kernels.triton.w4a16 import (  # noqa: E402
    pack_w4a16,
    unpack_w4a16,
    w4a16_linear,
    w4a16_reference,
)

TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
FP8 = kv_fp8.KV_FP8_DTYPE
# Attention over an E4M3 cache against attention over the unquantized keys and values:
# relative error of the whole output (norm of the difference / norm). E4M3 rounds each
# entry by up to 2^-4 (about 3% rms); with keys of 3 sigma the softmax is peaky enough to
# carry that through: 4-5% on these inputs.
FP8_ATTENTION_ERROR = 0.08


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def _int4_weight(n: int, k: int, group: int, seed: int = 0):  # noqa: ANN202
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    zero = torch.randint(0, 16, (n, k // group), generator=g).float()
    scale = (0.5 + torch.rand(n, k // group, generator=g)) / (8 * math.sqrt(k))
    return q.to(DEVICE), scale.to(DEVICE), zero.to(DEVICE)


# --- int4 (W4A16) ---------------------------------------------------------------------

@pytest.mark.parametrize("n,k,group", [(100, 640, 128), (37, 480, 48)])
def test_int4_packing_round_trips(n: int, k: int, group: int) -> None:
    """K padded to a whole chunk (640 -> 768 with planes of 32; 480 -> 512 with planes of
    16 for groups of 48); unpacking gives back q exactly and the scales to float16."""
    q, scale, zero = _int4_weight(n, k, group)
    packed = pack_w4a16(q, scale, zero, group)
    assert packed.plane == (32 if group % 32 == 0 else 16)
    assert packed.qweight.shape[1] * 8 % (8 * packed.plane) == 0
    assert packed.scale.dtype == torch.float16  # integral zeros, scales in range
    q2, scale2, zero2 = unpack_w4a16(packed)
    assert torch.equal(q2, q) and torch.equal(zero2, zero)
    torch.testing.assert_close(scale2, scale, atol=0, rtol=2**-11)
    tiny = pack_w4a16(q, scale * 1e-4, zero, group)  # float16 would flush these: float32
    assert tiny.scale.dtype == torch.float32


@pytest.mark.parametrize("dtype,rows", [(torch.float32, 1), (torch.float32, 3),
                                        (torch.float32, 17), (torch.float16, 1),
                                        (torch.float16, 17), (torch.bfloat16, 1),
                                        (torch.bfloat16, 3)])
def test_w4a16_matches_reference(dtype: torch.dtype, rows: int) -> None:
    n, k, group = 100, 640, 128  # N no multiple of the tiles, K padded
    q, scale, zero = _int4_weight(n, k, group, seed=rows)
    packed = pack_w4a16(q, scale, zero, group,
                        scale_dtype=torch.float32 if dtype == torch.float32 else None)
    x = torch.randn(rows, k, device=DEVICE, dtype=dtype)
    bias = torch.randn(n, device=DEVICE, dtype=dtype)
    want = w4a16_reference(x, q, scale, zero, group, bias)
    _close(w4a16_linear(x, packed, bias), want, TOL[dtype])
    _close(w4a16_linear(x, packed, bias, split_k=3), want, TOL[dtype])
    _close(w4a16_linear(x, packed), w4a16_reference(x, q, scale, zero, group), TOL[dtype])


def test_w4a16_gemv_and_gemm_agree_and_planes_of_16() -> None:
    """The same rows through both kernels (gemv_max_rows moves the switch), on a group of
    48 (planes of 16) with float16-packed scales, leading dims kept."""
    n, k, group = 37, 480, 48
    q, scale, zero = _int4_weight(n, k, group)
    packed = pack_w4a16(q, scale, zero, group)
    x = torch.randn(2, 2, k, device=DEVICE)
    want = w4a16_reference(x, q, scale, zero, group)
    gemv = w4a16_linear(x, packed, gemv_max_rows=4)
    gemm = w4a16_linear(x, packed, gemv_max_rows=0)
    assert gemv.shape == (2, 2, n)
    _close(gemv, want, 3e-3)
    _close(gemm, want, 3e-3)


# --- FP8 weights (W8A16) -----------------------------------------------------------------

def test_fp8_weight_quantization() -> None:
    w = torch.randn(50, 96, device=DEVICE) * torch.logspace(-3, 1, 50, device=DEVICE)[:, None]
    w[3] = 0.0
    q, scale = quantize_fp8_weight(w)
    assert q.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == (50,)
    assert float(q.float().abs().amax(dim=1)[:3].min()) == 448.0  # each row's max maps to 448
    assert float(scale[3]) == 1.0 and not q[3].float().any()
    back = q.float() * scale[:, None]
    # Half an E4M3 step: 2^-4 relative for normals, 2^-10 * scale below 2^-6 * scale.
    assert bool(((back - w).abs() <= w.abs() / 16 + scale[:, None] / 1024).all())


@pytest.mark.parametrize("dtype,rows", [(torch.float32, 1), (torch.float32, 3),
                                        (torch.float32, 17), (torch.float16, 3),
                                        (torch.float16, 17), (torch.bfloat16, 1),
                                        (torch.bfloat16, 3)])
def test_fp8_linear_matches_reference(dtype: torch.dtype, rows: int) -> None:
    n, k = 100, 600  # neither a multiple of the tiles
    weight, scale = quantize_fp8_weight(torch.randn(n, k, device=DEVICE) / math.sqrt(k))
    x = torch.randn(rows, k, device=DEVICE, dtype=dtype)
    bias = torch.randn(n, device=DEVICE, dtype=dtype)
    want = fp8_linear_reference(x, weight, scale, bias)
    _close(fp8_linear(x, weight, scale, bias), want, TOL[dtype])
    _close(fp8_linear(x, weight, scale, bias, split_k=3), want, TOL[dtype])
    if dtype != torch.bfloat16:
        _close(fp8_linear(x, weight, scale, bias, gemv_max_rows=0), want, TOL[dtype])


# --- FP8 KV cache --------------------------------------------------------------------------

def _tables(num_blocks: int = 6) -> torch.Tensor:
    return torch.randperm(num_blocks, device=DEVICE).int()


def test_fp8_cache_write_is_torchs_rounding() -> None:
    """At position 0 RoPE is the identity, so the cache must hold torch's E4M3 rounding of
    k / k_scale and v / v_scale bit for bit: values over 20 binades (normals, subnormals,
    saturation, mantissas that round up into the next binade), negative slots unwritten."""
    g = torch.Generator().manual_seed(1)
    t, hk, d = 48, 2, 32
    k, v = (torch.randn(t, hk, d, generator=g)
            * 10.0 ** torch.randint(-3, 4, (t, hk, d), generator=g).float() for _ in range(2))
    k, v = k.to(DEVICE), v.to(DEVICE)
    kv_scale = torch.tensor([0.37, 0.011], device=DEVICE)
    slots = torch.arange(t, device=DEVICE)
    slots[5] = -1
    caches = [torch.zeros(4, 16, hk, d, device=DEVICE, dtype=FP8) for _ in range(2)]
    table = torch.zeros(8, d, device=DEVICE)
    rotary_embedding_with_kv_cache(torch.zeros(t, dtype=torch.long, device=DEVICE),
                                   torch.randn(t, 1, d, device=DEVICE), k.clone(), v,
                                   table.cos(), table.sin(), *caches, slots, kv_scale)
    keep = slots >= 0
    for cache, x, s in zip(caches, (k, v), kv_scale):
        flat = cache.view(-1, hk, d)
        assert torch.equal(flat[slots[keep]].view(torch.uint8),
                           kv_fp8.quantize_kv(x[keep], s).view(torch.uint8))
        assert not flat[5].float().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_cache_round_trip(dtype: torch.dtype) -> None:
    """Write a prompt's K/V into an FP8 cache through the fused RoPE kernel (against the
    reference write), then prefill and decode attention over it: against the references
    on the same cache, and near attention over the unquantized keys and values."""
    torch.manual_seed(0)
    block_size, hq, hk, d, length = 16, 4, 2, 32, 40
    q = torch.randn(length, hq, d, device=DEVICE, dtype=dtype)
    k = torch.randn(length, hk, d, device=DEVICE, dtype=dtype) * 3
    v = torch.randn(length, hk, d, device=DEVICE, dtype=dtype)
    freqs = torch.outer(torch.arange(64.0), 1e4 ** -(torch.arange(0, d, 2) / d))
    emb = torch.cat((freqs, freqs), dim=-1).to(DEVICE)
    positions = torch.arange(length, device=DEVICE)
    table = _tables()
    slots = (table.long()[positions // block_size] * block_size + positions % block_size)
    kv_scale = kv_fp8.new_kv_scale(DEVICE)
    kv_fp8.calibrate_kv_scale(kv_scale, k, v)
    want_scale = torch.stack((k.abs().max(), v.abs().max())).float() * 2 / 448
    torch.testing.assert_close(kv_scale, want_scale)

    out = []
    for fn in (rotary_embedding_with_kv_cache, rotary_embedding_with_kv_cache_ref):
        caches = [torch.zeros(6, block_size, hk, d, device=DEVICE, dtype=FP8) for _ in range(2)]
        q_rot, k_rot = fn(positions, q.clone(), k.clone(), v, emb.cos(), emb.sin(), *caches,
                          slots, kv_scale)
        out.append((q_rot, k_rot, *caches))
    (q_rot, k_rot, key_cache, value_cache), (_, k_ref, key_ref, value_ref) = out
    assert torch.equal(value_cache.view(torch.uint8), value_ref.view(torch.uint8))
    # The kernel's keys are its own rotation quantized, bit for bit. The reference rotates
    # in the model dtype (float16 here: a few of its ulps off where the two products
    # cancel), so its cache is within a step of E4M3 (2^-3 relative) of the kernel's, or
    # within 1.0 of the E4M3 range's 448 where float16's rounding moved a small key.
    flat = key_cache.view(-1, hk, d)[slots]
    assert torch.equal(flat.view(torch.uint8), kv_fp8.quantize_kv(k_rot, kv_scale[0])
                       .view(torch.uint8))
    torch.testing.assert_close(key_cache.float(), key_ref.float(), atol=1.0, rtol=2**-3)

    tol = TOL[dtype] if dtype == torch.float16 else 1e-4
    scale = 1 / math.sqrt(d)
    # Prefill: the prompt in two chunks (the second reads the first from the cache).
    query_start_loc = torch.tensor([0, 24, 40], device=DEVICE, dtype=torch.int32)
    two = torch.stack((table, table))
    seq_lens = torch.tensor([24, 40], device=DEVICE, dtype=torch.int32)
    args = (q_rot, key_cache, value_cache, two, query_start_loc, seq_lens, 24, scale)
    got = paged_prefill_attention(*args, block_m=16, block_n=16, kv_scale=kv_scale)
    _close(got, paged_prefill_attention_ref(*args, kv_scale=kv_scale), tol)
    plain = [c.to(dtype) for c in (key_ref, value_ref)]  # unquantized: k_rot, v written plain
    for cache, x in zip(plain, (k_rot, v)):
        cache.view(-1, hk, d)[slots] = x
    exact = paged_prefill_attention_ref(q_rot, *plain, *args[3:])
    assert _relative_error(got, exact) < FP8_ATTENTION_ERROR
    # Decode: three sequences of the same blocks, lengths 1, 17 and 40.
    qd = torch.randn(3, hq, d, device=DEVICE, dtype=dtype)
    lens = torch.tensor([1, 17, 40], device=DEVICE, dtype=torch.int32)
    tables = torch.stack((table, table, table))
    args = (qd, key_cache, value_cache, tables, lens, scale)
    want = paged_decode_attention_ref(*args, kv_scale=kv_scale)
    for partition in (None, 32):
        got = paged_decode_attention(*args, partition_size=partition, block_n=16,
                                     kv_scale=kv_scale)
        _close(got, want, tol)
    exact = paged_decode_attention_ref(qd, *plain, tables, lens, scale)
    assert _relative_error(got, exact) < FP8_ATTENTION_ERROR


@pytest.fixture
def triton_backend():  # noqa: ANN201
    from rvllm.layers.backend import set_kernel_backend

    set_kernel_backend("triton")
    yield
    set_kernel_backend("torch")


def test_attention_layer_calibrates_on_its_first_prefill(triton_backend: None) -> None:
    """An FP8 cache bound by the model runner: scales pending at 1.0; the first step with
    a prefill sets them from its keys and values (no RoPE: the layer's own quantized
    write), later steps keep them; decode then matches the same layer over a float32
    cache within FP8's error. Swapping blocks out and in keeps the bytes."""
    from rvllm.executor.model_runner import ModelRunner
    from rvllm.forward_context import (
        AttentionMetadata,
        PrefillSeq,
        add_block_tables,
        set_forward_context,
    )
    from rvllm.layers.attention import Attention

    torch.manual_seed(0)
    block_size, hq, hk, d = 16, 4, 2, 32
    layers = [Attention(hq, d, hk, 1 / math.sqrt(d)) for _ in range(2)]
    outputs = []
    for (attn, dtype) in zip(layers, (FP8, torch.float32)):
        runner = ModelRunner(SimpleNamespace(attention_layers=lambda a=attn: [a]), block_size,
                             DEVICE)
        runner.allocate_kv_cache(6, hk, d, dtype)
        if dtype == FP8:
            assert attn.kv_scale_pending and attn.kv_scale.tolist() == [1.0, 1.0]
        else:
            assert attn.kv_scale is None
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(30, h, d, generator=g).to(DEVICE) for h in (hq, hk, hk))
        k[:20] *= 2
        slots = torch.arange(16, 16 + 30, device=DEVICE)  # blocks 1 and 2
        steps = [(slice(0, 20), 0), (slice(20, 29), 20)]  # a prompt, then its next chunk
        for rows, context in steps:
            n = rows.stop - rows.start
            md = AttentionMetadata(slots[rows], 0, None, None,
                                   [PrefillSeq(0, n, context, slots[: context + n])])
            add_block_tables(md, block_size)
            with set_forward_context(md):
                attn(q[rows], k[rows], v[rows])
            if dtype == FP8:
                want = torch.stack((k[:20].abs().max(), v[:20].abs().max())) * 2 / 448
                torch.testing.assert_close(attn.kv_scale, want)  # the first prompt's
                assert not attn.kv_scale_pending
        md = AttentionMetadata(slots[29:30], 1, slots[None, :30], torch.tensor([30]), [])
        add_block_tables(md, block_size)
        with set_forward_context(md):
            outputs.append(attn(q[29:30], k[29:30], v[29:30]))
        if dtype == FP8:
            before = [t.view(torch.uint8).clone() for t in attn.kv_cache]
            runner.allocate_swap_space(2)
            runner.swap([(1, 0), (2, 1)], [])
            for t in attn.kv_cache:
                t.view(torch.uint8)[1:3] = 0
            runner.swap([], [(0, 1), (1, 2)])
            assert all(torch.equal(t.view(torch.uint8), b) for t, b in zip(attn.kv_cache, before))
    assert _relative_error(outputs[0], outputs[1]) < FP8_ATTENTION_ERROR


# --- the model-level packing -----------------------------------------------------------------

def test_prepare_gpu_quantized(triton_backend: None) -> None:
    """int4 (round to nearest, or a checkpoint's Int4Weight for one module) and fp8 on a
    stack of parallel linear layers: each module's output is its quantized weight's, the
    plain weight is freed on its device, the LM head keeps its weight."""
    from torch import nn

    from rvllm.layers.embedding import ParallelLMHead
    from rvllm.layers.gpu_quant import gpu_quant_linear, int4_group_for, prepare_gpu_quantized
    from rvllm.layers.linear import ColumnParallelLinear, RowParallelLinear
    from rvllm.models.int4_checkpoint import quantize_int4_rtn

    def build() -> nn.Module:
        torch.manual_seed(0)
        model = nn.Module()
        model.up = ColumnParallelLinear(256, 72, bias=True)
        model.down = RowParallelLinear(256, 40)
        model.head = ParallelLMHead(50, 256)
        for p in model.parameters():
            p.data.normal_(0, 0.05)
        return model.to(DEVICE)

    x = torch.randn(3, 256, device=DEVICE)
    model = build()
    weights = {name: m.weight.detach().clone() for name, m in model.named_modules()
               if hasattr(m, "weight")}
    given = {"down": quantize_int4_rtn(weights["down"], 64)}
    assert prepare_gpu_quantized(model, "int4", given) == 2
    assert model.up.linear_kind == "w4a16" and model.up.weight.numel() == 0
    assert model.up.weight.device == DEVICE and not hasattr(model.head, "linear_kind")
    assert model.down.w4a16_weight.group == 64
    rtn = quantize_int4_rtn(weights["up"], 128)
    want = w4a16_reference(x, rtn.q, rtn.scale, rtn.zero, 128, model.up.bias)
    _close(gpu_quant_linear(model.up, x, model.up.bias), want, 1e-3)
    down = given["down"]
    _close(gpu_quant_linear(model.down, x),
           w4a16_reference(x, down.q, down.scale, down.zero, 64), 1e-3)
    assert [int4_group_for(k) for k in (256, 320, 96, 100)] == [128, 64, 32, None]

    model = build()
    assert prepare_gpu_quantized(model, "fp8") == 2
    assert model.down.linear_kind == "fp8" and model.down.weight.numel() == 0
    w8, s8 = quantize_fp8_weight(weights["down"])
    _close(gpu_quant_linear(model.down, x), fp8_linear_reference(x, w8, s8), 1e-4)
    with pytest.raises(ValueError, match="must be one of"):
        prepare_gpu_quantized(build(), "int8")


# --- configuration -------------------------------------------------------------------------------

def test_fp8_kv_cache_dtype_is_cuda_only() -> None:
    for name in ("fp8", "fp8_e4m3"):
        assert resolve_kv_cache_dtype(name, torch.bfloat16, torch.device("cuda")) == FP8
        with pytest.raises(ValueError, match="fp8 KV cache needs a CUDA GPU; on the CPU use "
                                             "bfloat16"):
            resolve_kv_cache_dtype(name, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="must be one of auto, bfloat16, fp8, fp8_e4m3"):
        resolve_kv_cache_dtype("fp8_e5m2", torch.bfloat16, torch.device("cuda"))


@pytest.mark.parametrize("name", ["w4a16_linear", "fp8_linear", "fp8_kv_cache"])
def test_start_up_checks_of_the_quantized_kernels(name: str) -> None:
    dtype = torch.float16 if DEVICE.type == "cpu" else torch.bfloat16
    check.run_check(name, DEVICE, dtype)
