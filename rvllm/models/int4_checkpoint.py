"""INT4 weight-only checkpoints in safetensors (AWQ, GPTQ, compressed-tensors), unpacked
into one common form, plus a round-to-nearest INT4 quantizer.

Every format stores, for a linear layer of `N` outputs and `K` inputs, one 4-bit integer
`q` (0..15) per weight and, per group of `group` consecutive inputs of one output row, a
scale and a zero point; the weight is `scale * (q - zero)`. They differ in where the
nibbles sit inside int32 words and in how the zero point is written. Below, `G = K / group`
is the number of groups per row, and "nibble i" means bits `4i .. 4i+3` of an int32.

AWQ (``quant_method: "awq"``, ``version: "gemm"``)
    ``qweight`` int32 `[K, N/8]`: each word holds eight neighbouring *output* columns of one
    input row, not in order: nibbles 0..7 hold columns 0, 2, 4, 6, 1, 3, 5, 7 of that group
    of eight. ``qzeros`` int32 `[G, N/8]` is packed the same way; ``scales`` float16
    `[G, N]`. Zero points are stored as they are (AWQ is always asymmetric).

GPTQ (``quant_method: "gptq"``)
    ``qweight`` int32 `[K/8, N]`: packed along the *input* dimension; word `r` of column `n`
    holds inputs `8r .. 8r+7` in nibbles 0..7. ``qzeros`` int32 `[G, N/8]` is packed along
    the output dimension in plain order; ``scales`` float16 `[G, N]`; the optional ``g_idx``
    int32 `[K]` gives the group of every input. With ``checkpoint_format: "gptq"`` (the
    default, written by AutoGPTQ and, unless told otherwise, GPTQModel) a zero point is
    stored minus one, so the true zero is the nibble plus one (1..16); with ``"gptq_v2"`` it
    is stored as it is. Symmetric checkpoints (``sym: true``) use zero 8 throughout and their
    ``qzeros`` are not read. Act-order checkpoints (``desc_act: true``), whose groups are not
    runs of consecutive inputs, are refused.

compressed-tensors (``quant_method: "compressed-tensors"``, format ``"pack-quantized"``)
    ``weight_packed`` int32 `[N, ceil(K/8)]`: packed along the input dimension, nibble i
    holding input `8c + i`, the last word padded. Values are signed int4 (-8..7) stored
    plus 8, so the nibble is our `q` directly. ``weight_scale`` `[N, G]` (the model's float
    dtype) and ``weight_shape`` (the unpacked `[N, K]`) come with it. Symmetric schemes have
    no zero point (zero 8 in our terms); asymmetric ones add ``weight_zero_point`` int32
    `[ceil(N/8), G]`, packed along the *output* dimension, likewise stored plus 8.

`Int4Weight` is the unpacked form: `q` uint8 `[N, K]`, `scale` and `zero` float32 `[N, G]`.
`iter_int4_weights` turns a stream of checkpoint tensors into ordinary tensors plus one
`Int4Weight` per quantized linear.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from rvllm.layers.int4 import SUPPORTED_GROUP_SIZES, Int4Weight, quantize_int4_rtn

__all__ = ["SUPPORTED_GROUP_SIZES", "Int4Config", "Int4Weight", "int4_config",
           "int4_linear_names", "iter_int4_weights", "quantize_int4_rtn", "unpack_int4"]


# Nibble i of an AWQ word holds column AWQ_PACK_ORDER[i] of its eight output columns.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_PLAIN_ORDER = tuple(range(8))

# The tensors of one linear, by suffix, for each format.
_GPTQ_PARTS = ("qweight", "qzeros", "scales", "g_idx")
_CT_PARTS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point",
             "weight_g_idx")
_PRIMARY = {"qweight": _GPTQ_PARTS, "weight_packed": _CT_PARTS}


@dataclass(frozen=True)
class Int4Config:
    """The INT4 scheme of a checkpoint, read from its ``quantization_config``.

    `method` is "awq", "gptq" or "compressed-tensors"; `group_size` is 32, 64, 128 or -1
    (one group per output row); `symmetric` means zero is 8 everywhere; `checkpoint_format`
    ("gptq" or "gptq_v2") matters for GPTQ only and says whether zero points are stored
    minus one ("gptq") or as they are ("gptq_v2").
    """

    method: str
    group_size: int
    symmetric: bool
    checkpoint_format: str = ""


def _unsupported(method: str, field: str, value: Any, supported: str) -> ValueError:
    return ValueError(f"{method} quantization_config: {field} = {value!r} is not supported "
                      f"(supported: {supported})")


def _check_group(method: str, field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or (
            value != -1 and value not in SUPPORTED_GROUP_SIZES):
        raise _unsupported(method, field, value,
                           ", ".join(map(str, SUPPORTED_GROUP_SIZES)) + " or -1 (per channel)")
    return value


def _check_bits(method: str, field: str, value: Any) -> None:
    if value != 4 or isinstance(value, bool):
        raise _unsupported(method, field, value, "4")


def _first(config: Mapping[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if key in config:
            return config[key]
    return default


def _awq_config(qc: Mapping[str, Any]) -> Int4Config:
    method = "awq"
    _check_bits(method, "bits", _first(qc, "bits", "w_bit"))
    group = _check_group(method, "group_size", _first(qc, "group_size", "q_group_size"))
    version = _first(qc, "version", default="gemm")
    if str(version).lower() != "gemm":
        raise _unsupported(method, "version", version, "'gemm'")
    zero_point = qc.get("zero_point", True)
    if zero_point is not True:
        raise _unsupported(method, "zero_point", zero_point, "true")
    return Int4Config(method, group, symmetric=False)


def _gptq_config(qc: Mapping[str, Any]) -> Int4Config:
    method = "gptq"
    _check_bits(method, "bits", qc.get("bits"))
    group = _check_group(method, "group_size", qc.get("group_size"))
    desc_act = qc.get("desc_act", False)
    if desc_act:
        raise ValueError(
            f"gptq quantization_config: desc_act = {desc_act!r} (act-order) is not supported: "
            "its groups are not runs of consecutive inputs (see g_idx); re-quantize with "
            "desc_act false")
    if qc.get("is_marlin_format"):
        raise _unsupported(method, "is_marlin_format", qc["is_marlin_format"], "false")
    fmt = _first(qc, "checkpoint_format", "format", default="gptq") or "gptq"
    if fmt not in ("gptq", "gptq_v2"):
        raise _unsupported(method, "checkpoint_format", fmt, "'gptq', 'gptq_v2'")
    sym = qc.get("sym", True)
    if not isinstance(sym, bool):
        raise _unsupported(method, "sym", sym, "true, false")
    return Int4Config(method, group, symmetric=sym, checkpoint_format=fmt)


def _ct_config(qc: Mapping[str, Any]) -> Int4Config:
    method = "compressed-tensors"
    groups = qc.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise _unsupported(method, "config_groups", groups, "a non-empty mapping")
    sparsity = qc.get("sparsity_config")
    if sparsity:
        fmt = sparsity.get("format", "dense") if isinstance(sparsity, Mapping) else sparsity
        if fmt != "dense":
            raise _unsupported(method, "sparsity_config.format", fmt, "'dense'")
    schemes = set()
    for name, scheme in groups.items():
        where = f"config_groups.{name}"
        if not isinstance(scheme, Mapping):
            raise _unsupported(method, where, scheme, "a mapping")
        fmt = scheme.get("format") or qc.get("format")
        if fmt != "pack-quantized":
            raise _unsupported(method, f"{where}.format", fmt, "'pack-quantized'")
        if scheme.get("input_activations") is not None:
            raise _unsupported(method, f"{where}.input_activations",
                               scheme["input_activations"], "null (weight-only W4A16)")
        weights = scheme.get("weights")
        if not isinstance(weights, Mapping):
            raise _unsupported(method, f"{where}.weights", weights, "a mapping")
        _check_bits(method, f"{where}.weights.num_bits", weights.get("num_bits"))
        kind = weights.get("type", "int")
        if kind != "int":
            raise _unsupported(method, f"{where}.weights.type", kind, "'int'")
        if weights.get("dynamic", False):
            raise _unsupported(method, f"{where}.weights.dynamic", weights["dynamic"], "false")
        strategy = weights.get("strategy")
        if strategy == "group":
            group = _check_group(method, f"{where}.weights.group_size",
                                 weights.get("group_size"))
        elif strategy == "channel":
            group = -1
        else:
            raise _unsupported(method, f"{where}.weights.strategy", strategy,
                               "'group', 'channel'")
        actorder = weights.get("actorder")
        if actorder not in (None, False, "weight", "static"):
            raise ValueError(
                f"{method} quantization_config: {where}.weights.actorder = {actorder!r} "
                "(act-order with a g_idx) is not supported; supported: null, 'weight'")
        symmetric = weights.get("symmetric", True)
        if not isinstance(symmetric, bool):
            raise _unsupported(method, f"{where}.weights.symmetric", symmetric, "true, false")
        schemes.add((group, symmetric))
    if len(schemes) > 1:
        raise _unsupported(method, "config_groups", sorted(schemes),
                           "one (group_size, symmetric) for all groups")
    group, symmetric = schemes.pop()
    return Int4Config(method, group, symmetric=symmetric)


def int4_config(hf_config: Mapping[str, Any]) -> Int4Config | None:
    """The INT4 scheme of a Hugging Face config, from its ``quantization_config``.

    None when the config has no (or an empty) ``quantization_config``. Raises
    `ValueError`, naming the method, the field and the value, for anything this module
    cannot load exactly: other methods, bits other than 4, group sizes other than 32, 64,
    128 and -1, AWQ kernels other than GEMM, act-order GPTQ (``desc_act``), compressed-tensors
    schemes that are not weight-only pack-quantized int4.
    """
    qc = hf_config.get("quantization_config")
    if not qc:
        return None
    if not isinstance(qc, Mapping):
        raise ValueError(f"quantization_config must be a mapping, got {type(qc).__name__}")
    method = str(qc.get("quant_method", "")).lower().replace("_", "-")
    if method == "awq":
        return _awq_config(qc)
    if method == "gptq":
        return _gptq_config(qc)
    if method == "compressed-tensors":
        return _ct_config(qc)
    raise ValueError(f"quantization_config: quant_method = {qc.get('quant_method')!r} is not "
                     "supported (supported: 'awq', 'gptq', 'compressed-tensors')")


# ---------------------------------------------------------------- tensor names


def _parts(config: Int4Config) -> tuple[frozenset[str], frozenset[str]]:
    """The (required, optional) tensor suffixes of one linear in `config`'s format."""
    if config.method == "awq":
        return frozenset(("qweight", "qzeros", "scales")), frozenset()
    if config.method == "gptq":
        if config.symmetric:
            return frozenset(("qweight", "scales")), frozenset(("qzeros", "g_idx"))
        return frozenset(("qweight", "qzeros", "scales")), frozenset(("g_idx",))
    required = {"weight_packed", "weight_scale", "weight_shape"}
    optional = {"weight_g_idx"}
    (optional if config.symmetric else required).add("weight_zero_point")
    return frozenset(required), frozenset(optional)


