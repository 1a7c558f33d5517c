"""Weight-only quantized linear layers on the GPU (``--quantization int4|fp8`` on CUDA).

:func:`prepare_gpu_quantized` replaces, after loading, the weight of each linear module
(``cpu_linear.PackableLinear``: the parallel linear layers; not the LM head, which keeps
its precision as in vLLM's int4 and FP8 schemes) by a packed form the Triton kernels
read, and frees the plain weight (an empty tensor on the same device stays in its
place); :func:`gpu_quant_linear` computes such a module's x W^T + bias.

- ``int4`` (``linear_kind = "w4a16"``): 4-bit weights with a scale and zero per group of
  inputs (``kernels.triton.w4a16``), a quarter of bfloat16's bytes (plus 1/16 for the
  scales and zeros at group 128). An int4 checkpoint's weights (``int4_weights``: the
  module's name in ``model.named_modules()`` -> an ``Int4Weight`` of
  ``models.int4_checkpoint``, or anything with its ``q``, ``scale``, ``zero`` and
  ``group``) are packed as they are; other modules are quantized here, round to nearest
  with min-max scales per group of 128 (``layers.int4.quantize_int4_rtn``;
  64 or 32 where 128 does not divide the inputs).
- ``fp8`` (``linear_kind = "fp8"``): float8 E4M3 weights with a scale per output row
  (``kernels.triton.fp8_linear``), half of bfloat16's bytes; the activations stay in the
  model's dtype (W8A16).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from rvllm.layers.packable import PackableLinear

logger = logging.getLogger("rvllm")

GPU_QUANTIZATIONS = ("int4", "fp8")
INT4_GROUP = 128


def int4_group_for(in_features: int, group: int = INT4_GROUP) -> int | None:
    """``group`` if it divides the inputs, else the largest smaller group size of
    ``layers.int4`` (64, 32) that does; None if none does (the module then
    stays unquantized)."""
    from rvllm.layers.int4 import SUPPORTED_GROUP_SIZES

    for g in sorted({group, *SUPPORTED_GROUP_SIZES}, reverse=True):
        if g <= group and in_features % g == 0:
            return g
    return None


def _on_gpu(w: torch.Tensor) -> bool:
    """CUDA weights; CPU ones too under Triton's interpreter (tests)."""
    from rvllm.layers.backend import triton_interpreted

    return w.device.type == "cuda" or (triton_interpreted() and w.device.type == "cpu")


def prepare_gpu_quantized(model: nn.Module, quantization: str,
                          int4_weights: dict[str, object] | None = None,
                          group: int = INT4_GROUP) -> int:
    """Quantize and pack every eligible linear weight of ``model`` (module docstring) for
    ``quantization`` "int4" or "fp8"; returns how many modules were converted.

    Eligible: ``PackableLinear`` modules (not opted out with ``packable = False``), LM
    heads excepted unless ``int4_weights`` names one, whose weight is on a CUDA device.
    Raises ValueError when there is none (a CPU model)."""
    if quantization not in GPU_QUANTIZATIONS:
        raise ValueError(f"GPU quantization must be one of {GPU_QUANTIZATIONS}, "
                         f"got {quantization!r}.")
    given = dict(int4_weights or {})
    if given and quantization != "int4":
        raise ValueError(f"int4 weights given to --quantization {quantization}.")
    targets = [(name, m) for name, m in model.named_modules()
               if isinstance(m, PackableLinear) and getattr(m, "packable", True)
               # an LM head (a vocabulary's rows) only when its int4 weight is given
               and (not hasattr(m, "num_embeddings") or name in given)
               and _on_gpu(m.weight)]
    if not targets:
        raise ValueError(f"--quantization {quantization} on the GPU found no linear layer on "
                         "a CUDA device to quantize.")
    converted = 0
    for name, m in targets:
        w = m.weight
        if quantization == "fp8":
            from rvllm.kernels.triton.fp8_linear import quantize_fp8_weight

            m.fp8_weight, m.fp8_scale = quantize_fp8_weight(w.detach())
            m.linear_kind = "fp8"
        else:
            packed = _pack_int4(name, m, given.pop(name, None), group)
            if packed is None:
                continue
            m.w4a16_weight = packed
            m.linear_kind = "w4a16"
        if not getattr(m, "keeps_weight", False):
            m.weight.data = torch.empty(0, dtype=w.dtype, device=w.device)
        converted += 1
    if given:
        raise ValueError(f"int4 weights given for modules that are not quantizable linear "
                         f"layers on the GPU: {', '.join(sorted(given))}.")
    return converted


def _pack_int4(name: str, m: nn.Module, given: object | None, group: int):  # noqa: ANN202
    """m's packed int4 weight (w4a16.W4A16Weight): from ``given`` (an Int4Weight), else
    round to nearest from its weight; None where its inputs fit no group."""
    from rvllm.kernels.triton.w4a16 import pack_w4a16
    from rvllm.layers.int4 import quantize_int4_rtn

    w = m.weight
    if given is not None:
        dev = w.device
        return pack_w4a16(given.q.to(dev), given.scale.to(dev), given.zero.to(dev),
                          given.group)
    if w.numel() == 0:
        raise ValueError(f"{name}: no weight to quantize and no int4 weight given for it.")
    g = int4_group_for(w.shape[1], group)
    if g is None:
        logger.warning("%s: %d inputs fit no int4 group; it stays in %s", name, w.shape[1],
                       w.dtype)
        return None
    rtn = quantize_int4_rtn(w.detach(), g)
    return pack_w4a16(rtn.q, rtn.scale, rtn.zero, g)


def gpu_quant_linear(module: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """x W^T (+ bias) for a module :func:`prepare_gpu_quantized` converted, in x's dtype."""
    kind = module.linear_kind
    if kind == "w4a16":
        from rvllm.kernels.triton.w4a16 import w4a16_linear

        return w4a16_linear(x, module.w4a16_weight, bias)
    if kind == "fp8":
        from rvllm.kernels.triton.fp8_linear import fp8_linear

        return fp8_linear(x, module.fp8_weight, module.fp8_scale, bias)
    raise ValueError(f"gpu_quant_linear: linear_kind {kind!r} is not a GPU quantized form.")
