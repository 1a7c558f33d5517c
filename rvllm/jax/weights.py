"""A checkpoint's weights as stacked JAX arrays, laid out for ``lax.scan``.

The layers are grouped into **stacks**, each a **pattern block** of layer kinds repeated
``repeats`` times: a stack holds one dict of arrays per position in its pattern, each array
with the repeat as its leading axis, and the step scans over the repeats with a static
Python loop over the block's positions inside. A position's window and RoPE table are
compile-time constants of its ``LayerKind``.

- Llama, Mistral and Qwen2: one stack, a pattern of one layer repeated over every layer;
  each layer's window is an array beside its weights (Qwen2's windows need not repeat).
- Gemma 1: one stack, a pattern of one global layer; Gemma 2: one of (sliding, global)
  blocks, scores and final logits soft-capped.
- Gemma 3: its sliding and global layers repeat (five sliding, one global in the released
  models): one stack of whole pattern blocks, then one of the leftover layers after the
  last whole block, run once.
- Gemma 4: the same, its global layers with a head size and KV heads of their own; its
  last ``num_kv_shared_layers`` layers, which read the cache of the last earlier layer of
  their type and write none, are stacks of their own after the others.

The weights are plain dicts of arrays (a pytree the jitted step takes as an argument, not
as constants): linear weights stored ``[in, out]`` so a layer is ``x @ w``, q/k/v fused
into one matrix, gate and up into another. Under ``--quantization int8`` or ``int4`` each
layer's linear weight is a dict of its integer values and scales instead
(``rvllm.jax.quant``), stacked like the arrays."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch

from rvllm.config import ModelConfig
from rvllm.jax.quant import METHODS as QUANTIZATIONS
from rvllm.jax.quant import quantize_layer
from rvllm.layers.rope_frequencies import inv_freq, inv_freq_and_scale
from rvllm.layers.rotary import rope_parameters
from rvllm.layers.rotary_scaled import rope_type_of
from rvllm.models.base import layer_types, layer_window
from rvllm.models.gemma import layer_rope_parameters
from rvllm.models.gemma4 import kv_producers, layer_geometry
from rvllm.models.gguf_loader import ARCHITECTURES as GGUF_LOADER_ARCHITECTURES
from rvllm.models.gguf_loader import iter_gguf_tensors
from rvllm.models.llama import layer_windows
from rvllm.models.loader import iter_safetensors, safetensors_files

LLAMA_FAMILY = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
GEMMA_FAMILY = ("GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
                "Gemma4ForCausalLM")
# Each Gemma's family name in the spec, and for a config with no layer_types every how
# many layers one is global (None: none slides), as the torch backend reads them.
_GEMMA_FAMILIES = {"GemmaForCausalLM": "gemma1", "Gemma2ForCausalLM": "gemma2",
                   "Gemma3ForCausalLM": "gemma3", "Gemma4ForCausalLM": "gemma4"}
_SLIDING_EVERY = {"GemmaForCausalLM": None, "Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 6,
                  "Gemma4ForCausalLM": 6}
SUPPORTED_ARCHITECTURES = LLAMA_FAMILY + GEMMA_FAMILY
# Those of them a GGUF file can hold: the ones the GGUF loader reads (a Mistral file is
# stored as llama, so loads as Llama; there is no Gemma 4 GGUF architecture there).
GGUF_ARCHITECTURES = tuple(a for a in SUPPORTED_ARCHITECTURES
                           if a in GGUF_LOADER_ARCHITECTURES.values())

# How a model's layers are laid out for the step (``model_spec``): "blocks" scans the
# pattern blocks (the default); "flat" scans every layer as one stack, each layer's window
# and RoPE table chosen from arrays beside its weights; "unrolled" runs the blocks' layers
# as a Python loop, no scan (for tests and measurements).
LAYOUTS = ("blocks", "flat", "unrolled")

# A layer's window when it has none: larger than any context.
NO_WINDOW = 2**30

DTYPES = {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16, torch.float16: jnp.float16}

_GELU_TANH = ("gelu_pytorch_tanh", "gelu", "gelu_new")


@dataclass(frozen=True, slots=True)
class LayerKind:
    """One position of a pattern block: its shapes and attention, static to the step."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    # The window: None reads each layer's from its weights ("window"); NO_WINDOW is none.
    window: int | None
    # Which RoPE table ("global", "local"); None chooses per layer from its weights
    # ("local_rope", 0 or 1).
    rope: str | None
    # Gemma 4: the (stack, position, repeat) of the earlier layer whose cache this layer
    # reads instead of writing its own; values taken from the key projection.
    kv_source: tuple[int, int, int] | None = None
    k_eq_v: bool = False


