"""GGUF files as models: a Hugging Face-style config and HF-named weights.

The header (metadata, where each tensor's bytes are) is read by ``models.gguf_file``,
which needs no torch; this module builds on it with the decoders.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rvllm.models.dequant import check_supported
from rvllm.models.gguf_file import GGUFFile, open_gguf

if TYPE_CHECKING:
    from rvllm.kernels.cpu.packed import QuantizedRows

# GGUF architecture -> the Hugging Face class it loads as. A `llama` file with experts
# (`llama.expert_count` > 0) is Mixtral, which llama.cpp stores as `llama`.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi2": "PhiForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "deepseek2": "DeepseekV2ForCausalLM",
}
# GGUF architecture -> transformers' model_type (where the two names differ).
_MODEL_TYPES = {"qwen3moe": "qwen3_moe", "gemma3": "gemma3_text", "phi2": "phi",
                "deepseek2": "deepseek_v2"}
_GEMMAS = ("gemma", "gemma2", "gemma3")

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_ARCH_GLOBAL_TENSORS = {
    "phi2": {"output_norm.weight": "model.final_layernorm.weight",
             "output_norm.bias": "model.final_layernorm.bias", "output.bias": "lm_head.bias"},
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Mixtures of experts (Mixtral, Qwen3-MoE, DeepSeek-V2): the router and shared experts.
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}
_ARCH_LAYER_TENSORS = {
    # Gemma 2/3 norm the attention output, and norm before and after the MLP.
    "gemma2": {"post_attention_norm": "post_attention_layernorm",
               "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"},
    "phi2": {"attn_output": "self_attn.dense", "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2",
             "attn_q_norm": "self_attn.q_layernorm", "attn_k_norm": "self_attn.k_layernorm"},
    # Phi-3 keeps q/k/v and gate/up fused, as its checkpoints do.
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "deepseek2": {"attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
                  "attn_q_b": "self_attn.q_b_proj",
                  "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
                  "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj"},
}
_ARCH_LAYER_TENSORS["gemma3"] = _ARCH_LAYER_TENSORS["gemma2"]
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Early Mixtral GGUFs stored one tensor per expert: blk.N.ffn_gate.E.weight.
_EXPERT_NAME = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")
# Tensors the config describes already, so no parameter takes them: precomputed RoPE
# frequency factors (llama3 scaling) and Phi-3's LongRoPE factors (read into rope_scaling).
_IGNORED_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


def _check_architecture(gguf: GGUFFile) -> str:
    arch = gguf.architecture
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{gguf.path}: GGUF architecture {arch!r} is not supported; "
            f"supported: {', '.join(ARCHITECTURES)}"
        )
    return arch


def _f32(value: Any) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-06, not
    9.99999997e-07): the number the Hugging Face config held before conversion."""
    return float(str(np.float32(value)))


def _rope_scaling(meta: dict[str, Any], arch: str) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind in (None, "none") or factor is None:
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": _f32(factor)}
    if (original := meta.get(f"{arch}.rope.scaling.original_context_length")) is not None:
        scaling["original_max_position_embeddings"] = int(original)
    if kind == "yarn":
        for key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                            ("yarn_attn_factor", "attention_factor")):
            if (value := meta.get(f"{arch}.rope.scaling.{key}")) is not None:
                scaling[hf_key] = _f32(value)
    return scaling


def _layer_types(pattern: Any, n_layers: int) -> list[str]:
    """llama.cpp's sliding_window_pattern: one flag per layer, or every n-th layer global
    (0: all slide)."""
    if isinstance(pattern, list):
        swa = [bool(flag) for flag in pattern[:n_layers]]
    else:
        swa = [pattern == 0 or i % pattern < pattern - 1 for i in range(n_layers)]
    return ["sliding_attention" if s else "full_attention" for s in swa]


