"""Flags shared by the commands, with vLLM's names: the engine's, and the sampling ones of
`rvllm generate` and `rvllm chat`."""

from __future__ import annotations

import argparse

from rvllm.config import EngineArgs


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="Hugging Face model directory or .gguf file "
                        "(default: the built-in SmolLM2-135M-Instruct)")
    g.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the model's)")
    g.add_argument("--dtype", default="auto",
                   choices=["auto", "float32", "float16", "bfloat16", "half", "float"],
                   help="compute dtype; auto = float32 on CPU, bfloat16 on GPU")
    g.add_argument("--device", default="auto", help="auto, cpu or cuda")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length (default: the model's)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    g.add_argument("--num-gpu-blocks", type=int, default=None,
                   help="KV-cache blocks (overrides the memory budget)")
    g.add_argument("--kv-cache-memory", type=float, default=2.0,
                   help="GiB of KV cache on the CPU")
    g.add_argument("--kv-cache-dtype", choices=["auto", "bfloat16", "fp8", "fp8_e4m3"],
                   default="auto",
                   help="what the KV cache stores keys and values as: auto = the compute "
                        "dtype; bfloat16 (CPU, float32 models) halves the cache's memory and "
                        "decode attention's reads, attention still computing in float32; "
                        "fp8 (GPU, Triton kernels) E4M3 with a scale per layer")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of GPU memory rvllm may use")
    g.add_argument("--gpu-memory-reserve-gb", type=float, default=0.0,
                   help="GiB of GPU memory always left free (so --gpu-memory-utilization "
                        "1.0 with a reserve is safe)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True, help="reuse KV blocks of shared prompt prefixes")
    g.add_argument("--max-num-seqs", type=int, default=256,
                   help="most sequences in one batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step (default 2048)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=True, help="split long prompts across steps")
    g.add_argument("--num-scheduler-steps", type=int, default=1,
                   help="greedy decode steps one engine step may run in one compiled call "
                        "(CPU, numba kernels; tokens then stream in bursts this long)")
    g.add_argument("--async-scheduling", action="store_true",
                   help="schedule each step and build its inputs while the step before it "
                        "runs, and detokenize behind it (off by default)")
    g.add_argument("--seed", type=int, default=0, help="seed of the default generator")
    g.add_argument("--num-cpu-blocks", type=int, default=0,
                   help="CPU swap space in KV blocks (preempted requests swap out to it)")
    g.add_argument("--preemption-mode", choices=["recompute", "swap"], default=None,
                   help="what preemption does (default: swap when --num-cpu-blocks is set)")
    g.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                   help="dummy: random weights from config.json alone (for benchmarks)")
    g.add_argument("--skip-tokenizer-init", action="store_true",
                   help="no tokenizer: prompts and outputs are token ids")
    g.add_argument("--kernel-backend", choices=["auto", "torch", "triton", "numba"],
                   default="auto",
                   help="triton: fused Triton kernels (norm, RoPE + KV write, paged "
                        "attention, SiLU*mul, greedy sampling), checked at start-up; "
                        "numba: paged decode attention on the CPU (float32); torch: plain "
                        "PyTorch; auto = triton on CUDA, numba on the CPU in float32, else "
                        "torch")
    g.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs: run every decode step eagerly")
    g.add_argument("--fused-decode-gemv", action="store_true",
                   help="steps of up to 4 tokens fold each RMSNorm and SiLU*mul into the "
                        "projection after it, as Triton GEMVs (Llama-shaped models, "
                        "--kernel-backend triton; off by default)")
    g.add_argument("--cuda-graph-sizes", nargs="+", default=None,
                   help="decode batch sizes to capture as CUDA graphs (default 1, 2, 4, 8 "
                        "and every 8 up to --max-num-seqs); larger batches run eagerly")
    g.add_argument("--cpu-linear-backend", choices=["auto", "onednn", "torch"], default="auto",
                   help="float32 linear layers on the CPU: onednn = weights repacked "
                        "(auto, when torch has oneDNN): in panels for the numba kernels, "
                        "else for oneDNN; torch = plain F.linear")
    g.add_argument("--quantization", "-q",
                   choices=["gguf", "int8", "int4", "fp16", "fp8", "awq", "gptq",
                            "compressed-tensors", "none"], default=None,
                   help="weight format, set at load. Unset: a quantized GGUF file runs on "
                        "its own blocks kept packed (gguf; CPU, float32), an AWQ/GPTQ/"
                        "compressed-tensors checkpoint as its config says, anything else "
                        "in --dtype. none = every weight widened to --dtype; int8 = int8 "
                        "per output channel, activations per token (CPU); int4 = 4-bit "
                        "groups made at load (round-to-nearest); fp16 = float16 weights "
                        "computed in float32 (CPU); fp8 = E4M3 weights (GPU)")
    g.add_argument("--packed-activations", choices=["int16", "int8"], default="int16",
                   help="what packed weights (a GGUF file's blocks, int4) multiply on the "
                        "CPU: the activations rounded per block of 32 to 16-bit integers "
                        "(int16: within 2e-5 of float32) or to 8-bit ones (int8, as "
                        "llama.cpp's: about 1.5x the GEMMs' speed for batches and "
                        "prefill, and a lossy change of the logits)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over this many worker processes (one per GPU, "
                        "or per group of CPU cores)")
    g.add_argument("--distributed-executor-backend", choices=["mp", "ray"], default="mp",
                   help="mp: local worker processes; ray: workers placed on a Ray cluster")
    g.add_argument("--model-impl", choices=["auto", "torch", "jax"], default="auto",
                   help="which implementation runs the model: torch = rvllm's own modules "
                        "(auto); jax = one jitted JAX step over stacked weights and a paged "
                        "cache of JAX arrays (Llama, Mistral, Qwen2, Gemma 3, dense Gemma 4; "
                        "pip install 'rvllm[jax]'), the scheduler, sampler and server "
                        "unchanged")
    g.add_argument("--jax-platform", choices=["cpu", "gpu", "tpu"], default=None,
                   help="--model-impl jax's devices (default: --device's, cpu or cuda); tpu "
                        "on a TPU VM with jax[tpu] (the engine's own tensors stay on the "
                        "CPU; give --num-gpu-blocks)")
    g.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (PEFT folders) on top of the model: a request "
                        "names one (--lora-modules, the API's model field, "
                        "LLM.generate(lora_request=...))")
    g.add_argument("--max-loras", type=int, default=1,
                   help="the most LoRA adapters one step runs (default 1)")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="LoRA adapters kept loaded, the least recently used dropped first "
                        "(default: --max-loras)")
    g.add_argument("--max-lora-rank", type=int, default=16,
                   help="the largest LoRA rank an adapter may have (default 16)")
    g.add_argument("--runner", choices=["auto", "generate", "pooling"], default="auto",
                   help="what the model runs as: generate = text (auto); pooling = "
                        "embeddings (/v1/embeddings, LLM.embed), one vector per prompt")
    g.add_argument("--convert", choices=["auto", "none", "embed"], default="auto",
                   help="embed: run a causal LM as an embedding model (implies --runner "
                        "pooling): the final norm's hidden states pooled, L2-normalized")
    g.add_argument("--pooler-config", default=None, metavar="JSON",
                   help='a pooling model\'s pooler, as JSON: {"pooling_type": "LAST" | '
                        '"MEAN" | "CLS", "normalize": true}; default: the model folder\'s '
                        "Sentence Transformers config, else LAST, normalized")
    g.add_argument("--chat-template", default=None,
                   help="chat template (a file or the template text) replacing the model's")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, as JSON: {"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_min": 1, '
                        '"prompt_lookup_max": 4, "disable_by_batch_size": 4}: prompt '
                        "lookup proposes tokens that the model verifies in one step; the "
                        "output is the same as without it")
    g.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                   help="request defaults for the sampling fields a request leaves unset "
                        "(temperature, top_p, top_k, min_p, repetition_penalty; "
                        "max_new_tokens caps max_tokens): auto = the model's "
                        "generation_config.json, vllm = none, or a folder holding one")
    g.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                   help="fcfs: requests in the order they came; priority: by each request's "
                        "priority (lower first), then arrival, and preemption takes the last "
                        "in that order")
    g.add_argument("--max-logprobs", type=int, default=20,
                   help="the most logprobs or prompt_logprobs a request may ask for "
                        "(-1: the whole vocabulary)")
    g.add_argument("--override-generation-config", default=None, metavar="JSON",
                   help='keys set on top of --generation-config, as JSON: '
                        '{"temperature": 0.5}')
    g.add_argument("--structured-outputs-config", default=None, metavar="JSON",
                   help='structured output\'s grammar engine and defaults, as JSON: '
                        '{"backend": "auto" | "guidance" | "xgrammar", '
                        '"disable_any_whitespace": false, "disable_additional_properties": '
                        'false}; auto = guidance (llguidance)')


