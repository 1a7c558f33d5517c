"""The JAX backend (``--model-impl jax``) generates exactly what transformers generates in
float32 under greedy decoding, however the engine batches, chunks, shares prefixes or
preempts; after its start-up compilation a step compiles nothing; and its step updates the
paged cache in place."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
import torch
from conftest import hf_greedy

from rvllm import LLM, SamplingParams

# JAX is imported by the first engine that asks for it, not at collection.
pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(importlib.util.find_spec("jax") is None,
                                 reason="the jax extra is not installed")]

NEW_TOKENS = 12
PROMPT_LENS = (1, 3, 7, 16, 17, 31, 48, 70)
# Small step buckets, so each engine compiles 12 shapes: tokens 8, 16, 32 by sequences 1,
# 2, 4, and decodes alone of 1, 2 and 4 sequences. The 48- and 70-token prompts are
# prefilled in chunks beside the others' decodes.
ENGINE = dict(model_impl="jax", block_size=8, max_model_len=128, max_num_batched_tokens=32,
              max_num_seqs=4)


def make_prompts(seed: int = 1, lens: tuple[int, ...] = PROMPT_LENS) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 400, (n,), generator=g).tolist() for n in lens]


@cache
def reference(model_dir: Path, seed: int = 1, lens: tuple[int, ...] = PROMPT_LENS
              ) -> list[list[int]]:
    return hf_greedy(model_dir, make_prompts(seed, lens), NEW_TOKENS)


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def llama_jax(llama_dir: Path) -> LLM:
    return LLM(str(llama_dir), num_gpu_blocks=64, **ENGINE)


def test_a_single_request_matches_transformers(llama_jax: LLM, llama_dir: Path) -> None:
    assert greedy(llama_jax, make_prompts(2, (20,))) == reference(llama_dir, 2, (20,))


def test_a_mixed_batch_with_chunked_prefill_matches_transformers(llama_jax: LLM,
                                                                 llama_dir: Path) -> None:
    assert greedy(llama_jax, make_prompts()) == reference(llama_dir)


def test_prefix_cache_hits_match_transformers(llama_jax: LLM, llama_dir: Path) -> None:
    shared = make_prompts(seed=7, lens=(40,))[0]
    prompts = [shared + tail for tail in make_prompts(seed=8, lens=(1, 5, 9, 20))]
    expected = hf_greedy(llama_dir, prompts, NEW_TOKENS)
    assert greedy(llama_jax, prompts[:1]) == expected[:1]
    outs = llama_jax.generate(prompts[1:], SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                          ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected[1:]
    assert all(o.num_cached_tokens == 40 for o in outs)


def test_preemption_by_recompute_matches_transformers(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), num_gpu_blocks=16, **ENGINE)
    assert greedy(llm, make_prompts()) == reference(llama_dir)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == 16


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_qwen2_biases_and_mistral_windows_match_transformers(model_dirs: dict[str, Path],
                                                              arch: str) -> None:
    # Qwen2: q/k/v biases and tied embeddings; Mistral: a 24-token sliding window, which
    # the 31-, 48- and 70-token prompts pass.
    llm = LLM(str(model_dirs[arch]), num_gpu_blocks=64, **ENGINE)
    assert greedy(llm, make_prompts()) == reference(model_dirs[arch])


def test_after_warm_up_no_step_compiles(llama_jax: LLM, llama_dir: Path) -> None:
    from rvllm.jax.model import compile_count, jitted_step

    runner = llama_jax.engine.runner
    assert len(runner.bucket_shapes()) == 12 and runner.compiles_after_warm_up is not None
    before, cached = compile_count(), jitted_step._cache_size()
    # Replayed requests and new ones: every step shape was compiled at start-up.
    assert greedy(llama_jax, make_prompts()) == reference(llama_dir)
    greedy(llama_jax, make_prompts(seed=5, lens=(2, 9, 33, 64, 5)))
    assert compile_count() == before and jitted_step._cache_size() == cached
    # The guard sees a compilation: 40 prompt-logprob rows need a 64-row logits shape.
    llama_jax.generate(make_prompts(seed=6, lens=(40,)),
                       SamplingParams(max_tokens=1, prompt_logprobs=1))
    assert compile_count() > before


def test_the_step_updates_the_cache_in_place(llama_dir: Path) -> None:
    from rvllm.config import ModelConfig, SchedulerConfig
    from rvllm.jax import cache as kv_cache
    from rvllm.jax.model import jitted_step
    from rvllm.jax.runner import JaxModelRunner

    config = ModelConfig.from_path(str(llama_dir), torch.float32, 128)
    runner = JaxModelRunner(config, SchedulerConfig(4, 32), 8, torch.device("cpu"))
    # One stack of every layer: [layers, ...] weights, [layers, blocks, block, heads, dim]
    # keys and values.
    (stack,) = runner.weights["stacks"]
    assert stack["qkv"].shape == (2, 64, (4 + 2 + 2) * 16)
    temps = []
    for num_blocks in (1024, 8192):
        runner.allocate_kv_cache(num_blocks, 2, 16, torch.float32, compile_buckets=False)
        assert [c["k"].shape for c in runner.caches] == [(2, num_blocks, 8, 2, 16)]
        cache_bytes = kv_cache.cache_bytes(runner.caches)
        memory = jitted_step.lower(*runner.step_args(32, 4), spec=runner.spec).compile() \
            .memory_analysis()
        # The donated cache is the step's output buffer: updated in place, not copied.
        assert memory.alias_size_in_bytes >= cache_bytes
        temps.append(memory.temp_size_in_bytes)
    # The step's scratch does not grow with the cache, and is a fraction of it.
    assert temps[0] == temps[1] and temps[1] < cache_bytes / 10


def test_unsupported_combinations_are_refused_at_start_up(llama_dir: Path) -> None:
    from rvllm.config import ModelConfig
    from rvllm.jax.weights import check_supported

    with pytest.raises(ValueError, match="recompute|swap"):
        LLM(str(llama_dir), num_cpu_blocks=8, num_gpu_blocks=64, **ENGINE)
    with pytest.raises(ValueError, match="--speculative-config"):
        LLM(str(llama_dir), num_gpu_blocks=64, **ENGINE,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    gemma = ModelConfig(str(llama_dir), {"hidden_size": 64}, "Gemma3ForCausalLM",
                        torch.float32, 128)
    with pytest.raises(ValueError, match="pattern blocks"):
        check_supported(gemma)
    with pytest.raises(ValueError, match="model_impl must be one of"):
        LLM(str(llama_dir), model_impl="flax")


def test_the_flag_keeps_vllms_name() -> None:
    from rvllm.cli import build_parser
    from rvllm.cli_args import engine_args_from_namespace

    ns = build_parser().parse_args(["serve", "--model-impl", "jax"])
    assert engine_args_from_namespace(ns).model_impl == "jax"


IMPORTS = """
import json, sys
import rvllm, rvllm.cli_args, rvllm.engine.llm_engine, rvllm.engine.engine_startup
from rvllm.config import EngineArgs
EngineArgs(model_impl="jax")
print(json.dumps(sorted(m for m in sys.modules if m == "jax" or m.startswith("rvllm.jax"))))
"""


def test_jax_is_imported_only_when_its_backend_is_asked_for() -> None:
    out = subprocess.run([sys.executable, "-c", IMPORTS], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_the_server_serves_through_the_jax_backend(llama_jax: LLM, llama_dir: Path) -> None:
    import httpx
    from server_helpers import ServerProcess

    prompt = make_prompts(9, (11,))[0]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    expected = llama_jax.generate([prompt], params)[0].outputs[0]
    assert expected.token_ids == hf_greedy(llama_dir, [prompt], NEW_TOKENS)[0]
    # One sequence of up to 8 tokens a step: a single step shape to compile.
    server = ServerProcess(llama_dir, "--model-impl=jax", "--max-num-seqs=1",
                           "--max-num-batched-tokens=8", "--num-gpu-blocks=64",
                           "--kernel-backend=torch")
    try:
        r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "model": str(llama_dir), "prompt": prompt, "max_tokens": NEW_TOKENS,
            "temperature": 0, "ignore_eos": True})
    finally:
        server.stop()
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected.text
