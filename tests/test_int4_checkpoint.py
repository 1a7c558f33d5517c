"""Specification of INT4 weight-only checkpoints: configs, the AWQ, GPTQ and
compressed-tensors layouts (checkpoints built here by packing known quantizations, written
and read back with safetensors), the RTN quantizer and `Int4Weight`."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from rvllm.models.int4_checkpoint import (
    Int4Config,
    Int4Weight,
    int4_config,
    int4_linear_names,
    iter_int4_weights,
    quantize_int4_rtn,
    unpack_int4,
)

PLAIN = tuple(range(8))
# AWQ's GEMM packer puts columns 0, 2, 4, 6, 1, 3, 5, 7 of each run of eight into nibbles 0..7.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


# ---------------------------------------------------------------- reference packing


def pack_rows(values: torch.Tensor, order: tuple[int, ...] = PLAIN) -> torch.Tensor:
    """Pack a `[R, C]` tensor of 0..15 along C, eight per int32 (C padded with zeros):
    nibble i of a word holds element `order[i]` of its run of eight."""
    v = values.to(torch.int64).numpy().astype(np.uint32)
    rows, cols = v.shape
    padded = np.zeros((rows, -(-cols // 8) * 8), dtype=np.uint32)
    padded[:, :cols] = v
    runs = padded.reshape(rows, -1, 8)
    words = np.zeros(runs.shape[:2], dtype=np.uint32)
    for nibble, element in enumerate(order):
        words |= runs[:, :, element] << np.uint32(4 * nibble)
    return torch.from_numpy(words.view(np.int32).copy())


def pack_cols(values: torch.Tensor) -> torch.Tensor:
    """Pack a `[R, C]` tensor of 0..15 along R (padded), eight per int32, in plain order."""
    return pack_rows(values.t()).t().contiguous()


def stored(weight: Int4Weight, dtype: torch.dtype) -> Int4Weight:
    """`weight` with its scales rounded to the checkpoint's scale dtype, so that what the
    checkpoint holds is exactly this quantization."""
    return Int4Weight(weight.q, weight.scale.to(dtype).float(), weight.zero, weight.group)


def quantize_sym(w: torch.Tensor, group: int) -> Int4Weight:
    """Symmetric reference quantization: zero 8, scale = 2 * absmax / 15 per group."""
    n, k = w.shape
    runs = w.reshape(n, k // group, group)
    scale = runs.abs().amax(-1) * 2 / 15
    q = (torch.round(runs / scale.unsqueeze(-1)) + 8).clamp(0, 15).to(torch.uint8)
    return Int4Weight(q.reshape(n, k), scale, torch.full_like(scale, 8.0), group)


def assert_same(got: Int4Weight, want: Int4Weight) -> None:
    assert got.group == want.group
    assert got.q.dtype == torch.uint8 and torch.equal(got.q, want.q)
    assert got.scale.dtype == torch.float32 and torch.equal(got.scale, want.scale)
    assert got.zero.dtype == torch.float32 and torch.equal(got.zero, want.zero)
    assert torch.equal(got.dequantize(), want.dequantize())


# ---------------------------------------------------------------- the three layouts


def awq_tensors(w: Int4Weight, cfg: dict) -> dict[str, torch.Tensor]:
    return {
        "qweight": pack_rows(w.q.t(), AWQ_PACK_ORDER),
        "qzeros": pack_rows(w.zero.t(), AWQ_PACK_ORDER),
        "scales": w.scale.t().half().contiguous(),
    }


def gptq_tensors(w: Int4Weight, cfg: dict) -> dict[str, torch.Tensor]:
    k = w.q.shape[1]
    zero = w.zero.t()
    if cfg.get("checkpoint_format", "gptq") == "gptq":
        zero = zero - 1  # the original format stores zero points minus one
    return {
        "qweight": pack_rows(w.q).t().contiguous(),  # along K: [K/8, N]
        "qzeros": pack_rows(zero),
        "scales": w.scale.t().half().contiguous(),
        "g_idx": (torch.arange(k) // w.group).to(torch.int32),
    }


def ct_tensors(w: Int4Weight, cfg: dict, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    tensors = {
        "weight_packed": pack_rows(w.q),
        "weight_scale": w.scale.to(scale_dtype),
        "weight_shape": torch.tensor(w.q.shape, dtype=torch.int64),
    }
    if not cfg["config_groups"]["group_0"]["weights"]["symmetric"]:
        tensors["weight_zero_point"] = pack_cols(w.zero)  # [ceil(N/8), G]
    return tensors


def awq_config(group: int) -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
            "version": "gemm", "modules_to_not_convert": None}


def gptq_config(group: int, sym: bool, fmt: str = "gptq", desc_act: bool = False) -> dict:
    return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": desc_act,
            "sym": sym, "checkpoint_format": fmt, "true_sequential": True}


def ct_config(group: int | None, sym: bool, strategy: str = "group", **weights) -> dict:
    args = {"num_bits": 4, "type": "int", "symmetric": sym, "strategy": strategy,
            "group_size": group, "dynamic": False, "actorder": None, "observer": "minmax"}
    args.update(weights)
    return {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "quantization_status": "compressed", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": args,
                                      "input_activations": None, "output_activations": None}},
    }


Case = tuple[str, dict, int, int, bool, Callable[[Int4Weight, dict], dict[str, torch.Tensor]],
             torch.dtype]

CASES: list[Case] = [
    # name, quantization_config, N, K, symmetric, layout, scale dtype
    ("awq-g32", awq_config(32), 24, 64, False, awq_tensors, torch.float16),
    ("awq-g64", awq_config(64), 16, 128, False, awq_tensors, torch.float16),
    ("awq-g128", awq_config(128), 40, 256, False, awq_tensors, torch.float16),
    ("gptq-asym-g32", gptq_config(32, False), 24, 64, False, gptq_tensors, torch.float16),
    ("gptq-sym-g128", gptq_config(128, True), 40, 256, True, gptq_tensors, torch.float16),
    ("gptq_v2-asym-g64", gptq_config(64, False, "gptq_v2"), 24, 128, False, gptq_tensors,
     torch.float16),
    ("gptq_v2-sym-g32", gptq_config(32, True, "gptq_v2"), 8, 64, True, gptq_tensors,
     torch.float16),
    ("gptq-asym-per-channel", gptq_config(-1, False), 24, 64, False, gptq_tensors,
     torch.float16),
    ("ct-sym-g32", ct_config(32, True), 20, 64, True,
     lambda w, c: ct_tensors(w, c, torch.float16), torch.float16),
    ("ct-asym-g128", ct_config(128, False), 20, 256, False,
     lambda w, c: ct_tensors(w, c, torch.bfloat16), torch.bfloat16),
    ("ct-asym-g64", ct_config(64, False), 36, 128, False,
     lambda w, c: ct_tensors(w, c, torch.float16), torch.float16),
    ("ct-sym-channel", ct_config(None, True, "channel"), 12, 64, True,
     lambda w, c: ct_tensors(w, c, torch.float32), torch.float32),
    ("ct-asym-channel", ct_config(None, False, "channel"), 20, 64, False,
     lambda w, c: ct_tensors(w, c, torch.bfloat16), torch.bfloat16),
]


def source_quantization(n: int, k: int, group: int, sym: bool, scale_dtype: torch.dtype,
                        seed: int) -> Int4Weight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    g = k if group == -1 else group
    quantized = quantize_sym(w, g) if sym else quantize_int4_rtn(w, g)
    return stored(quantized, scale_dtype)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_checkpoint_round_trip(case: Case, tmp_path: Path) -> None:
    name, qc, n, k, sym, layout, scale_dtype = case
    config = int4_config({"model_type": "llama", "quantization_config": qc})
    assert config is not None and config.symmetric == sym
    group = config.group_size
    linears = {
        "model.layers.0.self_attn.q_proj": source_quantization(n, k, group, sym, scale_dtype, 1),
        "model.layers.0.mlp.down_proj": source_quantization(8, k, group, sym, scale_dtype, 2),
    }
    if qc.get("checkpoint_format") == "gptq" and not sym:
        # zero 0 has no encoding in the minus-one format; random groups never need it
        assert all(bool((w.zero >= 1).all()) for w in linears.values())
    plain = {"model.embed_tokens.weight": torch.randn(11, k).half(),
             "model.norm.weight": torch.ones(k)}
    checkpoint = dict(plain)
    for prefix, weight in linears.items():
        for suffix, tensor in layout(weight, qc).items():
            checkpoint[f"{prefix}.{suffix}"] = tensor
    path = tmp_path / "model.safetensors"
    save_file(checkpoint, str(path))

    with safe_open(str(path), framework="pt") as f:
        names = list(f.keys())
        random.Random(name).shuffle(names)  # parts of one linear may come in any order
        stream = [(key, f.get_tensor(key)) for key in names]

    grouped = int4_linear_names(names, config)
    assert set(grouped) == set(linears)
    for prefix, parts in grouped.items():
        assert parts == {s: f"{prefix}.{s}" for s in layout(linears[prefix], qc)}
    assert int4_linear_names(names) == grouped  # the format follows from the names too

    out = dict(iter_int4_weights(stream, config))
    assert set(out) == set(plain) | {p + ".weight" for p in linears}
    for key, tensor in plain.items():
        assert torch.equal(out[key], tensor) and out[key].dtype == tensor.dtype
    for prefix, want in linears.items():
        got = out[prefix + ".weight"]
        assert isinstance(got, Int4Weight)
        assert_same(got, want)
        tensors = {s: dict(stream)[full] for s, full in grouped[prefix].items()}
        assert_same(unpack_int4(config, tensors), want)


def test_awq_nibble_order_is_interleaved() -> None:
    # Columns 0..7 hold values 0..7: the word must read 7,5,3,1,6,4,2,0 from the top nibble.
    config = Int4Config("awq", 32, symmetric=False)
    q = torch.arange(8, dtype=torch.uint8).repeat(32, 1).t().contiguous()  # [N=8, K=32]
    word = 0x75316420
    tensors = {"qweight": torch.full((32, 1), word, dtype=torch.int32),
               "qzeros": torch.full((1, 1), word, dtype=torch.int32),
               "scales": torch.ones(1, 8, dtype=torch.float16)}
    got = unpack_int4(config, tensors)
    assert torch.equal(got.q, q)
    assert torch.equal(got.zero, torch.arange(8.0).unsqueeze(1))
    assert torch.equal(pack_rows(q.t(), AWQ_PACK_ORDER), tensors["qweight"])


def test_gptq_zero_point_conventions() -> None:
    # The same stored nibbles mean zero + 1 in "gptq" and zero in "gptq_v2"; sym ignores them.
    k, n = 32, 8
    tensors = {"qweight": torch.zeros(k // 8, n, dtype=torch.int32),
               "qzeros": torch.full((1, 1), 0x76543210, dtype=torch.int32),
               "scales": torch.ones(1, n, dtype=torch.float16)}
    v1 = unpack_int4(Int4Config("gptq", 32, False, "gptq"), tensors)
    v2 = unpack_int4(Int4Config("gptq", 32, False, "gptq_v2"), tensors)
    sym = unpack_int4(Int4Config("gptq", 32, True, "gptq"), tensors)
    assert torch.equal(v1.zero[:, 0], torch.arange(1.0, 9.0))
    assert torch.equal(v2.zero[:, 0], torch.arange(0.0, 8.0))
    assert torch.equal(sym.zero, torch.full((n, 1), 8.0))


def test_ct_values_are_stored_offset_by_eight() -> None:
    # Signed -8..7 stored plus 8; symmetric zero is 8, so q = 8 means weight 0.
    config = int4_config({"quantization_config": ct_config(32, True)})
    signed = torch.arange(-8, 8).repeat(3, 2)  # [3, 32]
    tensors = {"weight_packed": pack_rows(signed + 8),
               "weight_scale": torch.full((3, 1), 0.5, dtype=torch.bfloat16),
               "weight_shape": torch.tensor([3, 32])}
    got = unpack_int4(config, tensors)
    assert torch.equal(got.dequantize(), signed.float() * 0.5)


# ---------------------------------------------------------------- streams


def _gptq_stream(prefix: str = "layer.proj") -> tuple[Int4Config, dict[str, torch.Tensor]]:
    qc = gptq_config(32, False)
    w = source_quantization(8, 64, 32, False, torch.float16, 3)
    return int4_config({"quantization_config": qc}), {
        f"{prefix}.{s}": t for s, t in gptq_tensors(w, qc).items()}


def test_missing_part_names_the_linear() -> None:
    config, tensors = _gptq_stream()
    del tensors["layer.proj.qzeros"]
    with pytest.raises(ValueError, match=r"layer\.proj lacks qzeros"):
        list(iter_int4_weights(tensors.items(), config))


def test_duplicate_part_is_refused() -> None:
    config, tensors = _gptq_stream()
    items = list(tensors.items())
    with pytest.raises(ValueError, match=r"layer\.proj: qweight appears twice"):
        list(iter_int4_weights(items + items[:1], config))


def test_act_order_g_idx_is_refused_before_or_after_the_weight() -> None:
    config, tensors = _gptq_stream()
    tensors["layer.proj.g_idx"] = tensors["layer.proj.g_idx"].flip(0)
    early = [("layer.proj.g_idx", tensors.pop("layer.proj.g_idx"))]
    with pytest.raises(ValueError, match=r"layer\.proj: g_idx .*act-order"):
        list(iter_int4_weights(early + list(tensors.items()), config))
    with pytest.raises(ValueError, match=r"layer\.proj: g_idx .*act-order"):
        list(iter_int4_weights(list(tensors.items()) + early, config))


def test_no_config_passes_everything_through() -> None:
    _, tensors = _gptq_stream()
    assert list(iter_int4_weights(tensors.items(), None)) == list(tensors.items())


# ---------------------------------------------------------------- config


@pytest.mark.parametrize("hf_config", [{}, {"quantization_config": None},
                                       {"quantization_config": {}}])
def test_no_quantization_config(hf_config: dict) -> None:
    assert int4_config(hf_config) is None


def test_configs_read() -> None:
    assert int4_config({"quantization_config": awq_config(128)}) == Int4Config(
        "awq", 128, symmetric=False)
    assert int4_config({"quantization_config": gptq_config(64, True)}) == Int4Config(
        "gptq", 64, symmetric=True, checkpoint_format="gptq")
    assert int4_config({"quantization_config": ct_config(32, False)}) == Int4Config(
        "compressed-tensors", 32, symmetric=False)
    autoawq = {"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "zero_point": True,
               "version": "GEMM"}
    assert int4_config({"quantization_config": autoawq}) == Int4Config("awq", 64, False)


def _replace(config: dict, **changes) -> dict:
    return {**config, **changes}


def _ct_weights(**changes) -> dict:
    config = ct_config(128, True)
    config["config_groups"]["group_0"]["weights"].update(changes)
    return config


@pytest.mark.parametrize(("qc", "pattern"), [
    (_replace(gptq_config(128, True), bits=8), r"gptq .*bits = 8"),
    (_replace(awq_config(128), bits=8), r"awq .*bits = 8"),
    (_ct_weights(num_bits=8), r"compressed-tensors .*num_bits = 8"),
    (awq_config(48), r"awq .*group_size = 48"),
    (gptq_config(48, True), r"gptq .*group_size = 48"),
    (_ct_weights(group_size=48), r"compressed-tensors .*group_size = 48"),
    (gptq_config(128, True, desc_act=True), r"gptq .*desc_act = True"),
    (_ct_weights(actorder="group"), r"compressed-tensors .*actorder = 'group'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, r"quant_method = 'bitsandbytes'"),
    ({"quant_method": "fp8"}, r"quant_method = 'fp8'"),
    (_replace(awq_config(128), version="gemv"), r"awq .*version = 'gemv'"),
    (_replace(awq_config(128), zero_point=False), r"awq .*zero_point = False"),
    (gptq_config(128, False, fmt="marlin"), r"gptq .*checkpoint_format = 'marlin'"),
    (_replace(ct_config(128, True), format="int-quantized"), r"format = 'int-quantized'"),
    (_ct_weights(strategy="tensor"), r"strategy = 'tensor'"),
    (_ct_weights(type="float"), r"type = 'float'"),
])
def test_unsupported_configs_are_refused(qc: dict, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        int4_config({"quantization_config": qc})


def test_ct_weight_and_activation_scheme_is_refused() -> None:
    qc = ct_config(128, True)
    qc["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int"}
    with pytest.raises(ValueError, match="input_activations"):
        int4_config({"quantization_config": qc})


# ---------------------------------------------------------------- RTN quantizer


@pytest.mark.parametrize(("n", "k", "group"), [(20, 64, 32), (7, 256, 128), (33, 128, 64)])
def test_rtn_error_is_at_most_half_a_step(n: int, k: int, group: int) -> None:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n)) * 3
    w[0, :group] = torch.rand(group) + 1      # all positive
    w[1, :group] = -torch.rand(group) - 1     # all negative
    w[2, :group] = 0                          # all zero
    w[3, :group] = 0.7                        # constant
    w[4, :group] *= 1e4                       # wide range
    got = quantize_int4_rtn(w, group)
    assert got.q.shape == (n, k) and got.scale.shape == (n, k // group) and got.group == group
    assert int(got.q.max()) <= 15
    assert torch.equal(got.zero, got.zero.round()) and bool(((got.zero >= 0)
                                                              & (got.zero <= 15)).all())
    assert bool((got.scale > 0).all())
    error = (w - got.dequantize()).abs().reshape(n, k // group, group)
    bound = got.scale.unsqueeze(-1) / 2 * (1 + 1e-5)
    assert bool((error <= bound).all())
    assert torch.equal(got.dequantize()[2, :group], torch.zeros(group))


def test_rtn_formula() -> None:
    w = torch.linspace(-1, 2, 32).reshape(1, 32)
    got = quantize_int4_rtn(w, 32)
    scale = torch.tensor(3.0) / 15
    assert torch.equal(got.scale, scale.reshape(1, 1))
    assert torch.equal(got.zero, torch.tensor([[5.0]]))
    want = torch.round(w / scale + 5).clamp(0, 15).to(torch.uint8)
    assert torch.equal(got.q, want) and got.q[0, 0] == 0 and got.q[0, -1] == 15


def test_rtn_accepts_half_precision_input() -> None:
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    assert_same(quantize_int4_rtn(w.half(), 32), quantize_int4_rtn(w.half().float(), 32))


@pytest.mark.parametrize(("shape", "group", "pattern"), [
    ((8, 96), 48, "group = 48"), ((8, 48), 32, "K = 48 is not a multiple"),
    ((4, 8, 32), 32, "2-D")])
def test_rtn_refuses_bad_groups(shape: tuple[int, ...], group: int, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        quantize_int4_rtn(torch.zeros(shape), group)


# ---------------------------------------------------------------- Int4Weight


def test_rows_and_cat() -> None:
    w = quantize_int4_rtn(torch.randn(37, 64, generator=torch.Generator().manual_seed(5)), 32)
    full = w.dequantize()
    q_part, k_part, v_part = w.rows(0, 16), w.rows(16, 13), w.rows(29, 8)
    assert torch.equal(k_part.dequantize(), full[16:29])
    assert k_part.q.shape == (13, 64) and k_part.scale.shape == (13, 2)
    assert_same(Int4Weight.cat([q_part, k_part, v_part]), w)
    assert_same(Int4Weight.cat([v_part, q_part]),
                Int4Weight(torch.cat([w.q[29:], w.q[:16]]), torch.cat([w.scale[29:],
                           w.scale[:16]]), torch.cat([w.zero[29:], w.zero[:16]]), 32))
    assert w.rows(37, 0).q.shape == (0, 64)
    with pytest.raises(ValueError, match="out of range"):
        w.rows(30, 8)
    other = quantize_int4_rtn(torch.randn(4, 64), 64)
    with pytest.raises(ValueError, match="differ"):
        Int4Weight.cat([w, other])
    with pytest.raises(ValueError, match="at least one"):
        Int4Weight.cat([])


def test_int4_weight_checks_its_fields() -> None:
    q = torch.zeros(4, 64, dtype=torch.uint8)
    scale = torch.ones(4, 2)
    with pytest.raises(ValueError, match="uint8"):
        Int4Weight(q.to(torch.int32), scale, scale, 32)
    with pytest.raises(ValueError, match="does not divide"):
        Int4Weight(q, scale, scale, 48)
    with pytest.raises(ValueError, match="zero must be float32"):
        Int4Weight(q, scale, scale.half(), 32)
    with pytest.raises(ValueError, match="scale must be float32 of shape"):
        Int4Weight(q, torch.ones(4, 1), scale, 32)