def int4_linear_names(names: Iterable[str],
                      config: Int4Config | None = None) -> dict[str, dict[str, str]]:
    """Group checkpoint tensor names by the INT4 linear they belong to.

    Returns `{prefix: {suffix: name}}`, e.g. ``{"model.layers.0.mlp.up_proj": {"qweight":
    "model.layers.0.mlp.up_proj.qweight", "qzeros": ..., "scales": ...}}``, for every prefix
    that has a packed weight (``qweight`` for AWQ and GPTQ, ``weight_packed`` for
    compressed-tensors). With `config`, only that format's suffixes count; without, the
    format of each prefix follows from its packed weight. Names of other tensors are left
    out.
    """
    if config is None:
        known = frozenset(_GPTQ_PARTS + _CT_PARTS)
    else:
        required, optional = _parts(config)
        known = required | optional
    found: dict[str, dict[str, str]] = {}
    for name in names:
        prefix, _, suffix = name.rpartition(".")
        if prefix and suffix in known:
            found.setdefault(prefix, {})[suffix] = name
    linears = {}
    for prefix, parts in found.items():
        family = [suffixes for primary, suffixes in _PRIMARY.items() if primary in parts]
        if len(family) == 1:
            linears[prefix] = {s: n for s, n in parts.items() if s in family[0]}
    return linears