def load_gguf_config(source: str | os.PathLike[str] | GGUFFile) -> dict[str, Any]:
    """A Hugging Face-style model config dict built from a GGUF file's metadata."""
    gguf = open_gguf(source)
    arch = _check_architecture(gguf)
    meta, tensors = gguf.metadata, gguf.tensors

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"{gguf.path}: metadata {arch}.{key} is missing")
        return value

    def opt(key: str) -> Any:
        return meta.get(f"{arch}.{key}")

    num_heads, n_layers = get("attention.head_count"), get("block_count")
    hidden = get("embedding_length")
    num_experts = opt("expert_count") or 0
    mixtral = arch == "llama" and num_experts > 0
    has_bias = "blk.0.attn_q.bias" in tensors or "blk.0.attn_qkv.bias" in tensors
    embedding = tensors.get("token_embd.weight")
    vocab_size = (embedding.shape[0] if embedding is not None
                  else get("vocab_size", len(meta.get("tokenizer.ggml.tokens", ())) or None))
    config: dict[str, Any] = {
        "architectures": ["MixtralForCausalLM" if mixtral else ARCHITECTURES[arch]],
        "model_type": "mixtral" if mixtral else _MODEL_TYPES.get(arch, arch),
        "hidden_size": hidden,
        "intermediate_size": opt("feed_forward_length"),
        "num_hidden_layers": n_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": get("attention.head_count_kv", num_heads),
        "hidden_act": "silu",
        "rope_theta": _f32(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": get("context_length"),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": True if arch == "qwen2" else has_bias,
    }
    if arch == "phi2":
        config["layer_norm_eps"] = _f32(get("attention.layer_norm_epsilon"))
    else:
        config["rms_norm_eps"] = _f32(get("attention.layer_norm_rms_epsilon"))
    # llama.cpp's rope dimension is the head size for llama (full rotary); for DeepSeek-V2
    # key_length is the latent attention's (kv_lora_rank + rope), not a head size.
    head_dim = opt("attention.key_length") if arch != "deepseek2" else None
    if head_dim is None and arch == "llama":
        head_dim = opt("rope.dimension_count")
    if head_dim is not None:
        config["head_dim"] = head_dim
    head_dim = head_dim or hidden // num_heads
    if (scaling := _rope_scaling(meta, arch)) is not None:
        config["rope_scaling"] = scaling
    if arch == "llama" and (window := opt("attention.sliding_window")):
        config["sliding_window"] = window
    if arch in _GEMMAS:
        _gemma_config(config, arch, opt, head_dim)
    elif arch == "phi2":
        config["hidden_act"] = "gelu_new"  # ggml's GELU is the tanh approximation
        # The converter writes 4 * hidden_size as the feed-forward length whatever it is.
        if (fc1 := tensors.get("blk.0.ffn_up.weight")) is not None:
            config["intermediate_size"] = fc1.shape[0]
        config["partial_rotary_factor"] = get("rope.dimension_count") / head_dim
        config["qk_layernorm"] = "blk.0.attn_q_norm.weight" in tensors
    elif arch == "phi3":
        _phi3_config(config, gguf, opt, head_dim)
    elif mixtral:
        config.update(num_local_experts=num_experts, num_experts_per_tok=get("expert_used_count"))
    elif arch == "qwen3moe" and num_experts:
        # llama.cpp always renormalizes Qwen3-MoE's top-k weights, and has no dense layers
        # (mlp_only_layers); a layer without a router here is one.
        norm = opt("expert_weights_norm")
        config.update(
            num_experts=num_experts, num_experts_per_tok=get("expert_used_count"),
            moe_intermediate_size=get("expert_feed_forward_length"), decoder_sparse_step=1,
            norm_topk_prob=True if norm is None else bool(norm),
            mlp_only_layers=[i for i in range(n_layers)
                             if f"blk.{i}.ffn_gate_inp.weight" not in tensors],
        )  # fmt: skip
    elif arch == "deepseek2":
        _deepseek2_config(config, gguf, get, opt, num_experts)
    if config["intermediate_size"] is None:
        config["intermediate_size"] = (config.get("moe_intermediate_size")
                                       or get("feed_forward_length"))
    for name in ("bos", "eos", "pad", "unk"):
        key = "unknown" if name == "unk" else "padding" if name == "pad" else name
        if (token_id := meta.get(f"tokenizer.ggml.{key}_token_id")) is not None:
            config[f"{name}_token_id"] = token_id
    return config


def _gemma_config(config: dict[str, Any], arch: str, opt: Any, head_dim: int) -> None:
    """Gemma 1/2/3 settings, with llama.cpp's defaults for what the converter leaves out."""
    config["hidden_act"] = config["hidden_activation"] = "gelu_pytorch_tanh"
    if arch == "gemma":
        return
    # The converter drops query_pre_attn_scalar; llama.cpp scales by head_dim, except for
    # the 27B models (46 and 62 layers), which use hidden_size / num_heads, as their
    # configs do. An explicit attention.scale wins.
    if (scale := opt("attention.scale")) is not None:
        scalar = float(scale) ** -2  # float32: 255.99998 for 256
        config["query_pre_attn_scalar"] = (round(scalar) if abs(scalar - round(scalar)) < 1e-3
                                           else scalar)
    elif config["num_hidden_layers"] == {"gemma2": 46, "gemma3": 62}[arch]:
        config["query_pre_attn_scalar"] = config["hidden_size"] // config["num_attention_heads"]
    else:
        config["query_pre_attn_scalar"] = head_dim
    softcap = opt("final_logit_softcapping")
    config["final_logit_softcapping"] = _f32(softcap) if softcap else None
    n_layers = config["num_hidden_layers"]
    window = opt("attention.sliding_window")
    if arch == "gemma2":
        softcap = opt("attn_logit_softcapping")
        config["attn_logit_softcapping"] = _f32(softcap) if softcap else None
        window = 4096 if window is None else window  # llama.cpp's Gemma 2 default
    pattern = opt("attention.sliding_window_pattern")
    pattern = pattern if pattern is not None else 2 if arch == "gemma2" else 6
    config["sliding_window"] = window or None
    config["layer_types"] = (_layer_types(pattern, n_layers) if window
                             else ["full_attention"] * n_layers)
    if arch == "gemma3":
        # Sliding layers have their own RoPE base and no scaling; global ones keep
        # rope_theta and rope_scaling.
        config["rope_local_base_freq"] = _f32(opt("rope.freq_base_swa") or 10000.0)


def _phi3_config(config: dict[str, Any], gguf: GGUFFile, opt: Any, head_dim: int) -> None:
    rope_dim = opt("rope.dimension_count")
    config["partial_rotary_factor"] = rope_dim / head_dim if rope_dim else 1.0
    config["original_max_position_embeddings"] = (opt("rope.scaling.original_context_length")
                                                  or config["max_position_embeddings"])
    config["sliding_window"] = opt("attention.sliding_window") or None  # 0: none (Phi-4)
    if "rope_factors_long.weight" in gguf.tensors:
        # LongRoPE: the per-frequency factors live in two tensors. The attention factor
        # the converter writes is the default one transformers derives itself.
        config["rope_scaling"] = {
            "rope_type": "longrope",
            "long_factor": [_f32(f) for f in gguf.load("rope_factors_long.weight").tolist()],
            "short_factor": [_f32(f) for f in gguf.load("rope_factors_short.weight").tolist()],
        }


def _deepseek2_config(config: dict[str, Any], gguf: GGUFFile, get: Any, opt: Any,
                      num_experts: int) -> None:
    gating = opt("expert_gating_func")
    if gating not in (None, 0, 1) or any(n.endswith(".exp_probs_b.bias") for n in gguf.tensors):
        raise ValueError(f"{gguf.path}: sigmoid expert routing with a score correction bias "
                         "(DeepSeek-V3 style) is not supported; DeepSeek-V2 routes by softmax")
    rope_dim = get("rope.dimension_count")
    # Newer converters write the MLA head sizes apart (key_length is then the latent's).
    qk_head_dim = opt("attention.key_length_mla") or get("attention.key_length")
    n_group = opt("expert_group_count") or 1
    config.update(
        # The file says 1 (MLA run as multi-query attention); transformers' config keeps
        # the attention head count.
        num_key_value_heads=config["num_attention_heads"],
        head_dim=rope_dim,
        q_lora_rank=opt("attention.q_lora_rank") or None,
        kv_lora_rank=get("attention.kv_lora_rank"),
        qk_rope_head_dim=rope_dim,
        qk_nope_head_dim=qk_head_dim - rope_dim,
        v_head_dim=opt("attention.value_length_mla") or get("attention.value_length"),
        first_k_dense_replace=opt("leading_dense_block_count") or 0,
        moe_layer_freq=1,
        moe_intermediate_size=get("expert_feed_forward_length"),
        n_routed_experts=num_experts or None,
        num_experts_per_tok=opt("expert_used_count"),
        n_shared_experts=opt("expert_shared_count") or None,
        routed_scaling_factor=_f32(opt("expert_weights_scale") or 1.0),
        norm_topk_prob=bool(opt("expert_weights_norm") or False),
        n_group=n_group,
        topk_group=opt("expert_group_used_count") or 1,
        topk_method="group_limited_greedy" if n_group > 1 else "greedy",
        scoring_func="softmax",
    )
    scaling = config.get("rope_scaling")
    if scaling and (log_mul := opt("rope.scaling.yarn_log_multiplier")) is not None:
        # The converter stores 0.1 * mscale_all_dim; llama.cpp takes mscale equal to it (as
        # DeepSeek-V2's configs have it), so the cos/sin scale is 1.
        mscale = float(Decimal(str(np.float32(log_mul))) * 10)
        scaling.update(mscale=mscale, mscale_all_dim=mscale)


# ---------------------------------------------------------------- tensors

# One step of the tensor plan: the GGUF tensors to load, and a function from them (float32,
# in torch order) to the Hugging Face tensors they make.
_Build = Callable[[list[torch.Tensor]], list[tuple[str, torch.Tensor]]]


def _unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf's Q/K row permutation.

    llama.cpp's RoPE rotates adjacent pairs (x0, x1), HF's rotates the two halves
    of each head (x_i, x_{i+d/2}); the converter interleaves each head's halves
    and this puts them back.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"{rows} rows cannot be split into {n_head} heads of even size")
    w = w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
    return w.transpose(1, 2).reshape(rows, *w.shape[3:])


