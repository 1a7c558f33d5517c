"""The marker of linear layers whose weight the load-time passes may repack or quantize."""

from __future__ import annotations

import torch


class PackableLinear:
    """Marker base of the modules whose weight is a linear map that
    ``layers.cpu_linear.prepare_linear_weights`` (or, on a GPU,
    ``layers.gpu_quant.prepare_gpu_quantized``) may repack or quantize: the parallel
    linear layers, the LM head."""

    weight: torch.Tensor
