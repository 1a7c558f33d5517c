"""Linear layers that know about tensor parallelism (tp_size=1 is the plain case).

Column-parallel layers split the output features across ranks; row-parallel
layers split the input features and sum the partial results. Each parameter
carries a ``weight_loader`` that takes the full checkpoint tensor and keeps
this rank's shard.
"""

from __future__ import annotations

import torch
from torch import nn

from rvllm.distributed import all_gather_last_dim, all_reduce, get_tp_rank, get_tp_size
from rvllm.layers.cpu_linear import PackableLinear, apply_linear
from rvllm.lora.layers import LoRASlice, apply_lora


def _divide(a: int, b: int) -> int:
    if a % b:
        raise ValueError(f"{a} is not divisible by the tensor-parallel size {b}.")
    return a // b


class ColumnParallelLinear(nn.Module, PackableLinear):
    """y = x W^T + b with W's rows (output features) split across ranks."""

    # LoRA adapters' products by adapter id (``rvllm.lora``), once one is loaded.
    lora_weights: dict[int, list[LoRASlice]] | None = None

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 gather_output: bool = False) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.input_size = input_size
        self.output_size_per_partition = _divide(output_size, self.tp_size)
        self.gather_output = gather_output
        self.weight = nn.Parameter(
            torch.empty(self.output_size_per_partition, input_size), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(self.output_size_per_partition),
                                     requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        size = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.tp_rank * size, size))

    def checkpoint_view(self, param: nn.Parameter, shard_id: int | str | None = None
                        ) -> torch.Tensor | None:
        """Where ``weight_loader`` puts a whole checkpoint tensor (a loader may decode it
        there directly), or None where it keeps a slice of it (tensor parallelism)."""
        return param.data if self.tp_size == 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = apply_linear(self, x, self.bias)
        if self.lora_weights is not None:
            y = apply_lora(self.lora_weights, x, y)
        return all_gather_last_dim(y) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate+up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(input_size, sum(output_sizes), bias=bias)
        self.output_sizes = output_sizes

    def _rows(self, shard_id: int | str | None) -> tuple[int, int]:
        assert isinstance(shard_id, int)
        sizes = [s // self.tp_size for s in self.output_sizes]
        return sum(sizes[:shard_id]), sizes[shard_id]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        offset, size = self._rows(shard_id)
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.tp_rank * size, size))

    def checkpoint_view(self, param: nn.Parameter, shard_id: int | str | None = None
                        ) -> torch.Tensor | None:
        return param.data.narrow(0, *self._rows(shard_id)) if self.tp_size == 1 else None


class QKVParallelLinear(ColumnParallelLinear):
    """The query, key and value projections fused into one matmul.

    KV heads are replicated when there are fewer of them than ranks.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False) -> None:
        tp = get_tp_size()
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp)
        self.num_kv_heads = max(1, num_kv_heads // tp)
        self.kv_replicas = max(1, tp // num_kv_heads)
        total = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp
        super().__init__(hidden_size, total, bias=bias)

    def _rows(self, shard_id: int | str | None) -> tuple[int, int, int]:
        """(first row, rows, checkpoint slice) of ``shard_id``'s part of the weight."""
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        if shard_id == "q":
            return 0, q_size, self.tp_rank
        if shard_id == "k":
            return q_size, kv_size, self.tp_rank // self.kv_replicas
        if shard_id == "v":
            return q_size + kv_size, kv_size, self.tp_rank // self.kv_replicas
        raise ValueError(f"unknown qkv shard {shard_id!r}")

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        offset, size, rank = self._rows(shard_id)
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, rank * size, size))

    def checkpoint_view(self, param: nn.Parameter, shard_id: int | str | None = None
                        ) -> torch.Tensor | None:
        if self.tp_size != 1:
            return None
        offset, size, _ = self._rows(shard_id)
        return param.data.narrow(0, offset, size)


class RowParallelLinear(nn.Module, PackableLinear):
    """y = x W^T + b with W's columns (input features) split across ranks, summed after."""

    lora_weights: dict[int, list[LoRASlice]] | None = None  # as ColumnParallelLinear's

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.input_size_per_partition = _divide(input_size, self.tp_size)
        self.output_size = output_size
        self.weight = nn.Parameter(
            torch.empty(output_size, self.input_size_per_partition), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.bias_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        size = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.tp_rank * size, size))

    def bias_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                    shard_id: int | str | None = None) -> None:
        param.data.copy_(loaded)

    def checkpoint_view(self, param: nn.Parameter, shard_id: int | str | None = None
                        ) -> torch.Tensor | None:
        """As ``ColumnParallelLinear.checkpoint_view``: the weight or the bias whole."""
        return param.data if self.tp_size == 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(apply_linear(self, x))
        if self.lora_weights is not None:  # one rank only (LoRA refuses tensor parallelism)
            y = apply_lora(self.lora_weights, x, y)
        # The bias is added once, after the sum, so it is not counted tp_size times.
        return y + self.bias if self.bias is not None else y