def _unpermute_packed(rows: QuantizedRows, n_head: int) -> QuantizedRows:
    """``_unpermute_rows`` on a weight's rows kept as stored (each row its blocks)."""
    from rvllm.kernels.cpu.packed import QuantizedRows

    data = rows.data
    n = data.shape[0]
    if n % (2 * n_head):
        raise ValueError(f"{n} rows cannot be split into {n_head} heads of even size")
    data = data.reshape(n_head, n // n_head // 2, 2, -1).swapaxes(1, 2).reshape(n, -1)
    return QuantizedRows(rows.fmt, data, rows.cols)


def _split_packed(rows: QuantizedRows, sizes: list[int]) -> list[QuantizedRows]:
    from rvllm.kernels.cpu.packed import QuantizedRows

    bounds = np.cumsum([0, *sizes])
    return [QuantizedRows(rows.fmt, rows.data[a:b], rows.cols)
            for a, b in zip(bounds[:-1], bounds[1:])]


def _tensor_plan(gguf: GGUFFile, arch: str, config: dict[str, Any], dtype: torch.dtype
                 ) -> list[tuple[tuple[str, ...], _Build]]:
    """How every tensor in the file becomes Hugging Face tensors; raises `ValueError` for
    a tensor with no counterpart before anything is loaded."""
    global_names = {**_GLOBAL_TENSORS, **_ARCH_GLOBAL_TENSORS.get(arch, {})}
    layer_names = {**_LAYER_TENSORS, **_ARCH_LAYER_TENSORS.get(arch, {})}
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]

    def fix(hf_name: str, kind: str | None, t: torch.Tensor) -> torch.Tensor:
        if arch == "llama" and kind in heads:
            return _unpermute_rows(t, heads[kind])
        if arch in _GEMMAS and hf_name.endswith("norm.weight"):
            # The converter stores Gemma's (1 + w) RMSNorm weights with the 1 added.
            return t - 1
        return t

    def single(hf_name: str, kind: str | None = None) -> _Build:
        def build(ts: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
            return [(hf_name, fix(hf_name, kind, ts[0]))]

        def packed(qs: list[QuantizedRows]) -> list[tuple[str, QuantizedRows]]:
            if arch == "llama" and kind in heads:
                return [(hf_name, _unpermute_packed(qs[0], heads[kind]))]
            return [(hf_name, qs[0])]

        # The tensor is the HF one as stored: it can be decoded where it belongs.
        unchanged = not ((arch == "llama" and kind in heads)
                         or (arch in _GEMMAS and hf_name.endswith("norm.weight")))
        build.direct = hf_name if unchanged else None  # type: ignore[attr-defined]
        build.packed = packed  # type: ignore[attr-defined]
        return build

    def fused_qkv(prefix: str, suffix: str) -> _Build:
        sizes = [heads["attn_q"] * head_dim, heads["attn_k"] * head_dim,
                 heads["attn_k"] * head_dim]

        def build(ts: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
            out = []
            for kind, part in zip(("attn_q", "attn_k", "attn_v"), ts[0].split(sizes)):
                hf_name = f"{prefix}{layer_names[kind]}.{suffix}"
                out.append((hf_name, fix(hf_name, kind, part)))
            return out

        def packed(qs: list[QuantizedRows]) -> list[tuple[str, QuantizedRows]]:
            out = []
            for kind, part in zip(("attn_q", "attn_k", "attn_v"), _split_packed(qs[0], sizes)):
                if arch == "llama" and kind in heads:
                    part = _unpermute_packed(part, heads[kind])
                out.append((f"{prefix}{layer_names[kind]}.{suffix}", part))
            return out

        build.packed = packed  # type: ignore[attr-defined]
        return build

    def gate_up(hf_name: str) -> _Build:
        return lambda ts: [(hf_name, torch.cat([t.to(dtype) for t in ts], dim=1))]

    def kv_b(hf_name: str) -> _Build:
        # The converter splits kv_b_proj per head into k_b (nope rows, stored transposed)
        # and v_b (v rows); stack them back, head by head.
        def build(ts: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
            k_b, v_b = ts
            return [(hf_name, torch.cat((k_b.transpose(1, 2), v_b), 1).reshape(-1, k_b.shape[1]))]

        return build

    def partner(name: str, other: str) -> str:
        if other not in gguf.tensors:
            raise ValueError(f"{gguf.path}: GGUF tensor {name!r} comes without {other!r}")
        return other

    plan: list[tuple[tuple[str, ...], _Build]] = []
    paired: set[str] = set()
    for name in gguf.tensors:
        if name in _IGNORED_TENSORS or name in paired:
            continue
        if name in global_names:
            plan.append(((name,), single(global_names[name])))
            continue
        if (m := _EXPERT_NAME.fullmatch(name)) is not None:
            plan.append(((name,), single(f"model.layers.{m[1]}.mlp.experts.{m[3]}.{m[2]}_proj"
                                         ".weight")))
            continue
        m = _LAYER_NAME.fullmatch(name)
        if m is None:
            raise ValueError(f"{gguf.path}: GGUF tensor {name!r} has no Hugging Face counterpart")
        layer, kind, suffix = m.groups()
        prefix = f"model.layers.{layer}."
        if kind in ("ffn_gate_exps", "ffn_up_exps") and suffix == "weight":
            pair = (f"blk.{layer}.ffn_gate_exps.weight", f"blk.{layer}.ffn_up_exps.weight")
            pair = tuple(partner(name, n) for n in pair)
            paired.update(pair)
            plan.append((pair, gate_up(f"{prefix}mlp.experts.gate_up_proj")))
        elif kind == "ffn_gate_up_exps" and suffix == "weight":
            plan.append(((name,), single(f"{prefix}mlp.experts.gate_up_proj")))
        elif kind == "ffn_down_exps" and suffix == "weight":
            plan.append(((name,), single(f"{prefix}mlp.experts.down_proj")))
        elif kind in ("attn_k_b", "attn_v_b") and arch == "deepseek2":
            pair = (f"blk.{layer}.attn_k_b.weight", f"blk.{layer}.attn_v_b.weight")
            pair = tuple(partner(name, n) for n in pair)
            paired.update(pair)
            plan.append((pair, kv_b(f"{prefix}self_attn.kv_b_proj.weight")))
        elif kind == "attn_qkv" and kind not in layer_names:  # converted with --fuse-qkv
            plan.append(((name,), fused_qkv(prefix, suffix)))
        elif kind in layer_names:
            plan.append(((name,), single(f"{prefix}{layer_names[kind]}.{suffix}", kind)))
        else:
            raise ValueError(f"{gguf.path}: GGUF tensor {name!r} has no Hugging Face counterpart")
    return plan


def _packed_rows(gguf: GGUFFile, name: str) -> QuantizedRows | None:
    """Tensor ``name``'s rows of blocks, where it is a 2-D weight of a packed format."""
    from rvllm.kernels.cpu.packed import QuantizedRows, packable

    info = gguf.tensors[name]
    if len(info.shape) != 2 or not packable(info.ggml_type, info.shape[1]):
        return None
    return QuantizedRows(info.ggml_type, gguf.raw(name).reshape(info.shape[0], -1),
                         info.shape[1])


def iter_gguf_tensors(
    source: str | os.PathLike[str] | GGUFFile, dtype: torch.dtype = torch.float32,
    destination: Callable[[str, tuple[int, ...]], torch.Tensor | None] | None = None,
    keep_packed: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor | QuantizedRows]]:
    """Yield `(hf_name, tensor)` for every weight in the file, dequantized to `dtype`.

    `keep_packed(hf_name)`, when given, says which weights may stay as the file stores
    them: a 2-D weight of a type ``kernels.cpu.packed`` computes with is then yielded as
    its rows of blocks (``QuantizedRows``, viewing the file's memory map), untouched but
    for the llama Q/K row permutation and a fused Q/K/V's split.

    `destination(hf_name, shape)`, when given, may return the float32 tensor a weight
    ends up in (``models.base.checkpoint_destinations``: the model's parameter, or its
    rows of a fused one); a weight stored as HF has it is then decoded straight into
    it, and the tensor yielded is that memory, which saves a copy of every weight.

    Names and shapes are those of the Hugging Face model (transformers 5's, so experts
    come stacked as `mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj`),
    and every transform the converter applies is undone: the llama Q/K row permutation,
    Gemma's norm + 1, the split of DeepSeek-V2's kv_b_proj and the per-projection expert
    stacks; so the weights equal HF's exactly.
    """
    gguf = open_gguf(source)
    arch = _check_architecture(gguf)
    config = load_gguf_config(gguf)
    plan = _tensor_plan(gguf, arch, config, dtype)
    for info in gguf.tensors.values():  # fail before any work, not halfway through
        try:
            check_supported(info.ggml_type)
        except ValueError as e:
            raise ValueError(f"{gguf.path}: tensor {info.name!r}: {e}") from None
    for sources, build in plan:
        packed = getattr(build, "packed", None)
        if keep_packed is not None and packed is not None:
            rows = [_packed_rows(gguf, name) for name in sources]
            if all(r is not None for r in rows):
                parts = packed(rows)
                if all(keep_packed(hf_name) for hf_name, _ in parts):
                    yield from parts
                    continue
        direct = getattr(build, "direct", None)
        if direct is not None and destination is not None and dtype == torch.float32:
            out = destination(direct, gguf.tensors[sources[0]].shape)
            if out is not None:
                yield direct, gguf.load(sources[0], out)
                continue
        for hf_name, tensor in build([gguf.load(name) for name in sources]):
            yield hf_name, tensor.to(dtype)
