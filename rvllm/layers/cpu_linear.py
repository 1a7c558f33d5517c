"""Fast paths for linear layers on the CPU, each held to the plain ``F.linear`` it replaces.

After loading, :func:`prepare_linear_weights` swaps each linear weight for one of:

- ``onednn``: the float32 weight repacked in oneDNN's blocked layout. MKL's sgemm, which
  ``F.linear`` calls, is slow on this class of CPU for the skinny shapes of decode (a few
  rows against a large weight); oneDNN's packed GEMM reads the weight 1.3-3x faster at 1
  to 32 rows and runs near the FLOP peak for prefill. Same numbers, other summation order.
- ``fp16`` (``--quantization fp16``): the weight stored in float16 and packed for fbgemm,
  which widens it to float32 inside the GEMM: weight-only, half the bytes, 1.5-2.3x
  faster than float32 at 1 to 32 rows, and perplexity equal to float32's.
- ``int8`` (``--quantization int8``): the weight quantized to int8 per output row
  (symmetric, scale = max|w| / 127) and packed for fbgemm. fbgemm's dynamic int8 GEMM
  quantizes its whole input with one scale and zero point (7-bit, ``reduce_range``, so
  AVX2's 16-bit pair sums cannot saturate); each row is first divided by its largest
  magnitude, which makes that per token. A quarter of the weight bytes: 2.5-3x faster
  than float32, at a cost in accuracy (perplexity, ``rvllm bench perplexity``).

The plain weight is released afterwards unless something else still reads it: a tied
embedding (``keeps_weight``), or a module that opts out with ``packable = False``.

With the numba kernels (``--kernel-backend``, the CPU's default in float32), the
``onednn`` and ``int8`` forms keep the weight in panels of 16 rows instead (float32, or
int8 with its scales; ``kernels.cpu.gemv``): one-row inputs go through a GEMV that reads
them at the memory's bandwidth (a one-sequence decode step 1.2-1.4x faster than oneDNN's
packed GEMM), and more rows through GEMMs over the same panels (``kernels.cpu.f32_gemm``,
``kernels.cpu.int8_gemm``), faster than oneDNN's and fbgemm's on this class of CPU. So
no oneDNN or fbgemm copy is made (but for int8 weights of an odd input width): one copy
of the weights in memory. The int8 GEMV widens the weight to float32 and leaves the
activations unquantized: ``F.linear(x, q * scale)``. When the work is deferred (a
server's start) the float32 panels are made in the weight's own memory where they fill
it, so loading touches one copy of the weights, not two; moving them into huge pages is
what is left for idle time.
"""

from __future__ import annotations

import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from rvllm.layers.packable import PackableLinear

CPU_LINEAR_BACKENDS = ("auto", "onednn", "torch")
QUANTIZATIONS = ("int8", "fp16", "gguf", "int4", "awq", "gptq", "compressed-tensors")
# Those whose weights are kept in ``kernels.cpu.packed``'s panels (``linear_kind``
# "packed"): a GGUF file's blocks, an int4 checkpoint's groups, or int4 made at load.
PACKED_QUANTIZATIONS = ("gguf", "int4", "awq", "gptq", "compressed-tensors")
# What packed weights multiply (--packed-activations): x rounded per block of 32 to 16
# bits or to 8 (``kernels.cpu.packed.set_x_bits``), by name.
PACKED_ACTIVATIONS = {"int16": 16, "int8": 8}
# Steps of more rows than this pack a layer whose oneDNN reorder is pending (under load,
# ``LLMEngine.step``, ``--kernel-backend torch`` only: the numba kernels need no oneDNN
# copy); fewer leave it to idle time, so a short first request does not wait for it.
PENDING_GEMM_MAX_ROWS = 32