@dataclass(frozen=True, slots=True)
class StackSpec:
    """A pattern block of layers repeated ``repeats`` times; the stack's layer r * len(
    pattern) + j is position j of repeat r, from checkpoint layer ``first`` on."""

    first: int
    repeats: int
    pattern: tuple[LayerKind, ...]

    @property
    def num_layers(self) -> int:
        return self.repeats * len(self.pattern)


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
    # "llama", or Gemma's "gemma1" / "gemma2" / "gemma3" / "gemma4": a GeGLU MLP, the
    # embedding scaled by sqrt(hidden); Gemma 1 has Llama's two norms a layer, the later
    # Gemmas a norm after attention and around the MLP besides, Gemma 3 and 4 q/k norms;
    # Gemma 1 to 3's norms scale by (1 + w), Gemma 4's by w, with a value norm and
    # per-layer inputs besides.
    family: str = "llama"
    per_layer_size: int = 0  # Gemma 4's per-layer input width (0: none)
    qkv_bias: bool = False
    o_bias: bool = False
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None  # scores soft-capped at this (None: not)
    final_softcap: float | None = None  # the logits likewise
    unrolled: bool = False

    @property
    def gemma(self) -> bool:
        return self.family != "llama"

    @property
    def post_norms(self) -> bool:
        """Norms after attention and around the MLP (every Gemma but Gemma 1)."""
        return self.gemma and self.family != "gemma1"

    @property
    def qk_norm(self) -> bool:
        return self.family in ("gemma3", "gemma4")


def gemma_layer_types(config: ModelConfig) -> list[str]:
    """A Gemma's layer types, "sliding_attention" or "full_attention", one a layer."""
    return layer_types(config.hf_config, _SLIDING_EVERY[config.architecture])


def check_supported(config: ModelConfig) -> None:
    """Raise ``ValueError`` naming what the JAX backend cannot run of this model."""
    cfg = config.hf_config
    arch = config.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"--model-impl jax runs {', '.join(SUPPORTED_ARCHITECTURES)}; not "
                         f"{arch}. Use --model-impl torch.")
    if config.gguf_file is not None and arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"--model-impl jax loads {', '.join(GGUF_ARCHITECTURES)} from GGUF "
                         f"files; {config.gguf_file} holds {arch}. Use --model-impl torch.")
    if arch in GEMMA_FAMILY:
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in _GELU_TANH:
            raise ValueError(f"--model-impl jax: hidden activation {act!r} is not supported "
                             "for Gemma (gelu_pytorch_tanh only).")
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("--model-impl jax: bidirectional attention is not supported.")
        if arch == "Gemma4ForCausalLM":
            if cfg.get("enable_moe_block"):
                raise ValueError("--model-impl jax does not run Gemma 4's MoE block "
                                 "(enable_moe_block) yet; use --model-impl torch.")
            if cfg.get("attention_bias"):
                raise ValueError("--model-impl jax: Gemma 4 attention biases are not "
                                 "supported.")
            for t in set(layer_types(cfg, 6)):
                rope_type_of({"rope_parameters": _gemma4_rope(cfg, t)})
            return
        for t in set(gemma_layer_types(config)):
            layer_rope_parameters(cfg, t)  # raises for a rope scaling rvllm does not know
        return
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"--model-impl jax: hidden_act {act!r} is not supported (silu only).")
    if cfg.get("mlp_bias"):
        raise ValueError("--model-impl jax: MLP biases (mlp_bias) are not supported yet.")
    rope_parameters(cfg)  # raises for a rope scaling rvllm does not know


def _gemma4_rope(cfg: dict[str, Any], layer_type: str) -> dict[str, Any]:
    return (cfg.get("rope_parameters") or {}).get(layer_type, {"rope_type": "default"})


def pattern_period(types: list[Any]) -> int:
    """The shortest block that, repeated, gives ``types`` (its last repeat may be cut)."""
    n = len(types)
    return next(p for p in range(1, n + 1) if all(types[i] == types[i - p] for i in range(p, n)))