# ---------------------------------------------------------------- unpacking


def _int32(tensor: torch.Tensor, what: str) -> torch.Tensor:
    if tensor.dtype == torch.uint32:
        tensor = tensor.view(torch.int32)
    if tensor.dtype != torch.int32:
        raise ValueError(f"{what} must be int32, got {tensor.dtype}")
    if tensor.dim() != 2:
        raise ValueError(f"{what} must be 2-D, got shape {tuple(tensor.shape)}")
    return tensor


def _nibbles(packed: torch.Tensor, dim: int, order: tuple[int, ...] = _PLAIN_ORDER
             ) -> torch.Tensor:
    """The eight 4-bit fields of every int32 of the 2-D `packed`, as uint8, spread along
    `dim`: nibble i of a word lands at position `order[i]` of its run of eight."""
    rows, cols = packed.shape
    if dim == 1:
        out = torch.empty(rows, cols, 8, dtype=torch.uint8)
        for slot, position in enumerate(order):
            out[:, :, position] = (packed >> (4 * slot)) & 0xF
        return out.reshape(rows, cols * 8)
    out = torch.empty(rows, 8, cols, dtype=torch.uint8)
    for slot, position in enumerate(order):
        out[:, position, :] = (packed >> (4 * slot)) & 0xF
    return out.reshape(rows * 8, cols)