def onednn_available() -> bool:
    """Whether this torch build has oneDNN's packed-weight linear (CPU builds usually do)."""
    return bool(torch.backends.mkldnn.is_available()
                and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def int8_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines or \
        "x86" in torch.backends.quantized.supported_engines


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-row symmetric int8: (q [N, K] int8, scale [N] float32)."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-10)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def int8_linear_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor
                          ) -> torch.Tensor:
    """What fbgemm's int8 path computes (without numba's panels, or with an odd input
    width), in plain torch: each row of x divided by its largest magnitude, the whole
    batch then quantized to 7-bit unsigned integers with one scale and zero point (the
    range always includes 0), times the int8 weight, rows scaled back. With the panels,
    inputs of more than one row go through ``kernels.cpu.int8_gemm`` instead, within
    1e-4 of ``F.linear`` on the dequantized weight."""
    s = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-10)
    xn = x / s
    lo, hi = xn.min().clamp(max=0.0), xn.max().clamp(min=0.0)
    sx = ((hi - lo) / 127.0).clamp(min=1e-10)
    zp = torch.round(-lo / sx).clamp(0, 127)
    xq = torch.round(xn / sx + zp).clamp(0, 127)
    return F.linear((xq - zp) * sx, q.float() * scale[:, None]) * s