def model_spec(config: ModelConfig, layout: str = "blocks") -> ModelSpec:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, not {layout!r}")
    cfg = config.hf_config
    n = config.num_layers
    gemma = config.architecture in GEMMA_FAMILY

    def kind(window: int | None, rope: str | None) -> LayerKind:
        return LayerKind(config.num_heads, config.num_kv_heads, config.head_dim,
                         cfg["intermediate_size"], window, rope)

    if config.architecture == "Gemma4ForCausalLM":
        stacks = _gemma4_stacks(config, layout)
    elif not gemma or layout == "flat":
        # One stack of every layer, windows (and Gemma's RoPE tables) read per layer.
        stacks: tuple[StackSpec, ...] = (StackSpec(0, n, (kind(None, None if gemma
                                                                else "global"),)),)
    else:
        stacks = _pattern_stacks([kind(layer_window(cfg, t) or NO_WINDOW, _rope_name(t))
                                  for t in gemma_layer_types(config)], 0)
    model_type = cfg.get("model_type")
    attention_bias = bool(cfg.get("attention_bias", False))
    common = dict(
        hidden_size=config.hidden_size, vocab_size=config.vocab_size,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        stacks=stacks, full_precision=config.dtype == torch.float32,
        unrolled=layout == "unrolled",
    )
    if config.architecture == "Gemma4ForCausalLM":
        # Scores are not scaled (the q/k norms do it), nor soft-capped.
        return ModelSpec(**common, tied_embeddings=bool(cfg.get("tie_word_embeddings", True)),
                         family="gemma4", attn_scale=1.0,
                         per_layer_size=cfg.get("hidden_size_per_layer_input") or 0,
                         final_softcap=cfg.get("final_logit_softcapping") or None)
    if gemma:
        family = _GEMMA_FAMILIES[config.architecture]
        # Gemma 1 scales scores by head_dim; Gemma 2 and 3 by query_pre_attn_scalar.
        scalar = (family != "gemma1" and cfg.get("query_pre_attn_scalar")) or config.head_dim
        # transformers' Gemma 3 keeps attn_logit_softcapping in its config but never
        # applies it (the released configs have none); Gemma 1 has neither cap.
        attn_cap = cfg.get("attn_logit_softcapping") if family == "gemma2" else None
        final_cap = cfg.get("final_logit_softcapping") if family != "gemma1" else None
        return ModelSpec(**common, tied_embeddings=bool(cfg.get("tie_word_embeddings", True)),
                         family=family, qkv_bias=attention_bias, o_bias=attention_bias,
                         attn_scale=float(scalar) ** -0.5,
                         attn_softcap=float(attn_cap) if attn_cap else None,
                         final_softcap=float(final_cap) if final_cap else None)
    return ModelSpec(
        **common, tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        # Qwen2 has q/k/v biases and none on o_proj; Llama's attention_bias covers all four.
        qkv_bias=attention_bias or model_type == "qwen2",
        o_bias=attention_bias and model_type != "qwen2",
    )


def _rope_name(layer_type: str) -> str:
    return "local" if layer_type == "sliding_attention" else "global"


