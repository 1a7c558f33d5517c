"""Engine configuration: what model, how much cache, how to schedule."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads on first use, so `rvllm --help` stays fast
    import torch

_DTYPES = {
    "float32": "float32",
    "float": "float32",
    "float16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
}


def resolve_device(device: str) -> torch.device:
    """``auto`` picks CUDA when present, else the CPU."""
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``auto`` is float32 on the CPU (no fast bf16 there) and bfloat16 on a GPU."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}.")
    return getattr(torch, _DTYPES[dtype])


KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3")


def resolve_kv_cache_dtype(name: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """``--kv-cache-dtype``: ``auto`` stores keys and values in the compute dtype;
    ``bfloat16`` stores them rounded to bfloat16 while attention still computes in the
    compute dtype: half a float32 cache's bytes, so twice the tokens in
    ``--kv-cache-memory`` and half the memory traffic of decode attention. A GPU takes
    only its compute dtype (its kernels read the cache as such), or ``fp8`` (alias
    ``fp8_e4m3``, vLLM's names): float8 E4M3 with a scale per layer for the keys and one
    for the values (``kernels.triton.kv_fp8``), half a bfloat16 cache's bytes, read by the
    Triton kernels; the CPU has no FP8 path."""
    import torch

    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; "
                         f"got {name!r}.")
    if name == "auto":
        return dtype
    if name in ("fp8", "fp8_e4m3"):
        if device.type != "cuda":
            raise ValueError("fp8 KV cache needs a CUDA GPU; on the CPU use bfloat16 (there "
                             "kv_cache_dtype must be one of auto, bfloat16).")
        return torch.float8_e4m3fn
    kv_dtype = getattr(torch, name)
    if device.type != "cpu" and kv_dtype != dtype:
        raise ValueError(f"kv_cache_dtype={name} with a {str(dtype).removeprefix('torch.')} "
                         f"model runs on the CPU only; on a GPU use --dtype {name} instead.")
    return kv_dtype


@dataclass(slots=True)
class ModelConfig:
    """The model's shape, read from a Hugging Face ``config.json`` (or a GGUF header)."""

    path: str
    hf_config: dict[str, Any]
    architecture: str
    dtype: torch.dtype
    max_model_len: int
    gguf_file: str | None = None
    generation_config: dict[str, Any] = field(default_factory=dict)

    @property
    def hidden_size(self) -> int:
        return self.hf_config["hidden_size"]

    @property
    def num_layers(self) -> int:
        return self.hf_config["num_hidden_layers"]

    @property
    def num_heads(self) -> int:
        return self.hf_config["num_attention_heads"]

    @property
    def num_kv_heads(self) -> int:
        return self.hf_config.get("num_key_value_heads") or self.num_heads

    @property
    def head_dim(self) -> int:
        return self.hf_config.get("head_dim") or self.hidden_size // self.num_heads

    @property
    def kv_elements_per_token(self) -> int:
        """Cache elements one token takes in one layer (the largest layer where they differ):
        its keys and values, or for multi-head latent attention (DeepSeek-V2) the one
        compressed latent and rope key."""
        cfg = self.hf_config
        if cfg.get("kv_lora_rank"):
            return cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
        # Gemma 4's global layers have their own head size and KV heads: size for the larger.
        per_layer = [(self.num_kv_heads, self.head_dim)] + [
            (o.get("num_key_value_heads", self.num_kv_heads), o.get("head_dim", self.head_dim))
            for o in (cfg.get("per_layer_config") or {}).values()
        ]
        if cfg.get("global_head_dim"):
            per_layer.append((cfg.get("num_global_key_value_heads") or self.num_kv_heads,
                              cfg["global_head_dim"]))
        return 2 * max(heads * dim for heads, dim in per_layer)

    @property
    def vocab_size(self) -> int:
        return self.hf_config["vocab_size"]

    @classmethod
    def from_path(
        cls, model: str, dtype: torch.dtype, max_model_len: int | None = None
    ) -> ModelConfig:
        """Read the config of a Hugging Face directory or a GGUF file (or a folder holding one)."""
        from rvllm.models.default_model import resolve_gguf_path
        from rvllm.models.registry import check_architecture

        path = Path(model)
        if not path.exists():
            raise FileNotFoundError(f"Model path {model!r} does not exist.")
        gguf_path = resolve_gguf_path(str(path))
        generation_config: dict[str, Any] = {}
        if gguf_path is not None:
            from rvllm.models.gguf_loader import load_gguf_config

            hf_config = load_gguf_config(gguf_path)
            gguf_file = str(gguf_path)
        else:
            hf_config = _read_json(path / "config.json", required=True)
            generation_config = _read_json(path / "generation_config.json", required=False)
            gguf_file = None
        archs = hf_config.get("architectures") or []
        if not archs:
            raise ValueError(f"{path}: config.json names no 'architectures'.")
        architecture = check_architecture(archs[0])
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            if not isinstance(hf_config.get(key), int) or hf_config[key] <= 0:
                raise ValueError(f"{path}: config field {key!r} must be a positive integer.")
        derived = _derived_max_len(hf_config)
        if max_model_len is None:
            max_model_len = derived
        elif max_model_len > derived:
            raise ValueError(
                f"max_model_len={max_model_len} is larger than the model's maximum "
                f"context of {derived} tokens."
            )
        return cls(
            path=str(path),
            hf_config=hf_config,
            architecture=architecture,
            dtype=dtype,
            max_model_len=max_model_len,
            gguf_file=gguf_file,
            generation_config=generation_config,
        )


def _derived_max_len(hf_config: dict[str, Any]) -> int:
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        if isinstance(hf_config.get(key), int):
            return hf_config[key]
    return 2048


def _read_json(path: Path, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise FileNotFoundError(
                f"{path} not found: a model directory needs config.json and *.safetensors "
                "(or pass a .gguf file)."
            )
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


@dataclass(slots=True)
class CacheConfig:
    """The paged KV cache: block size and how many blocks."""

    block_size: int = 16
    num_gpu_blocks: int | None = None
    kv_cache_memory_gb: float = 2.0
    cache_dtype: torch.dtype | None = None  # keys and values stored as (None: the model's)
    gpu_memory_utilization: float = 0.9
    gpu_memory_reserve_gb: float = 0.0
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two up to 128, got {self.block_size}.")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 1:
            raise ValueError(f"num_gpu_blocks must be at least 1, got {self.num_gpu_blocks}.")
        if self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory_gb}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}."
            )
        if self.gpu_memory_reserve_gb < 0:
            raise ValueError(
                f"gpu_memory_reserve_gb must be >= 0, got {self.gpu_memory_reserve_gb}."
            )


SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(slots=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    num_scheduler_steps: int = 1  # decode steps a batch of greedy decodes may run ahead
    # fcfs: first come, first served; priority: by each request's priority, then arrival.
    policy: str = "fcfs"
    # The most LoRA adapters one step may run (--max-loras); 0: no adapters.
    max_loras: int = 0

    def __post_init__(self) -> None:
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of "
                             f"{', '.join(SCHEDULING_POLICIES)}; got {self.policy!r}.")
        if self.num_scheduler_steps < 1:
            raise ValueError(
                f"num_scheduler_steps must be at least 1, got {self.num_scheduler_steps}.")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}."
            )


# What --model-impl may name: auto (= torch), torch, jax.
MODEL_IMPLS = ("auto", "torch", "jax")
# What --jax-platform may name: the JAX backend's devices.
JAX_PLATFORMS = ("cpu", "gpu", "tpu")

# Grammar engines structured output may run on; auto = guidance (llguidance).
STRUCTURED_OUTPUT_BACKENDS = ("auto", "guidance", "xgrammar")


@dataclass(slots=True)
class StructuredOutputsConfig:
    """``--structured-outputs-config``: the grammar engine behind structured output
    (``auto`` = llguidance, ``guidance``, ``xgrammar``) and engine-wide JSON defaults."""

    backend: str = "auto"
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    @classmethod
    def parse(cls, value: StructuredOutputsConfig | dict | str | None
              ) -> StructuredOutputsConfig:
        """From a JSON text (the flag), a dict (``LLM(structured_outputs_config=...)``)
        or None; ValueError names what is wrong."""
        if value is None or isinstance(value, cls):
            return value or cls()
        from rvllm.json_options import json_options

        config = cls(**json_options(value, "structured_outputs_config", cls.__slots__))
        if config.backend not in STRUCTURED_OUTPUT_BACKENDS:
            raise ValueError(f"structured_outputs_config backend {config.backend!r} is not "
                             f"one of {', '.join(STRUCTURED_OUTPUT_BACKENDS)}.")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(config, name), bool):
                raise ValueError(f"structured_outputs_config {name} must be true or false.")
        return config