def _group_of(config: Int4Config, k: int, n_groups: int, what: str) -> int:
    """The `Int4Weight` group for `k` inputs, checked against the `n_groups` stored."""
    group = k if config.group_size == -1 else config.group_size
    if k % group or k // group != n_groups:
        raise ValueError(f"{what}: {n_groups} groups do not match K = {k} with group_size "
                         f"{config.group_size}")
    return group


def _check_g_idx(g_idx: torch.Tensor, k: int, group: int) -> None:
    """Accept a g_idx only when it is the plain grouping `input // group` (no act-order)."""
    expected = torch.arange(k) // group
    if g_idx.shape != (k,) or not torch.equal(g_idx.to(torch.int64), expected):
        raise ValueError(
            "g_idx is not the plain grouping of consecutive inputs (act-order / desc_act "
            "checkpoint); such checkpoints are not supported")


def _need(tensors: Mapping[str, torch.Tensor], *names: str) -> None:
    missing = [n for n in names if n not in tensors]
    if missing:
        raise ValueError(f"missing tensors: {', '.join(missing)}")


def _unpack_awq(config: Int4Config, tensors: Mapping[str, torch.Tensor]) -> Int4Weight:
    _need(tensors, "qweight", "qzeros", "scales")
    qweight = _int32(tensors["qweight"], "awq qweight")
    qzeros = _int32(tensors["qzeros"], "awq qzeros")
    scales = tensors["scales"]
    k, n = qweight.shape[0], qweight.shape[1] * 8
    group = _group_of(config, k, scales.shape[0], "awq scales")
    if tuple(scales.shape) != (k // group, n) or tuple(qzeros.shape) != (k // group, n // 8):
        raise ValueError(f"awq shapes do not agree: qweight {tuple(qweight.shape)}, qzeros "
                         f"{tuple(qzeros.shape)}, scales {tuple(scales.shape)}")
    q = _nibbles(qweight, 1, AWQ_PACK_ORDER).t().contiguous()
    zero = _nibbles(qzeros, 1, AWQ_PACK_ORDER).t().float().contiguous()
    return Int4Weight(q, scales.t().float().contiguous(), zero, group)


def _unpack_gptq(config: Int4Config, tensors: Mapping[str, torch.Tensor]) -> Int4Weight:
    _need(tensors, "qweight", "scales")
    qweight = _int32(tensors["qweight"], "gptq qweight")
    scales = tensors["scales"]
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    group = _group_of(config, k, scales.shape[0], "gptq scales")
    if tuple(scales.shape) != (k // group, n):
        raise ValueError(f"gptq shapes do not agree: qweight {tuple(qweight.shape)}, scales "
                         f"{tuple(scales.shape)}")
    if "g_idx" in tensors:
        _check_g_idx(tensors["g_idx"], k, group)
    q = _nibbles(qweight, 0).t().contiguous()
    if config.symmetric:
        zero = torch.full((n, k // group), 8.0)
    else:
        _need(tensors, "qzeros")
        qzeros = _int32(tensors["qzeros"], "gptq qzeros")
        if tuple(qzeros.shape) != (k // group, -(-n // 8)):
            raise ValueError(f"gptq qzeros shape {tuple(qzeros.shape)} does not match "
                             f"{k // group} groups of {n} outputs")
        zero = _nibbles(qzeros, 1)[:, :n].t().float()
        if config.checkpoint_format != "gptq_v2":
            zero += 1  # stored minus one in the original format
        zero = zero.contiguous()
    return Int4Weight(q, scales.t().float().contiguous(), zero, group)


def _unpack_ct(config: Int4Config, tensors: Mapping[str, torch.Tensor]) -> Int4Weight:
    _need(tensors, "weight_packed", "weight_scale")
    packed = _int32(tensors["weight_packed"], "weight_packed")
    scale = tensors["weight_scale"]
    if "weight_shape" in tensors:
        n, k = (int(v) for v in tensors["weight_shape"].reshape(-1).tolist())
    else:
        n, k = packed.shape[0], packed.shape[1] * 8
    if packed.shape != (n, -(-k // 8)):
        raise ValueError(f"weight_packed shape {tuple(packed.shape)} does not match "
                         f"weight_shape {(n, k)}")
    group = _group_of(config, k, scale.shape[-1], "weight_scale")
    if tuple(scale.shape) != (n, k // group):
        raise ValueError(f"weight_scale shape {tuple(scale.shape)} does not match "
                         f"{(n, k // group)}")
    if "weight_g_idx" in tensors:
        _check_g_idx(tensors["weight_g_idx"], k, group)
    q = _nibbles(packed, 1)[:, :k].contiguous()
    if config.symmetric:
        zero = torch.full((n, k // group), 8.0)
    else:
        _need(tensors, "weight_zero_point")
        zp = tensors["weight_zero_point"]
        if zp.dtype == torch.int8 and tuple(zp.shape) == (n, k // group):
            zero = zp.float() + 8  # an unpacked signed zero point
        else:
            zp = _int32(zp, "weight_zero_point")
            if tuple(zp.shape) != (-(-n // 8), k // group):
                raise ValueError(f"weight_zero_point shape {tuple(zp.shape)} does not match "
                                 f"{n} outputs in {k // group} groups")
            zero = _nibbles(zp, 0)[:n].float().contiguous()
    return Int4Weight(q, scale.float().contiguous(), zero, group)


def unpack_int4(config: Int4Config, tensors: Mapping[str, torch.Tensor]) -> Int4Weight:
    """Unpack the checkpoint tensors of one linear, keyed by suffix (``qweight``,
    ``qzeros``, ``scales``, ``g_idx`` for AWQ and GPTQ; ``weight_packed``,
    ``weight_scale``, ``weight_shape``, ``weight_zero_point``, ``weight_g_idx`` for
    compressed-tensors), into an `Int4Weight` of shape `[N, K]`. Exact: `q` and `zero` are
    the stored integers (GPTQ zero points corrected as the checkpoint format says), `scale`
    the stored scales widened to float32. A ``g_idx`` must be the plain grouping."""
    if config.method == "awq":
        return _unpack_awq(config, tensors)
    if config.method == "gptq":
        return _unpack_gptq(config, tensors)
    if config.method == "compressed-tensors":
        return _unpack_ct(config, tensors)
    raise ValueError(f"unknown INT4 method {config.method!r}")


def iter_int4_weights(named_tensors: Iterable[tuple[str, torch.Tensor]],
                      config: Int4Config | None
                      ) -> Iterator[tuple[str, torch.Tensor | Int4Weight]]:
    """Pass ordinary tensors through; gather each INT4 linear's tensors, in whatever order
    they come, and yield it once as ``(PREFIX + ".weight", Int4Weight)`` as soon as all its
    required parts have been seen. An optional part (a ``g_idx``, a symmetric GPTQ
    ``qzeros``) seen after that is checked (``g_idx``) or dropped. Raises `ValueError`
    naming the linear when a part comes twice, when its tensors do not unpack, and, at the
    end, when a linear is still missing parts. With `config` None everything passes through.
    """
    if config is None:
        yield from named_tensors
        return
    required, optional = _parts(config)
    parts_of_a_linear = required | optional
    pending: dict[str, dict[str, torch.Tensor]] = {}
    done: dict[str, tuple[int, int]] = {}  # prefix -> (K, group) of the linears yielded
    for name, tensor in named_tensors:
        prefix, _, suffix = name.rpartition(".")
        if not prefix or suffix not in parts_of_a_linear:
            yield name, tensor
            continue
        if prefix in done:
            if suffix in required:
                raise ValueError(f"INT4 linear {prefix}: {suffix} appears twice")
            if suffix.endswith("g_idx"):
                try:
                    _check_g_idx(tensor, *done[prefix])
                except ValueError as e:
                    raise ValueError(f"INT4 linear {prefix}: {e}") from None
            continue
        parts = pending.setdefault(prefix, {})
        if suffix in parts:
            raise ValueError(f"INT4 linear {prefix}: {suffix} appears twice")
        parts[suffix] = tensor
        if required <= parts.keys():
            del pending[prefix]
            try:
                weight = unpack_int4(config, parts)
            except ValueError as e:
                raise ValueError(f"INT4 linear {prefix}: {e}") from None
            done[prefix] = (weight.q.shape[1], weight.group)
            yield prefix + ".weight", weight
    if pending:
        missing = "; ".join(f"{prefix} lacks {', '.join(sorted(required - parts.keys()))}"
                            for prefix, parts in pending.items())
        raise ValueError(f"{config.method} checkpoint has incomplete INT4 linears: {missing}")
