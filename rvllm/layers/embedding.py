"""Token embedding and LM head, split over the vocabulary across tensor-parallel ranks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rvllm.distributed import all_gather_last_dim, all_reduce, get_tp_rank, get_tp_size
from rvllm.layers.cpu_linear import PackableLinear, apply_linear


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous slice of the vocabulary's rows."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        tp_rank, tp_size = get_tp_rank(), get_tp_size()
        self.num_embeddings = num_embeddings
        self.shard_size = -(-num_embeddings // tp_size)
        self.vocab_start = tp_rank * self.shard_size
        self.vocab_end = min(self.vocab_start + self.shard_size, num_embeddings)
        self.tp_size = tp_size
        # Every row the checkpoint fills is left as it comes (zeroing 49k x 576 floats
        # was a tenth of a start-up); the last rank's padding rows past the vocabulary
        # stay zero.
        weight = torch.empty(self.shard_size, embedding_dim)
        weight[self.vocab_end - self.vocab_start:] = 0
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        shard = loaded[self.vocab_start:self.vocab_end]
        param.data[: shard.shape[0]].copy_(shard)

    def checkpoint_view(self, param: nn.Parameter, shard_id: int | str | None = None
                        ) -> torch.Tensor | None:
        """Where ``weight_loader`` puts a whole checkpoint tensor (a loader may decode it
        there directly), or None where it keeps a slice of it."""
        return param.data if self.shard_size == self.num_embeddings else None

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            if hasattr(self.weight, "row_panels"):  # a tied LM head's panels hold the rows
                from rvllm.kernels.cpu.gemv import embedding_rows, embedding_table

                return embedding_rows(embedding_table(self.weight), input_ids)
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = (input_ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding, PackableLinear):
    """Projects hidden states to logits; may share its weight with the embedding (then the
    plain weight is kept for the embedding when the LM head's copy is packed)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.register_parameter("bias", None)  # Phi-2 gives its LM head one
        self.keeps_weight = False

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = apply_linear(self, hidden, self.bias)
        if self.tp_size > 1:
            logits = all_gather_last_dim(logits)
        return logits[..., : self.num_embeddings]