@dataclass(slots=True)
class EngineArgs:
    """Everything a user may set when building an engine (CLI flags map one to one)."""

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    block_size: int = 16
    num_gpu_blocks: int | None = None
    kv_cache_memory: float = 2.0
    kv_cache_dtype: str = "auto"  # auto (the compute dtype) | bfloat16
    gpu_memory_utilization: float = 0.9
    gpu_memory_reserve_gb: float = 0.0
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    scheduling_policy: str = "fcfs"  # fcfs | priority (each request's priority, then arrival)
    enable_chunked_prefill: bool = True
    # Greedy decode steps one engine step may run in one compiled call (CPU, numba
    # kernels): the engine's Python once per this many tokens (kernels.cpu.decode_steps).
    num_scheduler_steps: int = 1
    # Schedule step t + 1 while step t runs, on a thread of its own (engine.async_steps).
    async_scheduling: bool = False
    seed: int = 0
    chat_template: str | None = None
    show_progress: bool = False
    num_cpu_blocks: int = 0  # CPU swap space, in blocks
    preemption_mode: str | None = None  # recompute | swap (default: swap when swap space exists)
    load_format: str = "auto"  # auto | safetensors | gguf | dummy (random weights)
    skip_tokenizer_init: bool = False
    kernel_backend: str = "auto"  # auto | torch | triton | numba (see layers.backend)
    enforce_eager: bool = False  # no CUDA graphs for decode
    # Steps of up to 4 tokens fold RMSNorm and SiLU * mul into the GEMVs (Triton path).
    fused_decode_gemv: bool = False
    cuda_graph_sizes: str | None = None  # "1,2,4,8,..." (default: 1, 2, 4, 8, every 8)
    cpu_linear_backend: str = "auto"  # auto | onednn | torch (float32 linear layers on CPU)
    # Pack the float32 linear weights for oneDNN after start-up, between (and a layer per)
    # steps, instead of before the engine is up: `rvllm serve` answers sooner (see
    # LLMEngine.idle_work). Off for LLM(...) and the benchmarks, which want them packed.
    defer_weight_packing: bool = False
    quantization: str | None = None  # int8: int8 weights, dynamic int8 activations (CPU)
    # What packed weights (GGUF blocks, int4) multiply: x rounded per block of 32 to 16
    # bits (int16), or to 8 (int8: llama.cpp's, half the byte products, lossy).
    packed_activations: str = "int16"
    tensor_parallel_size: int = 1
    distributed_executor_backend: str = "mp"
    # The grammar engine and JSON defaults of structured output (a dict or JSON text is
    # parsed into StructuredOutputsConfig).
    structured_outputs_config: StructuredOutputsConfig | dict | str | None = None
    # Request defaults from the model's generation_config.json (auto), a folder's, or
    # none (vllm); and keys set on top of them (a dict or JSON text). generation_config.py
    generation_config: str = "auto"
    # The most logprobs (and prompt_logprobs) a request may ask for; -1: the vocabulary.
    max_logprobs: int = 20
    override_generation_config: dict | str | None = None

    # Speculative decoding (vLLM's JSON; a dict or JSON text is parsed into
    # spec_decode.config.SpeculativeConfig). None: off.
    speculative_config: Any = None
    # Which implementation runs the model (vLLM's --model-impl): auto and torch = rvllm's
    # torch modules; jax = the JAX backend (rvllm.jax, the optional jax extra).
    model_impl: str = "auto"
    # The JAX backend's devices: cpu, gpu or tpu; None follows --device (cpu or cuda). On
    # a TPU VM the engine's own tensors (the sampler's) stay on the CPU.
    jax_platform: str | None = None
    # LoRA adapters (vLLM's --enable-lora): requests may name one (rvllm.lora); at most
    # max_loras of them in one step, each of rank at most max_lora_rank.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    # Adapters kept loaded, least recently used dropped first (None: max_loras).
    max_cpu_loras: int | None = None
    # What the model runs as (vLLM's --runner, --convert): generate (text), or pooling
    # (embeddings: --runner pooling or --convert embed); pooling_params.resolve_runner.
    runner: str = "auto"
    convert: str = "auto"
    # The pooler of a pooling model (a dict or JSON text: pooling_type, normalize), over
    # the model's own (pooling_params.PoolerConfig).
    pooler_config: dict | str | None = None

    def __post_init__(self) -> None:
        self.structured_outputs_config = StructuredOutputsConfig.parse(
            self.structured_outputs_config)
        from rvllm.generation_config import parse_override
        from rvllm.spec_decode.config import SpeculativeConfig

        self.override_generation_config = parse_override(self.override_generation_config)
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) \
                or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be an integer of at least -1 (-1: the whole "
                             f"vocabulary); got {self.max_logprobs!r}.")

        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.pooler_config is not None:
            from rvllm.json_options import json_options
            from rvllm.pooling_params import PoolerConfig

            self.pooler_config = json_options(self.pooler_config, "pooler_config",
                                              PoolerConfig.__slots__)
        self.runner_type()  # ValueError for an unknown --runner or --convert
        if self.model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl must be one of {', '.join(MODEL_IMPLS)}; "
                             f"got {self.model_impl!r}.")
        if self.jax_platform is not None:
            if self.jax_platform not in JAX_PLATFORMS:
                raise ValueError(f"jax_platform must be one of {', '.join(JAX_PLATFORMS)}; "
                                 f"got {self.jax_platform!r}.")
            if self.model_impl != "jax":
                raise ValueError("jax_platform is the JAX backend's: give it with "
                                 "model_impl='jax' (--model-impl jax).")

    def runner_type(self) -> str:
        """What the engine runs the model as: "generate" or "pooling"."""
        from rvllm.pooling_params import resolve_runner

        return resolve_runner(self.runner, self.convert)

    def sampling_defaults(self) -> dict[str, Any]:
        """What requests that leave a sampling field unset get
        (``generation_config.sampling_defaults``)."""
        from rvllm.generation_config import sampling_defaults

        return sampling_defaults(self.resolve_model(), self.generation_config,
                                 self.override_generation_config)

    def resolve_model(self) -> str:
        if self.model:
            return os.path.expanduser(self.model)
        from rvllm.models.default_model import default_model_path

        return str(default_model_path())