def _pattern_stacks(kinds: list[LayerKind], first: int) -> tuple[StackSpec, ...]:
    """Layers ``first``, ``first + 1``, ... of these kinds as a stack of their shortest
    repeating block, and one of the layers left after its last whole repeat."""
    if not kinds:
        return ()
    n, period = len(kinds), pattern_period(kinds)
    stacks = (StackSpec(first, n // period, tuple(kinds[:period])),)
    if n % period:
        stacks += (StackSpec(first + n - n % period, 1, tuple(kinds[:n % period])),)
    return stacks


def _gemma4_stacks(config: ModelConfig, layout: str) -> tuple[StackSpec, ...]:
    """Gemma 4's layers before the KV-sharing ones as pattern blocks, then the sharing
    ones, each kind naming the (stack, position, repeat) of the layer whose cache it
    reads."""
    if layout == "flat":
        raise ValueError("Gemma 4's layers are not all of one shape: no flat layout.")
    cfg = config.hf_config
    types = layer_types(cfg, 6)
    n = len(types)
    producers = kv_producers(types, cfg.get("num_kv_shared_layers") or 0)
    first_shared = next((i for i, p in enumerate(producers) if p is not None), n)

    def kind(i: int, kv_source: tuple[int, int, int] | None = None) -> LayerKind:
        t = types[i]
        head_dim, kv_heads = layer_geometry(cfg, i, t)
        inter = cfg["intermediate_size"]
        if kv_source is not None and cfg.get("use_double_wide_mlp"):
            inter *= 2
        return LayerKind(config.num_heads, kv_heads, head_dim, inter,
                         layer_window(cfg, t) or NO_WINDOW, _rope_name(t), kv_source,
                         bool(cfg.get("attention_k_eq_v")) and t == "full_attention")

    stacks = _pattern_stacks([kind(i) for i in range(first_shared)], 0)

    def location(layer: int) -> tuple[int, int, int]:
        for s, stack in enumerate(stacks):
            if stack.first <= layer < stack.first + stack.num_layers:
                r, j = divmod(layer - stack.first, len(stack.pattern))
                return s, j, r
        raise AssertionError(layer)

    shared = [kind(i, location(producers[i])) for i in range(first_shared, n)]  # type: ignore[arg-type]
    return stacks + _pattern_stacks(shared, first_shared)


def rope_table(head_dim: int, params: dict[str, Any], positions: int,
               always_scaled: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of every position below ``positions`` (float32, [P, head_dim]), as the
    torch backend's ``layers.rotary`` builds them (YaRN's factor on both), or with
    ``always_scaled`` as its ``layers.rotary_scaled`` does (Gemma 4's proportional RoPE)."""
    scale = 1.0
    if params["rope_type"] == "yarn" or always_scaled:
        freqs_inv, scale = inv_freq_and_scale(head_dim, params, positions, positions)
    else:
        freqs_inv = inv_freq(head_dim, params)
    freqs = torch.outer(torch.arange(positions, dtype=torch.float32), freqs_inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scale).numpy(), (emb.sin() * scale).numpy()


def rope_tables(config: ModelConfig) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """The model's RoPE tables by name: "global" (every layer of the Llama family, Gemma's
    global layers) and Gemma's "local" (its sliding layers)."""
    cfg, positions = config.hf_config, config.max_model_len
    if config.architecture == "Gemma4ForCausalLM":
        types = layer_types(cfg, 6)
        tables = {}
        for t in set(types):  # each type's head size is its own
            head_dim = layer_geometry(cfg, types.index(t), t)[0]
            params = rope_type_of({"rope_parameters": _gemma4_rope(cfg, t)})
            tables[_rope_name(t)] = rope_table(head_dim, params, positions, always_scaled=True)
        return tables
    if config.architecture not in GEMMA_FAMILY:
        return {"global": rope_table(config.head_dim, rope_parameters(cfg), positions)}
    return {name: rope_table(config.head_dim, layer_rope_parameters(cfg, t), positions)
            for name, t in (("global", "full_attention"), ("local", "sliding_attention"))}


def _llama_layer(take: Any, p: str, spec: ModelSpec) -> dict[str, np.ndarray]:
    parts = {
        "input_norm": take(p + "input_layernorm.weight"),
        "post_norm": take(p + "post_attention_layernorm.weight"),
        "qkv": np.concatenate([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]).T,
        "o": take(p + "self_attn.o_proj.weight").T,
        "gate_up": np.concatenate([take(p + "mlp.gate_proj.weight"),
                                   take(p + "mlp.up_proj.weight")]).T,
        "down": take(p + "mlp.down_proj.weight").T,
    }
    if spec.qkv_bias:
        parts["qkv_bias"] = np.concatenate([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
    if spec.o_bias:
        parts["o_bias"] = take(p + "self_attn.o_proj.bias")
    return parts


def _gemma_layer(take: Any, p: str, spec: ModelSpec) -> dict[str, np.ndarray]:
    """Gemma 1's layer is Llama's (its post_norm the norm before the MLP); Gemma 2 adds
    the norms around the MLP, Gemma 3 the q/k norms."""
    parts = _llama_layer(take, p, spec)
    if spec.post_norms:
        parts["pre_ffn_norm"] = take(p + "pre_feedforward_layernorm.weight")
        parts["post_ffn_norm"] = take(p + "post_feedforward_layernorm.weight")
    if spec.qk_norm:
        parts["q_norm"] = take(p + "self_attn.q_norm.weight")
        parts["k_norm"] = take(p + "self_attn.k_norm.weight")
    return parts


def _gemma4_layer(take: Any, p: str, kind: LayerKind) -> dict[str, np.ndarray]:
    parts = {
        "input_norm": take(p + "input_layernorm.weight"),
        "post_norm": take(p + "post_attention_layernorm.weight"),
        "pre_ffn_norm": take(p + "pre_feedforward_layernorm.weight"),
        "post_ffn_norm": take(p + "post_feedforward_layernorm.weight"),
        "q": take(p + "self_attn.q_proj.weight").T,
        "q_norm": take(p + "self_attn.q_norm.weight"),
        "o": take(p + "self_attn.o_proj.weight").T,
        "gate_up": np.concatenate([take(p + "mlp.gate_proj.weight"),
                                   take(p + "mlp.up_proj.weight")]).T,
        "down": take(p + "mlp.down_proj.weight").T,
        "layer_scalar": take(p + "layer_scalar"),
    }
    if kind.kv_source is None:
        names = "k" if kind.k_eq_v else "kv"
        parts["kv"] = np.concatenate([take(p + f"self_attn.{n}_proj.weight") for n in names]).T
        parts["k_norm"] = take(p + "self_attn.k_norm.weight")
    if p + "per_layer_input_gate.weight" in take.names:
        parts["ple_gate"] = take(p + "per_layer_input_gate.weight").T
        parts["ple_proj"] = take(p + "per_layer_projection.weight").T
        parts["ple_norm"] = take(p + "post_per_layer_input_norm.weight")
    return parts


def checkpoint_tensors(config: ModelConfig, progress: bool = False
                       ) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint by its Hugging Face name, so one loader serves both
    kinds of file: a safetensors checkpoint's as stored, a GGUF file's dequantized to
    float32 with what llama.cpp's converter changed undone (the Llama q/k row order,
    Gemma's norm + 1). A GGUF file's quantized weights are never kept packed here: the
    JAX step computes on plain arrays in the model's dtype."""
    if config.gguf_file is not None:
        # Without keep_packed every weight comes back a torch tensor, none as its blocks.
        return iter_gguf_tensors(config.gguf_file, torch.float32)  # type: ignore[return-value]
    return iter_safetensors(safetensors_files(Path(config.path)), progress)


def load_weights(config: ModelConfig, device: jax.Device, progress: bool = False,
                 layout: str = "blocks", quantization: str | None = None
                 ) -> tuple[ModelSpec, dict[str, Any]]:
    """The checkpoint's weights (safetensors or a GGUF file), stacked, on ``device`` in the
    model's dtype; with ``quantization`` (``int8``, ``int4``: ``rvllm.jax.quant``) the
    layers' linear weights as integer values and their scales."""
    check_supported(config)
    if quantization not in (None, *QUANTIZATIONS):
        raise ValueError(f"--model-impl jax quantizes weights to {', '.join(QUANTIZATIONS)}; "
                         f"not {quantization}.")
    spec = model_spec(config, layout)
    np_dtype = np.dtype(DTYPES[config.dtype])
    flat: dict[str, np.ndarray] = {}
    for name, tensor in checkpoint_tensors(config, progress):
        flat[name] = tensor.to(torch.float32).numpy().astype(np_dtype)

    def take(name: str) -> np.ndarray:
        if name not in flat:
            raise ValueError(f"{config.path}: the checkpoint has no weight {name!r}.")
        return flat.pop(name)

    take.names = flat  # type: ignore[attr-defined]

    cfg = config.hf_config
    if spec.gemma:
        types = gemma_layer_types(config)
        windows = [layer_window(cfg, t) for t in types]
    else:
        types, windows = [], layer_windows(cfg)
    read_layer = _gemma_layer if spec.gemma else _llama_layer
    put = lambda a: jax.device_put(a, device)  # noqa: E731
    stacks = []
    for stack in spec.stacks:
        positions = []
        for j, kind in enumerate(stack.pattern):
            arrays: dict[str, list[np.ndarray]] = {}
            for r in range(stack.repeats):
                i = stack.first + r * len(stack.pattern) + j
                if spec.family == "gemma4":
                    parts = _gemma4_layer(take, f"model.layers.{i}.", kind)
                else:
                    parts = read_layer(take, f"model.layers.{i}.", spec)
                if kind.window is None:
                    parts["window"] = np.int32(NO_WINDOW if windows[i] is None else windows[i])
                if kind.rope is None:
                    parts["local_rope"] = np.int32(types[i] == "sliding_attention")
                for key, value in quantize_layer(parts, quantization).items():
                    arrays.setdefault(key, []).append(value)
            # A quantized weight's dict stacks leaf by leaf.
            positions.append({key: jax.tree.map(lambda *v: put(np.stack(v)), *values)
                              for key, values in arrays.items()})
        stacks.append(positions)
    weights: dict[str, Any] = {
        "embed": put(take("model.embed_tokens.weight")),
        "final_norm": put(take("model.norm.weight")),
        "rope": {name: {"cos": put(cos), "sin": put(sin)}
                 for name, (cos, sin) in rope_tables(config).items()},
        "stacks": stacks,
    }
    if spec.per_layer_size:
        weights["ple_embed"] = put(take("model.embed_tokens_per_layer.weight"))
        weights["ple_model_proj"] = put(take("model.per_layer_model_projection.weight").T)
        weights["ple_proj_norm"] = put(take("model.per_layer_projection_norm.weight"))
    if not spec.tied_embeddings:
        weights["lm_head"] = put(take("lm_head.weight"))
    return spec, weights
