"""Weight-only int8 and int4 linear weights under the JAX backend (``--quantization int8``,
``int4`` with ``--model-impl jax``): the layers' linear weights are held on the device as
int8 (per output channel) or int4 (per group of inputs) values with float32 scales, and
widened inside the jitted step; the quantized step computes what the float step computes
on the dequantized weights, its logits stay close to the unquantized model's, int8's
greedy tokens are the torch backend's ``--quantization int8`` tokens, and Gemma 3 and 4
(scanned pattern blocks, per-layer projections) run quantized."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import hf_greedy
from test_jax_gemma import GLOBAL, SLIDING, build_gemma3, build_gemma4

from rvllm import LLM, SamplingParams

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(importlib.util.find_spec("jax") is None,
                                 reason="the jax extra is not installed")]

LINEAR = ("qkv", "q", "kv", "o", "gate_up", "down", "ple_gate", "ple_proj")


def make_prompts(seed: int, lens: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 400, (n,), generator=g).tolist() for n in lens]


def test_quantize_rounds_each_channel_and_group_to_nearest() -> None:
    from rvllm.jax.quant import dequantize, group_size, quantize

    rng = np.random.default_rng(0)
    w = rng.standard_normal((576, 40)).astype(np.float32)
    w[:, 3] = 0.0  # an all-zero channel: scale 1, values 0
    q8 = quantize(w, "int8")
    assert q8["w"].dtype == np.int8 and q8["scale"].shape == (40,)
    assert np.abs(q8["w"][:, [0, 1, 2, 4]]).max(axis=0).tolist() == [127] * 4
    assert not q8["w"][:, 3].any() and q8["scale"][3] == 1.0
    assert np.all(np.abs(dequantize(q8) - w) <= q8["scale"] / 2 + 1e-6)
    # int4: groups of 128 where K allows, else K's largest divisor below 128.
    assert [group_size(k) for k in (64, 128, 576, 1536, 2048)] == [64, 128, 96, 128, 128]
    q4 = quantize(w, "int4")
    assert str(q4["w"].dtype) == "int4" and q4["scale"].shape == (6, 40)
    values = q4["w"].astype(np.int8)
    assert values.min() >= -7 and values.max() <= 7
    err = np.abs(dequantize(q4) - w).reshape(6, 96, 40)
    assert np.all(err <= q4["scale"][:, None, :] / 2 + 1e-6)


def _layer_arrays(weights: dict[str, Any], keys: tuple[str, ...] | None = None) -> list[Any]:
    return [value for stack in weights["stacks"] for layer in stack
            for key, value in layer.items() if keys is None or key in keys]


def test_the_linear_weights_on_the_device_are_int8_and_int4(llama_dir: Path) -> None:
    import jax

    from rvllm.config import ModelConfig
    from rvllm.jax.quant import stacked_bytes
    from rvllm.jax.weights import load_weights

    config = ModelConfig.from_path(str(llama_dir), torch.float32, 128)
    cpu = jax.devices("cpu")[0]
    loaded = {q: load_weights(config, cpu, quantization=q)[1] for q in (None, "int8", "int4")}
    layer = loaded["int8"]["stacks"][0][0]
    assert layer["qkv"]["w"].dtype == np.int8 and layer["qkv"]["w"].shape == (2, 64, 128)
    assert layer["qkv"]["scale"].dtype == np.float32 and layer["qkv"]["scale"].shape == (2, 128)
    layer4 = loaded["int4"]["stacks"][0][0]
    assert str(layer4["down"]["w"].dtype) == "int4" and layer4["down"]["scale"].shape == (2, 1, 64)
    for weights in (loaded["int8"], loaded["int4"]):  # the rest stays float32
        assert weights["embed"].dtype == np.float32 and weights["lm_head"].dtype == np.float32
        assert weights["stacks"][0][0]["input_norm"].dtype == np.float32
    with pytest.raises(ValueError, match="int8, int4; not fp8"):
        load_weights(config, cpu, quantization="fp8")

    # The linear weights' bytes, int4 at half a byte, as XLA sizes the step's arguments.
    def size(weights: dict[str, Any], keys: tuple[str, ...] | None = LINEAR) -> int:
        arrays = _layer_arrays(weights, keys)
        counted = stacked_bytes(arrays)
        xla = jax.jit(lambda a: 0, keep_unused=True).lower(arrays).compile().memory_analysis()
        assert xla.argument_size_in_bytes == counted
        return counted

    f32, i8, i4 = (size(loaded[q]) for q in (None, "int8", "int4"))
    # int8: a byte a weight and a float32 scale an output channel (K is 64 or 128 here).
    assert 3.7 < f32 / i8 < 4.0
    # int4: half a byte a weight and a float32 scale a group of 64 or 128.
    assert 6.0 < f32 / i4 < 8.0
    # Every array of the stacked layers (norms and windows too): still about 4x.
    assert 3.5 < size(loaded[None], None) / size(loaded["int8"], None) < 4.0


def _runner(model_dir: Path, quantization: str | None, layout: str = "blocks") -> Any:
    from rvllm.config import ModelConfig, SchedulerConfig
    from rvllm.jax.runner import JaxModelRunner

    config = ModelConfig.from_path(str(model_dir), torch.float32, 128)
    runner = JaxModelRunner(config, SchedulerConfig(2, 32), 8, torch.device("cpu"),
                            layout=layout, quantization=quantization)
    return runner


def _logits(runner: Any, weights: dict[str, Any] | None = None) -> np.ndarray:
    """Every row's logits of one step: a 24-token prompt beside an 8-token one."""
    if weights is not None:
        runner.weights = weights
    runner.allocate_kv_cache(16, 2, 16, torch.float32, compile_buckets=False)
    ids, pos, slots, query_start, seq_lens, tables, rows = runner._padding(32, 2, 32)
    start = 0
    for i, prompt in enumerate(make_prompts(3, (24, 8))):
        n = len(prompt)
        table = np.arange(4, dtype=np.int32) + 4 * i
        ids[start:start + n], pos[start:start + n] = prompt, np.arange(n)
        slots[start:start + n] = table[np.arange(n) // 8] * 8 + np.arange(n) % 8
        tables[i, :4], seq_lens[i] = table, n
        start += n
        query_start[i + 1] = start
    rows[:] = np.arange(32)
    return np.asarray(runner._run(ids, pos, slots, query_start, seq_lens, tables, rows))[:start]


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Two scanned blocks of (sliding, sliding, global), two sliding layers left over.
    return build_gemma3(tmp_path_factory.mktemp("models") / "gemma3", 8,
                        (SLIDING, SLIDING, GLOBAL))


@pytest.fixture(scope="module")
def gemma4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_gemma4(tmp_path_factory.mktemp("models") / "gemma4")


# The mean over a step's rows of the relative error of a row's logits (the norm of its
# error over the norm of its logits) the quantized step may make against the float32 one
# on the tests' tiny random models. Measured: int8 0.018 (Llama), 0.023 (Gemma 3), 0.058
# (Gemma 4); int4 0.31, 0.45, 0.65. Random weights quantize badly to 4 bits (each group
# here is a whole 64-wide column: the scale is set by an outlier of 64 Gaussians) and
# their error grows through the layers; on SmolLM2 int4 adds 0.16 nats to the mean NLL
# of a text, int8 0.016 (docs/jax.md).
MEAN_RELATIVE_ERROR = {"int8": 0.1, "int4": 1.0}


@pytest.mark.parametrize("model", ["llama", "gemma3", "gemma4"])
def test_the_quantized_step_computes_on_the_dequantized_weights(
        model: str, llama_dir: Path, gemma3_dir: Path, gemma4_dir: Path) -> None:
    import jax

    from rvllm.jax.quant import dequantize, is_quantized

    model_dir = {"llama": llama_dir, "gemma3": gemma3_dir, "gemma4": gemma4_dir}[model]
    reference = _logits(_runner(model_dir, None))
    norm = np.linalg.norm(reference, axis=-1)
    errors = {}
    for quantization in ("int8", "int4"):
        runner = _runner(model_dir, quantization)
        quantized = [w for w in _layer_arrays(runner.weights) if is_quantized(w)]
        # Four a layer position (qkv, o, gate_up, down); Gemma 4's q, kv, o, gate_up,
        # down and per-layer gate and projection (its KV-sharing layers have no kv).
        positions = sum(len(stack.pattern) for stack in runner.spec.stacks)
        expected = {"llama": 4, "gemma3": 5 * 4, "gemma4": 2 * 7 + 2 * 6}[model]
        assert positions == {"llama": 1, "gemma3": 5, "gemma4": 4}[model]
        assert len(quantized) == expected
        logits = _logits(runner)
        # The same step in float32 on the dequantized weights: the same logits, to
        # float32 rounding (the int8 scale is applied to the product, not the weight).
        dequantized = jax.tree.map(lambda w: dequantize(w) if is_quantized(w) else w,
                                   runner.weights, is_leaf=is_quantized)
        np.testing.assert_allclose(logits, _logits(_runner(model_dir, None), dequantized),
                                   atol=2e-5 * np.abs(reference).max(), rtol=0)
        if model == "gemma3" and quantization == "int4":
            # The quantized dicts stack as well in one flat scan, and unstack unrolled.
            for layout in ("flat", "unrolled"):
                np.testing.assert_allclose(_logits(_runner(model_dir, quantization, layout)),
                                           logits, atol=1e-4, rtol=0)
        errors[quantization] = float(np.mean(np.linalg.norm(logits - reference, axis=-1)
                                             / norm))
        assert errors[quantization] < MEAN_RELATIVE_ERROR[quantization]
    assert errors["int8"] < errors["int4"] / 4


ENGINE = dict(model_impl="jax", block_size=8, max_model_len=128, max_num_seqs=2,
              num_gpu_blocks=64, kernel_backend="torch")  # no numba kernels to warm


def test_int8_greedy_tokens_mostly_match_float32(llama_dir: Path) -> None:
    # Greedy decoding of a random tiny model flips on small logit gaps, and a flipped token
    # changes everything after it: measured, 90 of the 96 tokens are float32's (two of the
    # eight sequences part from it, at their 8th and 12th tokens), and every first token
    # (the prompt's own logits) is float32's. The torch backend's --quantization int8 is
    # no reference token for token: it quantizes the weights alike (per output channel,
    # max |w| / 127, round to nearest) but the activations too (per token), and parts
    # from float32 by as much on other prompts (docs/jax.md).
    prompts = make_prompts(1, (1, 3, 7, 16, 17, 31, 48, 70))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(str(llama_dir), quantization="int8", max_num_batched_tokens=32, **ENGINE)
    assert llm.engine.quantization == "int8"
    assert llm.engine.runner.weights["stacks"][0][0]["gate_up"]["w"].dtype == np.int8
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    float32 = hf_greedy(llama_dir, prompts, 12)
    assert [t[0] for t in got] == [t[0] for t in float32]
    same = sum(a == b for x, y in zip(got, float32) for a, b in zip(x, y))
    assert same >= 85 and got != float32


def test_gemma3_serves_int4_without_compiling_after_start_up(gemma3_dir: Path) -> None:
    from rvllm.jax.model import compile_count

    llm = LLM(str(gemma3_dir), quantization="int4", max_num_batched_tokens=16, **ENGINE)
    blocks = llm.engine.runner.weights["stacks"][0]  # two scanned repeats of three layers
    assert [str(layer["qkv"]["w"].dtype) for layer in blocks] == ["int4"] * 3
    assert blocks[0]["qkv"]["w"].shape[0] == 2
    before = compile_count()
    prompts = make_prompts(2, (5, 40))  # the 40-token one past the 16-token window
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12,
                                                ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [12, 12]
    assert compile_count() == before