def _int8_tensor(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A per-row int8 weight as the quantized tensor fbgemm's prepack takes. torch 2.13
    marks quantized tensors deprecated and warns here; the prepack still needs one, so
    the warning is silenced (on this thread: ``catch_warnings`` is not thread-safe, and
    the prepacks run on others)."""
    zeros = torch.zeros(q.shape[0], dtype=torch.long)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch._make_per_channel_quantized_tensor(q, scale.double(), zeros, 0)


def apply_linear(module: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """x W^T (+ bias) through whichever form :func:`prepare_linear_weights` left."""
    kind = getattr(module, "linear_kind", None)
    if kind is None:
        return F.linear(x, module.weight, bias)
    if kind in ("w4a16", "fp8"):  # a GPU's quantized weights (``layers.gpu_quant``)
        from rvllm.layers.gpu_quant import gpu_quant_linear

        y = gpu_quant_linear(module, x.reshape(-1, x.shape[-1]), bias)
        return y.view(*x.shape[:-1], y.shape[-1])
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    panels = getattr(module, "panel_weight", None)
    if x2.shape[0] == 1 and panels is not None:
        from rvllm.kernels.cpu.gemv import gemv

        y = gemv(x2, panels)
    elif kind == "packed":
        from rvllm.kernels.cpu.f32_gemm import panels_matmul

        y = panels_matmul(x2, panels)
    elif kind == "int8" and panels is not None and module.packed_weight is None:
        # prepare_linear_weights made no fbgemm copy: the panels take every input.
        from rvllm.kernels.cpu.int8_gemm import int8_matmul

        y = int8_matmul(x2, panels)
    elif kind == "onednn" and panels is not None:
        from rvllm.kernels.cpu.f32_gemm import float32_matmul

        y = float32_matmul(x2, panels)
    elif kind == "onednn":
        if module.packed_weight is None:  # its reorder is still pending
            y = F.linear(x2, module.weight)
        else:
            y = torch.ops.mkldnn._linear_pointwise(x2, module.packed_weight, bias, "none", [],
                                                   "")
            return y.view(*lead, y.shape[-1])
    elif kind == "fp16":
        y = torch.ops.quantized.linear_dynamic_fp16(x2, module.packed_weight)
    elif x2.shape[0] == 1:
        # One row: fbgemm's per-input scale is already per token.
        y = torch.ops.quantized.linear_dynamic(x2, module.packed_weight, True)
    else:
        # fbgemm quantizes the whole input with one scale; dividing each row by its own
        # largest magnitude first (and multiplying the output back) makes that per token.
        s = x2.abs().amax(dim=1, keepdim=True).clamp(min=1e-10)
        y = torch.ops.quantized.linear_dynamic(x2 / s, module.packed_weight, True).mul_(s)
    if bias is not None:
        y = y + bias
    return y.view(*lead, y.shape[-1])



def matmul_unbiased(module: nn.Module, x: torch.Tensor, threads: int) -> torch.Tensor:
    """x W^T through the module's panels where it has them (float32 or int8 GEMMs over
    them), else its packed weight, with no bias and no int8 scaling (the CPU batch step's
    kernels around it apply those, ``kernels.cpu.batch_step``). ``threads``: numba's
    thread count."""
    panels = getattr(module, "panel_weight", None)
    if module.linear_kind == "packed":
        from rvllm.kernels.cpu.f32_gemm import panels_matmul

        return panels_matmul(x, panels)
    if module.linear_kind == "int8":
        if module.packed_weight is None:
            from rvllm.kernels.cpu.int8_gemm import matmul_into

            out = torch.empty(x.shape[0], panels.rows)
            matmul_into(x.numpy(), panels.weight, panels.scale, out.numpy(), threads)
            return out
        return torch.ops.quantized.linear_dynamic(x, module.packed_weight, True)
    if panels is not None:
        from rvllm.kernels.cpu.f32_gemm import matmul_into

        out = torch.empty(x.shape[0], panels.rows)
        matmul_into(x.numpy(), panels.weight, out.numpy(), threads)
        return out
    if module.packed_weight is None:  # its oneDNN reorder is still pending
        return F.linear(x, module.weight)
    return torch.ops.mkldnn._linear_pointwise(x, module.packed_weight, None, "none", [], "")

class _Packing:
    """Weights being packed on threads of their own; ``wait`` gives each module its
    packed weight (and raises what a pack raised)."""

    def __init__(self, packs: list[tuple[nn.Module, partial]], workers: int) -> None:
        pool = ThreadPoolExecutor(workers, thread_name_prefix="rvllm-pack")
        self._jobs = [(m, pool.submit(pack)) for m, pack in packs]
        pool.shutdown(wait=False)  # its threads end when the last pack is done

    def wait(self) -> None:
        for m, job in self._jobs:
            m.packed_weight = job.result()
        self._jobs = []


def prepare_linear_weights(model: nn.Module, backend: str = "auto",
                           quantization: str | None = None, wait: bool = True,
                           defer_reorders: bool = False) -> str:
    """Repack (or quantize) every eligible linear weight; returns the path that runs, for
    the logs: "onednn", "int8" or "torch".

    fbgemm's packing (fp16, int8) runs on threads outside the GIL. With ``wait=False``
    it goes on after this returns, so the caller's other start-up work overlaps it, and
    :func:`finish_linear_weights` must be called before the model's first forward (until
    then a layer has no packed weight: a forward that needs one fails, it does not
    compute anything else).

    With ``defer_reorders`` the float32 layers' slow work is left for later:
    :func:`reorder_pending` does it a few layers at a time, when the caller has nothing
    else to do (a server between requests). With the numba kernels that is moving the
    panels made in the weights' memory into huge pages (``_reorder``; they compute the
    same before and after). Without them it is oneDNN's reorders, which hold the GIL and
    touch fresh memory (0.25-0.5 s of a server's start for SmolLM2); until its turn a
    layer computes with its plain weight (``F.linear``: the same numbers up to summation
    order, 1.3-1.7x slower at 9-32 rows on this class of CPU, as fast at 128 and
    more)."""
    if backend not in CPU_LINEAR_BACKENDS:
        raise ValueError(f"cpu linear backend must be one of {CPU_LINEAR_BACKENDS}, "
                         f"got {backend!r}")
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    packed = None
    if quantization in PACKED_QUANTIZATIONS:
        packed = pack_quantized(model, quantization)
        quantization = None  # the layers left over: float32, as without quantization
    else:
        unpack_leftovers(model)
    targets = [m for m in model.modules()
               if isinstance(m, PackableLinear) and getattr(m, "packable", True)
               and getattr(m, "linear_kind", None) != "packed"]
    on_cpu = [m for m in targets if m.weight.device.type == "cpu"]
    if quantization is not None:
        if len(on_cpu) != len(targets):
            raise ValueError(f"--quantization {quantization} is a CPU path (fbgemm); on a "
                             "GPU run without it")
        if any(m.weight.dtype != torch.float32 for m in on_cpu):
            raise ValueError(f"--quantization {quantization} computes in float32 on the CPU; "
                             "run it with --dtype float32 (the CPU default)")
        if not int8_available():
            raise RuntimeError(f"--quantization {quantization} needs torch's fbgemm "
                               "quantized engine, which this torch build lacks")
        kind = quantization
    elif backend == "torch":
        return packed or "torch"
    else:
        on_cpu = [m for m in on_cpu if m.weight.dtype == torch.float32]
        if not onednn_available():
            if backend == "onednn":
                raise RuntimeError("--cpu-linear-backend onednn: this torch build has no "
                                   "oneDNN (torch.backends.mkldnn); use "
                                   "--cpu-linear-backend torch")
            return packed or "torch"
        if not on_cpu:
            return packed or "torch"
        kind = "onednn"
    from rvllm.layers.backend import use_numba

    # The numba kernels read the weight's panels for inputs of any rows (the one-row
    # GEMV, twice as fast as the packed GEMMs at one row, and GEMMs past one).
    keep_rows = use_numba() and kind in ("onednn", "int8")
    quantize = quantize_int8
    if keep_rows:
        from rvllm.kernels.cpu.gemv import PANEL, panels, panels_in_place
        from rvllm.kernels.cpu.quantize import quantize_int8 as quantize  # bit-identical
    packs = []  # (module, the fbgemm call that packs its weight), run below
    deferred = []  # modules whose reorder (_reorder) waits for reorder_pending
    for m in on_cpu:
        w = m.weight.detach()
        if kind == "onednn":
            m.linear_kind = kind
            if keep_rows:
                # Every input reads the panels (the GEMV, kernels.cpu.f32_gemm): a oneDNN
                # copy would go unread, and double the weights' memory.
                m.packed_weight = None
                in_place = _panels_may_take_rows(m, PANEL)
                if in_place:
                    # Made in the weight's own 4 KiB pages, and moved into huge pages
                    # (_reorder) now or, deferred, when the caller has time.
                    m.panel_weight = panels_in_place(w)
                    if getattr(m, "keeps_weight", False):
                        # A tied LM head: its embedding reads its rows from the panels
                        # (layers.embedding), and no 113 MB copy is made (SmolLM2).
                        m.weight.row_panels = m.panel_weight
                    if defer_reorders:
                        deferred.append(m)
                    else:
                        _reorder(m)
                else:
                    m.panel_weight = panels(w)
                if in_place or not getattr(m, "keeps_weight", False):
                    m.weight.data = torch.empty(0, dtype=m.weight.dtype)
            elif defer_reorders:
                m.packed_weight = None  # apply_linear uses the plain weight meanwhile
                deferred.append(m)
            else:
                # oneDNN's reorder holds the GIL: on another thread it would only take
                # turns with this one, so it runs here.
                _reorder(m)
            continue
        if kind == "fp16":
            packs.append((m, partial(torch.ops.quantized.linear_prepack_fp16, w.float(), None)))
        else:
            q, scale = quantize(w)
            if keep_rows:
                m.panel_weight = panels(q, scale)
            if keep_rows and q.shape[1] % 2 == 0:
                # Inputs of any rows read the panels (the GEMV, kernels.cpu.int8_gemm):
                # fbgemm's copy would go unread.
                m.packed_weight = None
            else:
                packs.append((m, partial(torch.ops.quantized.linear_prepack,
                                         _int8_tensor(q, scale), None)))
        m.linear_kind = kind
        if not getattr(m, "keeps_weight", False):
            # Nothing reads the plain copy any more (a pending pack holds its own
            # reference until it is done): give its memory back.
            m.weight.data = torch.empty(0, dtype=m.weight.dtype)
    if deferred:
        model.pending_reorders = deferred
    if packs:
        # fbgemm packs a weight on one thread, outside the GIL: a thread per core takes
        # the int8 packing of SmolLM2's weights from 0.6-1.05 s to 0.4-0.55 s.
        packing = _Packing(packs, max(1, torch.get_num_threads()))
        if wait:
            packing.wait()
        else:
            model.pending_packing = packing
    return packed or kind


def _pack_parts(weight: torch.Tensor):  # noqa: ANN202 - kernels.cpu.panels.Panels | None
    """The packed panels of a weight whose rows all came as GGUF blocks
    (``packed_parts``, noted by ``models.base.load_params``), or None where they do not
    cover it or a part starts inside a panel of 16 rows."""
    from rvllm.kernels.cpu.packed import pack_rows

    parts = sorted(getattr(weight, "packed_parts", None) or [], key=lambda p: p[0])
    first = 0
    for offset, rows in parts:
        if offset != first or (first % 16 and rows.rows):
            return None
        first += rows.rows
    if not parts or first != weight.shape[0]:
        return None
    return pack_rows([rows for _, rows in parts], weight.shape[0])


def pack_quantized(model: nn.Module, quantization: str) -> str | None:
    """Every linear layer and embedding whose weight came as blocks (a GGUF file's, or
    an int4 checkpoint's groups made into Q4_1 blocks; ``packed_parts``) keeps them
    packed (``kernels.cpu.packed``; the layer's ``linear_kind`` "packed"); with
    ``int4`` every float32 linear weight but the LM head's is quantized to 4 bits at
    load, groups of 32 round-to-nearest (``layers.int4.quantize_int4_rtn``), in Q4_1
    blocks. An embedding reads its rows from them, dequantized. Returns "packed", or
    None where nothing was; what could not be is decoded to float32
    (``unpack_leftovers``)."""
    done = False
    for m in model.modules():
        if not (isinstance(m, PackableLinear) and getattr(m, "packable", True)):
            continue
        w = m.weight
        if w.device.type != "cpu":
            continue
        if quantization == "int4":  # the layers, not the vocabulary's rows (as vLLM)
            panels = (_int4_panels(w) if w.dtype == torch.float32 and w.numel()
                      and not hasattr(m, "num_embeddings") else None)
        else:
            panels = _pack_parts(w)
        if panels is None:
            continue
        m.panel_weight, m.packed_weight, m.linear_kind = panels, None, "packed"
        if getattr(m, "keeps_weight", False):
            w.row_panels = panels  # a tied embedding reads its rows from them
        w.__dict__.pop("packed_parts", None)
        w.data = torch.empty(0, dtype=w.dtype)
        done = True
    for m in model.modules():  # embeddings (a vocabulary's rows) not tied to an LM head
        w = getattr(m, "weight", None)
        if (hasattr(m, "num_embeddings") and not isinstance(m, PackableLinear)
                and w is not None and not hasattr(w, "row_panels")):
            panels = _pack_parts(w)
            if panels is not None:
                w.row_panels = panels
                w.__dict__.pop("packed_parts", None)
                w.data = torch.empty(0, dtype=w.dtype)
    unpack_leftovers(model)
    return "packed" if done else None


def set_packed_activations(model: nn.Module, activations: str) -> None:
    """Have every packed linear weight multiply x rounded to ``activations``
    (``PACKED_ACTIVATIONS``: int16 or int8) per block of 32."""
    from rvllm.kernels.cpu.packed import set_x_bits

    for m in model.modules():
        if getattr(m, "linear_kind", None) == "packed":
            set_x_bits(m.panel_weight.weight, PACKED_ACTIVATIONS[activations])


def _int4_panels(weight: torch.Tensor):  # noqa: ANN202 - kernels.cpu.panels.Panels | None
    """A float32 weight quantized to int4 (groups of 32) and packed, or None where its
    width is not whole groups."""
    from rvllm.kernels.cpu.packed import int4_rows, pack_rows
    from rvllm.layers.int4 import quantize_int4_rtn

    if weight.shape[1] % 32:
        return None
    q = quantize_int4_rtn(weight.detach(), 32)
    return pack_rows([int4_rows(q.q, q.scale, q.zero)], weight.shape[0])


def unpack_leftovers(model: nn.Module) -> None:
    """Decode into their float32 weights the blocks no layer kept packed (each part
    packed on its own and widened: bit-identical to ``models.dequant``)."""
    from rvllm.kernels.cpu.packed import dequantize_panels, pack_rows

    for p in model.parameters():
        parts = p.__dict__.pop("packed_parts", None)
        for offset, rows in parts or []:
            panels = pack_rows([rows], rows.rows)
            p.data[offset:offset + rows.rows] = dequantize_panels(panels.weight, rows.rows,
                                                                  rows.cols)


def _panels_may_take_rows(m: nn.Module, panel: int) -> bool:
    """Whether ``m``'s panels can be made in its weight's memory: nothing else reads the
    rows, or only the embedding of one rank (which can read them from the panels), and
    the panels fill it exactly."""
    w = m.weight
    shared = getattr(m, "keeps_weight", False)
    return ((not shared or getattr(m, "tp_size", None) == 1) and w.is_contiguous()
            and w.shape[0] % panel == 0 and w.untyped_storage().nbytes() == w.nbytes)


def _reorder(m: nn.Module) -> None:
    """The work ``defer_reorders`` left for ``m``: move the panels made in its weight's
    memory into huge pages (the one-row GEMV streams through them faster in 2 MiB pages;
    the weight's pages were 4 KiB ones, as huge ones made the load 0.5 s slower here);
    without panels, pack its float32 weight for oneDNN and let the plain copy go (unless
    something else reads it)."""
    panels = getattr(m, "panel_weight", None)
    if panels is not None:
        from rvllm.host_memory import collapse_huge_pages

        collapse_huge_pages(panels.weight)
        return
    m.packed_weight = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), None)
    if not getattr(m, "keeps_weight", False):
        m.weight.data = torch.empty(0, dtype=m.weight.dtype)


def has_pending_reorders(model: nn.Module) -> bool:
    """Whether ``prepare_linear_weights(..., defer_reorders=True)`` left reorders to do."""
    return "pending_reorders" in model.__dict__


def reorder_pending(model: nn.Module, limit: int | None = None,
                    seconds: float | None = None, gemms_only: bool = False) -> bool:
    """Do the work ``prepare_linear_weights(..., defer_reorders=True)`` left (``_reorder``):
    at most ``limit`` layers, and no more once ``seconds`` have passed (at least one
    either way); all of them when neither is given. With ``gemms_only``, nothing unless
    the work makes a layer's GEMMs faster (oneDNN's packing, not the panels' huge
    pages). Returns whether any are left."""
    pending = model.__dict__.get("pending_reorders")
    if not pending:
        return False
    if gemms_only and getattr(pending[-1], "panel_weight", None) is not None:
        return True
    start, done = time.perf_counter(), 0
    while pending:
        _reorder(pending.pop())
        done += 1
        if (limit is not None and done >= limit) or (
                seconds is not None and time.perf_counter() - start >= seconds):
            break
    if not pending:
        del model.pending_reorders
    return bool(pending)


def finish_linear_weights(model: nn.Module) -> None:
    """Wait for the packing ``prepare_linear_weights(..., wait=False)`` left running."""
    packing = model.__dict__.pop("pending_packing", None)
    if packing is not None:
        packing.wait()
