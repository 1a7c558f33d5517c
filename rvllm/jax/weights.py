"""A checkpoint's weights as stacked JAX arrays: one stack per shape class of layer, each
array of a stack with the layer as its leading axis, so the step scans over it.

Llama, Mistral and Qwen2 have one shape class (every layer alike): one stack of all the
layers. A model with layers of several shapes (Gemma 3/4: sliding and global layers in a
repeating pattern) would have a stack per class of pattern block; ``ModelSpec.stacks`` is
a tuple for that reason, and such models are refused until their step is written.

The weights are plain dicts of arrays (a pytree the jitted step takes as an argument, not
as constants): linear weights stored ``[in, out]`` so a layer is ``x @ w``, q/k/v fused
into one matrix, gate and up into another."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from rvllm.config import ModelConfig
from rvllm.layers.rope_frequencies import inv_freq, inv_freq_and_scale
from rvllm.layers.rotary import rope_parameters
from rvllm.models.llama import layer_windows
from rvllm.models.loader import iter_safetensors, safetensors_files

# The architectures whose every layer has one shape: the step's single stack covers them.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

# A layer's window when it has none: larger than any context.
NO_WINDOW = 2**30

DTYPES = {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16, torch.float16: jnp.float16}


@dataclass(frozen=True, slots=True)
class StackSpec:
    """The shape of every layer of one stack (one shape class)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    qkv_bias: bool
    o_bias: bool


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What the step's code depends on besides its arrays' shapes: static (hashable), so
    ``jax.jit`` keys its compilations on it."""

    hidden_size: int
    vocab_size: int
    rms_norm_eps: float
    tied_embeddings: bool
    stacks: tuple[StackSpec, ...]
    # float32 models compute their matmuls in full float32 (no TF32 on a GPU), as
    # transformers does: the tokens must match it.
    full_precision: bool


def check_supported(config: ModelConfig) -> None:
    """Raise ``ValueError`` naming what the JAX backend cannot run of this model."""
    cfg = config.hf_config
    arch = config.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        if arch.startswith("Gemma"):
            raise ValueError(f"--model-impl jax does not run {arch} yet (its sliding and global "
                             "layers have to be scanned as pattern blocks); use --model-impl "
                             "torch.")
        raise ValueError(f"--model-impl jax runs {', '.join(SUPPORTED_ARCHITECTURES)}; not "
                         f"{arch}. Use --model-impl torch.")
    if config.gguf_file is not None:
        raise ValueError("--model-impl jax loads safetensors checkpoints; "
                         f"{config.gguf_file} is a GGUF file. Use --model-impl torch.")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"--model-impl jax: hidden_act {act!r} is not supported (silu only).")
    if cfg.get("mlp_bias"):
        raise ValueError("--model-impl jax: MLP biases (mlp_bias) are not supported yet.")
    rope_parameters(cfg)  # raises for a rope scaling rvllm does not know


def model_spec(config: ModelConfig) -> ModelSpec:
    cfg = config.hf_config
    heads = config.num_heads
    model_type = cfg.get("model_type")
    attention_bias = bool(cfg.get("attention_bias", False))
    stack = StackSpec(
        num_layers=config.num_layers, num_heads=heads, num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim, intermediate_size=cfg["intermediate_size"],
        # Qwen2 has q/k/v biases and none on o_proj; Llama's attention_bias covers all four.
        qkv_bias=attention_bias or model_type == "qwen2",
        o_bias=attention_bias and model_type != "qwen2",
    )
    return ModelSpec(
        hidden_size=config.hidden_size, vocab_size=config.vocab_size,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        stacks=(stack,), full_precision=config.dtype == torch.float32,
    )


def rope_tables(config: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of every position up to ``max_model_len`` (float32, [P, head_dim]), as
    the torch backend's ``layers.rotary`` builds them (YaRN's factor on both)."""
    head_dim, positions = config.head_dim, config.max_model_len
    params = rope_parameters(config.hf_config)
    scale = 1.0
    if params["rope_type"] == "yarn":
        freqs_inv, scale = inv_freq_and_scale(head_dim, params, positions, positions)
    else:
        freqs_inv = inv_freq(head_dim, params)
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), freqs_inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scale).numpy(), (emb.sin() * scale).numpy()


def load_weights(config: ModelConfig, device: jax.Device, progress: bool = False
                 ) -> tuple[ModelSpec, dict[str, Any]]:
    """The checkpoint's weights, stacked, on ``device`` in the model's dtype."""
    check_supported(config)
    spec = model_spec(config)
    (stack,) = spec.stacks
    np_dtype = np.dtype(DTYPES[config.dtype])
    flat: dict[str, np.ndarray] = {}
    for name, tensor in iter_safetensors(safetensors_files(Path(config.path)), progress):
        flat[name] = tensor.to(torch.float32).numpy().astype(np_dtype)

    def take(name: str) -> np.ndarray:
        if name not in flat:
            raise ValueError(f"{config.path}: the checkpoint has no weight {name!r}.")
        return flat.pop(name)

    layers: dict[str, list[np.ndarray]] = {}
    for i in range(stack.num_layers):
        p = f"model.layers.{i}."
        parts = {
            "input_norm": take(p + "input_layernorm.weight"),
            "post_norm": take(p + "post_attention_layernorm.weight"),
            "qkv": np.concatenate([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]).T,
            "o": take(p + "self_attn.o_proj.weight").T,
            "gate_up": np.concatenate([take(p + "mlp.gate_proj.weight"),
                                       take(p + "mlp.up_proj.weight")]).T,
            "down": take(p + "mlp.down_proj.weight").T,
        }
        if stack.qkv_bias:
            parts["qkv_bias"] = np.concatenate([take(p + f"self_attn.{n}_proj.bias")
                                                for n in "qkv"])
        if stack.o_bias:
            parts["o_bias"] = take(p + "self_attn.o_proj.bias")
        for key, value in parts.items():
            layers.setdefault(key, []).append(value)
    windows = [NO_WINDOW if w is None else w for w in layer_windows(config.hf_config)]
    put = lambda a: jax.device_put(a, device)  # noqa: E731
    stacked = {key: put(np.stack(values)) for key, values in layers.items()}
    stacked["window"] = put(np.asarray(windows, np.int32))
    cos, sin = rope_tables(config)
    weights: dict[str, Any] = {
        "embed": put(take("model.embed_tokens.weight")),
        "final_norm": put(take("model.norm.weight")),
        "rope": {"cos": put(cos), "sin": put(sin)},
        "stacks": [stacked],
    }
    if not spec.tied_embeddings:
        weights["lm_head"] = put(take("lm_head.weight"))
    return spec, weights
