"""What every decoder-only family beyond Llama shares: per-layer attention windows, the
checkpoint-to-parameter copy, and the causal-LM wrapper around a decoder stack (with
expert-weight loading for the mixtures of experts)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from rvllm.layers.attention import Attention
from rvllm.layers.cpu_linear import PackableLinear
from rvllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from rvllm.layers.moe import route_expert_weights
from rvllm.layers.norm import RMSNorm

if TYPE_CHECKING:
    import numpy as np

    from rvllm.kernels.cpu.decoder_step import DecodeLogits

# (our fused parameter's name piece, the checkpoint's name piece, shard id)
StackedParams = Sequence[tuple[str, str, int | str]]

QKV_GATE_UP: StackedParams = (
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
    (".gate_up_proj.", ".gate_proj.", 0),
    (".gate_up_proj.", ".up_proj.", 1),
)


def layer_types(cfg: dict[str, Any], sliding_every: int | None = None) -> list[str]:
    """``layer_types`` as transformers 5 writes it; older configs only give a pattern in
    which every ``sliding_every``-th layer is global and the rest slide."""
    n = cfg["num_hidden_layers"]
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])[:n]
    pattern = cfg.get("sliding_window_pattern") or sliding_every
    if not cfg.get("sliding_window") or not pattern:
        return ["full_attention"] * n
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]


def layer_window(cfg: dict[str, Any], layer_type: str) -> int | None:
    window = cfg.get("sliding_window")
    return int(window) if window and layer_type == "sliding_attention" else None


def stacked_target(name: str, stacked: StackedParams) -> tuple[str, int | str | None]:
    """The parameter a checkpoint tensor goes into, and its shard of a fused one."""
    for fused, original, shard_id in stacked:
        if original in name:
            return name.replace(original, fused), shard_id
    return name, None


def _not_loaded(name: str, tied: bool) -> bool:
    """Checkpoint tensors ``load_params`` skips: rotary tables, a tied LM head."""
    return "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight")


def skipped_checkpoint_tensor(model: nn.Module, name: str) -> bool:
    """Whether ``load_params`` leaves out the checkpoint tensor ``name`` of ``model`` (so a
    loader need not move it to the device)."""
    return _not_loaded(name, bool(getattr(model, "tied", False)))


def load_params(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                stacked: StackedParams = QKV_GATE_UP, tied: bool = False) -> set[str]:
    """Copy checkpoint tensors (Hugging Face names) into ``model``'s parameters, folding the
    ``stacked`` names into fused projections; returns the names of the parameters filled.
    Each tensor is copied once, from wherever it is (a view of a memory-mapped file, or
    the parameter's device) straight into the parameter, converted on the way where its
    dtype differs: no converted copy of the whole tensor first."""
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: set[str] = set()
    for name, tensor in weights:
        if _not_loaded(name, tied):
            continue
        target, shard = stacked_target(name, stacked)
        param = params.get(target)
        if param is None:
            raise ValueError(f"checkpoint tensor {name} has no place in the model")
        if not isinstance(tensor, torch.Tensor):  # rows kept as the file stores them
            _keep_packed_rows(model, target, param, shard, name, tensor)
            loaded.add(target)
            continue
        if tensor.untyped_storage().data_ptr() == param.untyped_storage().data_ptr():
            loaded.add(target)  # decoded in place (``checkpoint_destinations``)
            continue
        loader = getattr(param, "weight_loader", None)
        if loader is None:
            if tensor.shape != param.shape:
                raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(param.shape)}")
            param.data.copy_(tensor)
        elif shard is None:
            loader(param, tensor)  # its copy_ converts to the parameter's dtype
        else:
            loader(param, tensor, shard)
        loaded.add(target)
    if tied:
        loaded.add("lm_head.weight")
    return loaded


def _keep_packed_rows(model: nn.Module, target: str, param: nn.Parameter,
                      shard: int | str | None, name: str, rows: Any) -> None:
    """Note a checkpoint tensor kept packed (``kernels.cpu.packed.QuantizedRows``) on the
    parameter it belongs in, with its first row there (``packed_parts``): the weight
    stays unwritten until ``layers.cpu_linear.prepare_linear_weights`` packs the parts
    into panels (or, where it cannot, decodes them into it)."""
    module = model.get_submodule(target.rpartition(".")[0])
    view_of = getattr(module, "checkpoint_view", None)
    view = view_of(param, shard) if view_of is not None else param.data
    if view is None or tuple(view.shape) != (rows.rows, rows.cols):
        raise ValueError(f"checkpoint tensor {name} has shape {(rows.rows, rows.cols)}, the "
                         f"model expects {tuple(param.shape if view is None else view.shape)}")
    parts = getattr(param, "packed_parts", None)
    if parts is None:
        parts = param.packed_parts = []
    parts.append((view.storage_offset() // param.shape[1], rows))


def packed_destinations(model: nn.Module) -> Callable[[str], bool] | None:
    """For a model loaded by plain ``load_params``: which checkpoint weights may come as
    GGUF's rows of blocks, kept packed (``iter_gguf_tensors``' ``keep_packed``): the
    weights of linear layers and embeddings in float32 host memory on one rank."""
    if not isinstance(model, CausalLM) or type(model).load_weights is not CausalLM.load_weights:
        return None
    params = dict(model.named_parameters(remove_duplicate=False))

    def keep(name: str) -> bool:
        if _not_loaded(name, model.tied) or not name.endswith(".weight"):
            return False
        target, _ = stacked_target(name, model.stacked_params)
        param = params.get(target)
        if param is None or param.dtype != torch.float32 or param.device.type != "cpu":
            return False
        module = model.get_submodule(target.rpartition(".")[0])
        return (isinstance(module, (PackableLinear, VocabParallelEmbedding))
                and getattr(module, "tp_size", 1) == 1 and param.dim() == 2)

    return keep


class PreNormDecoderLayer(nn.Module):
    """Llama's block: x + attn(norm(x)), then x + mlp(norm(x)), with the residual add fused
    into the next norm."""

    def __init__(self, cfg: dict[str, Any], self_attn: nn.Module, mlp: nn.Module,
                 norm: type[nn.Module] = RMSNorm) -> None:
        super().__init__()
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = norm(cfg["hidden_size"], eps)
        self.post_attention_layernorm = norm(cfg["hidden_size"], eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    """Embedding, the decoder layers, and the final RMSNorm."""

    def __init__(self, cfg: dict[str, Any], layers: list[nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg["vocab_size"], cfg["hidden_size"])
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x


class CausalLM(nn.Module):
    """A decoder stack (``self.model``: embed_tokens, layers[i].self_attn.attn, norm) under an
    LM head. ``forward`` returns hidden states for every new token; logits only where asked."""

    stacked_params: StackedParams = QKV_GATE_UP

    def __init__(self, cfg: dict[str, Any], model: nn.Module) -> None:
        super().__init__()
        self.config = cfg
        self.model = model
        self.tied = bool(cfg.get("tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(cfg["vocab_size"], cfg["hidden_size"])
        if self.tied:
            self.lm_head.weight = model.embed_tokens.weight
            self.lm_head.keeps_weight = True

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def decode_logits(self, token_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                      block_tables: np.ndarray, greedy: bool) -> DecodeLogits | None:
        """A decode step of a few sequences straight to logits in compiled CPU code
        (numpy int64 token ids, positions, cache slots [B] and block tables [B, W]), or
        None where that does not cover this model or step: then ``forward`` and
        ``compute_logits`` run it. Only the stacks the CPU's whole-step kernels compute
        have it (``models.cpu_step``, used by ``LlamaForCausalLM``)."""
        return None

    def decode_greedy_steps(self, token_ids: np.ndarray, positions: np.ndarray,
                            block_tables: np.ndarray, block_size: int, num_steps: int,
                            stops: np.ndarray) -> tuple[list[list[int]], list[list[float]]] | None:
        """Up to ``num_steps`` greedy decode steps in one compiled CPU call, each step's
        argmax the next one's input: each step's tokens and their logprobs, or None where
        ``decode_logits`` would not cover the step."""
        return None

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_params(self, weights, self.stacked_params, self.tied)


def num_routed_experts(cfg: dict[str, Any]) -> int:
    """The expert count under any of its names (transformers 5 writes num_local_experts)."""
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if cfg.get(key):
            return int(cfg[key])
    return 0


class MoECausalLM(CausalLM):
    """Loads per-expert checkpoint tensors into the stacked expert weights."""

    def _renamed(self, weights: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(weights)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        rest = route_expert_weights(params, self._renamed(weights), loaded)
        return loaded | load_params(self, rest, self.stacked_params, self.tied)


def checkpoint_destinations(model: nn.Module
                            ) -> Callable[[str, tuple[int, ...]], torch.Tensor | None] | None:
    """For a model loaded by plain ``load_params``: a function from a checkpoint tensor's
    name and shape to the float32 host memory its values end up in (the parameter, or a
    fused parameter's rows), or None where loading does more than copy it whole (tensor
    parallelism, padding, a transform) or the parameter is on a GPU. A loader that
    decodes (``iter_gguf_tensors``) writes there directly; ``load_params`` then finds
    the tensor in place."""
    if not isinstance(model, CausalLM) or type(model).load_weights is not CausalLM.load_weights:
        return None
    params = dict(model.named_parameters(remove_duplicate=False))

    def destination(name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        if _not_loaded(name, model.tied):
            return None
        target, shard = stacked_target(name, model.stacked_params)
        param = params.get(target)
        if param is None or param.dtype != torch.float32 or param.device.type != "cpu":
            return None  # the decoders write host memory
        loader = getattr(param, "weight_loader", None)
        if loader is None:
            view = param.data if shard is None else None
        else:
            # Only the module whose loader this is knows where that loader writes.
            view_of = getattr(getattr(loader, "__self__", None), "checkpoint_view", None)
            view = view_of(param, shard) if view_of is not None else None
        if view is None or tuple(view.shape) != tuple(shape) or not view.is_contiguous():
            return None
        return view

    return destination