def engine_args_from_namespace(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(
        model=ns.model,
        tokenizer=ns.tokenizer,
        dtype=ns.dtype,
        device=ns.device,
        max_model_len=ns.max_model_len,
        block_size=ns.block_size,
        num_gpu_blocks=ns.num_gpu_blocks,
        kv_cache_memory=ns.kv_cache_memory,
        kv_cache_dtype=ns.kv_cache_dtype,
        gpu_memory_utilization=ns.gpu_memory_utilization,
        gpu_memory_reserve_gb=ns.gpu_memory_reserve_gb,
        enable_prefix_caching=ns.enable_prefix_caching,
        max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        enable_chunked_prefill=ns.enable_chunked_prefill,
        num_scheduler_steps=ns.num_scheduler_steps,
        async_scheduling=ns.async_scheduling,
        seed=ns.seed,
        chat_template=ns.chat_template,
        num_cpu_blocks=ns.num_cpu_blocks,
        preemption_mode=ns.preemption_mode,
        load_format=ns.load_format,
        skip_tokenizer_init=ns.skip_tokenizer_init,
        kernel_backend=ns.kernel_backend,
        enforce_eager=ns.enforce_eager,
        fused_decode_gemv=ns.fused_decode_gemv,
        cuda_graph_sizes=",".join(ns.cuda_graph_sizes) if ns.cuda_graph_sizes else None,
        cpu_linear_backend=ns.cpu_linear_backend,
        quantization=ns.quantization,
        packed_activations=ns.packed_activations,
        tensor_parallel_size=ns.tensor_parallel_size,
        distributed_executor_backend=ns.distributed_executor_backend,
        structured_outputs_config=ns.structured_outputs_config,
        generation_config=ns.generation_config,
        max_logprobs=ns.max_logprobs,
        scheduling_policy=ns.scheduling_policy,
        override_generation_config=ns.override_generation_config,
        speculative_config=ns.speculative_config,
        model_impl=ns.model_impl,
        jax_platform=ns.jax_platform,
        enable_lora=ns.enable_lora,
        max_loras=ns.max_loras,
        max_lora_rank=ns.max_lora_rank,
        max_cpu_loras=ns.max_cpu_loras,
        runner=ns.runner,
        convert=ns.convert,
        pooler_config=ns.pooler_config,
        show_progress=True,
    )


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="seed of this request")


def sampling_params_from(ns: argparse.Namespace):  # noqa: ANN201 - SamplingParams
    from rvllm.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k,
        min_p=ns.min_p, repetition_penalty=ns.repetition_penalty, seed=ns.sampling_seed,
    )
