"""Mixture-of-experts: top-k routing and the experts' gated MLPs, batched per expert.

Every expert's weights live stacked in two tensors, ``w13_weight`` [E, 2I, H] (gate and
up side by side) and ``w2_weight`` [E, H, I]. The (token, choice) pairs of a step are
sorted by expert, so each expert runs one matmul over all of its tokens; the results are
weighted and summed back per token with one ``index_add_``. Under tensor parallelism
each rank holds a slice of every expert's intermediate features and the partial outputs
are summed across ranks, as a row-parallel linear does.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from rvllm.distributed import all_reduce, get_tp_rank, get_tp_size
from rvllm.layers.activation import SiluAndMul

# Per-expert checkpoint names: Mixtral's w1/w3/w2 and the gate/up/down of the others.
_EXPERT_WEIGHT = re.compile(r"^(.*\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)"
                            r"\.weight$")
_STACKED_EXPERTS = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")
_SHARDS = {"w1": "w1", "gate_proj": "w1", "w3": "w3", "up_proj": "w3", "w2": "w2",
           "down_proj": "w2"}


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                   scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts in float32, then the ``top_k`` best per token: (weights, ids)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if scaling != 1.0:
        weights = weights * scaling
    return weights, ids


def select_grouped_experts(router_logits: torch.Tensor, top_k: int, num_groups: int,
                           topk_groups: int, scaling: float = 1.0
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's group-limited greedy routing: experts come in ``num_groups`` groups, a
    group scores as its best expert, and only the ``topk_groups`` best groups compete."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    grouped = probs.view(probs.shape[0], num_groups, -1)
    best_groups = grouped.max(dim=-1).values.topk(topk_groups, dim=-1).indices
    keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best_groups, True)
    probs = grouped.masked_fill(~keep.unsqueeze(-1), 0.0).view_as(probs)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return weights * scaling, ids


class FusedMoE(nn.Module):
    """The routed experts of one layer (gated MLPs, SiLU unless told otherwise)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 act_fn: nn.Module | None = None) -> None:
        super().__init__()
        self.act_fn = act_fn or SiluAndMul()  # takes [gate | up], as the dense MLPs do
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        if intermediate_size % self.tp_size:
            raise ValueError(f"moe intermediate size {intermediate_size} is not divisible by "
                             f"the tensor-parallel size {self.tp_size}.")
        self.num_experts = num_experts
        self.shard = intermediate_size // self.tp_size
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * self.shard, hidden_size),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, self.shard),
                                      requires_grad=False)
        self.w13_weight.weight_loader = self.weight_loader
        self.w2_weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: tuple[int, str]) -> None:
        """``loaded`` is one expert's full w1 (gate), w3 (up) or w2 (down) matrix."""
        expert, which = shard_id
        rows = slice(self.tp_rank * self.shard, (self.tp_rank + 1) * self.shard)
        if which == "w2":
            param.data[expert].copy_(loaded[:, rows])
        else:
            offset = 0 if which == "w1" else self.shard
            param.data[expert, offset:offset + self.shard].copy_(loaded[rows])

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
                ) -> torch.Tensor:
        """x: [T, H]; topk_weights, topk_ids: [T, k]. Returns sum_k weight * expert(x)."""
        num_tokens, top_k = topk_ids.shape
        flat_ids = topk_ids.flatten()
        order = flat_ids.argsort(stable=True)
        token_of = order // top_k
        grouped = x[token_of]
        out = torch.empty_like(grouped)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        start = 0
        for expert, count in enumerate(counts):
            if count:
                rows = slice(start, start + count)
                gate_up = F.linear(grouped[rows], self.w13_weight[expert])
                out[rows] = F.linear(self.act_fn(gate_up), self.w2_weight[expert])
                start += count
        out = out * topk_weights.flatten()[order].unsqueeze(1).to(out.dtype)
        y = torch.zeros_like(x).index_add_(0, token_of, out)
        return all_reduce(y)


def route_expert_weights(params: dict[str, nn.Parameter],
                         weights: Iterable[tuple[str, torch.Tensor]], loaded: set[str]
                         ) -> Iterator[tuple[str, torch.Tensor]]:
    """Load expert checkpoint tensors into their layer's FusedMoE (adding the filled names
    to ``loaded``) and pass every other tensor through. Experts come one tensor per expert
    and projection, or (transformers 5 style) stacked as ``experts.gate_up_proj``
    [E, 2I, H] and ``experts.down_proj`` [E, H, I]."""
    for name, tensor in weights:
        stacked = _STACKED_EXPERTS.match(name)
        if stacked is not None:
            prefix, kind = stacked.group(1), stacked.group(2)
            target = f"{prefix}.{'w13_weight' if kind == 'gate_up_proj' else 'w2_weight'}"
            if target not in params:
                raise ValueError(f"checkpoint tensor {name} has no place in the model")
            param = params[target]
            for expert, matrix in enumerate(tensor):  # the loader's copy_ converts
                if kind == "down_proj":
                    param.weight_loader(param, matrix, (expert, "w2"))
                else:
                    gate, up = matrix.chunk(2, dim=0)
                    param.weight_loader(param, gate, (expert, "w1"))
                    param.weight_loader(param, up, (expert, "w3"))
            loaded.add(target)
            continue
        match = _EXPERT_WEIGHT.match(name)
        if match is None:
            yield name, tensor
            continue
        prefix, expert, kind = match.group(1), int(match.group(2)), _SHARDS[match.group(3)]
        target = f"{prefix}.{'w2_weight' if kind == 'w2' else 'w13_weight'}"
        if target not in params:
            raise ValueError(f"checkpoint tensor {name} has no place in the model")
        param = params[target]
        param.weight_loader(param, tensor, (expert, kind))
        loaded.add(target)


class SparseMoeBlock(nn.Module):
    """A router picking ``top_k`` of ``num_experts`` per token, the experts, and optionally
    shared experts every token passes through (DeepSeek), added after the routed sum."""

    def __init__(self, hidden_size: int, num_experts: int, intermediate_size: int, top_k: int,
                 renormalize: bool, scaling: float = 1.0, router_fp32: bool = False,
                 shared_experts: nn.Module | None = None,
                 expert_groups: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.top_k, self.renormalize, self.scaling = top_k, renormalize, scaling
        self.expert_groups = expert_groups  # (groups, groups kept) for group-limited routing
        # DeepSeek routes in float32 whatever the compute dtype; the others in it.
        self.router_fp32 = router_fp32
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.gate.weight.requires_grad_(False)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size)
        self.shared_experts = shared_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.router_fp32:
            logits = F.linear(x.float(), self.gate.weight.float())
        else:
            logits = self.gate(x)
        if self.expert_groups is None:
            weights, ids = select_experts(logits, self.top_k, self.renormalize, self.scaling)
        else:
            weights, ids = select_grouped_experts(logits, self.top_k, *self.expert_groups,
                                                  scaling=self.scaling)
        y = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y
