"""Tensor parallelism under the JAX backend (``--tensor-parallel-size 2``) on the CPU's
host devices: greedy tokens identical to one device's on Llama (with the multi-step
decode) and Gemma 3, under a batch whose long prompts are prefilled in chunks beside the
others' decodes; the weights split Megatron-style and the cache by KV head; the cache
donated and updated in place; int8 and int4 weights split alike; and the errors for too
few devices and KV heads that do not divide.

XLA_FLAGS=--xla_force_host_platform_device_count=2 must be set before JAX starts its CPU
backend, and the test process may have started it already: the engines run in a
subprocess (this file run as a script), which prints what it found as JSON; the tests
check it."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("jax") is None,
                                reason="the jax extra is not installed")

DEVICES = 2
NEW_TOKENS = 10
# 16-token steps of up to 2 sequences: 6 step shapes to compile per engine. The 40- and
# 23-token prompts are prefilled in chunks beside the others' decodes.
PROMPT_LENS = (3, 40, 9, 23)
ENGINE = dict(model_impl="jax", block_size=8, max_model_len=128, max_num_batched_tokens=16,
              max_num_seqs=2, num_gpu_blocks=64)


# -- the subprocess ---------------------------------------------------------------------

def _prompts(seed: int = 1) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 400, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _greedy(llm: Any, prompts: list[list[int]]) -> list[list[int]]:
    from rvllm import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def _shards(tree: Any) -> dict[str, list[list[int]]]:
    """Each array's global shape and one device's shard shape, by its path."""
    import jax

    return {jax.tree_util.keystr(path): [list(a.shape), list(a.sharding.shard_shape(a.shape))]
            for path, a in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _collectives(compiled: Any) -> dict[str, int]:
    ops = re.findall(r"= \S+ (all-reduce|all-gather|all-to-all|collective-permute|"
                     r"reduce-scatter)(?:-start)?\(", compiled.as_text())
    return dict(Counter(ops))


def _pointers(caches: Any) -> list[int]:
    import jax

    return [s.data.unsafe_buffer_pointer() for a in jax.tree.leaves(caches)
            for s in a.addressable_shards]


def _in_place(runner: Any, tokens: int, seqs: int) -> dict[str, Any]:
    """The compiled step's memory per device, beside the cache's bytes per device."""
    from rvllm.jax.cache import device_cache_bytes

    memory = runner.step_fn.lower(*runner.step_args(tokens, seqs), spec=runner.spec) \
        .compile().memory_analysis()
    return {"alias": memory.alias_size_in_bytes, "temp": memory.temp_size_in_bytes,
            "cache": device_cache_bytes(runner.caches)}


def _engines(name: str, path: str, **extra: Any) -> dict[str, Any]:
    """One and two devices' greedy tokens of ``path``, and what the two-device engine
    holds."""
    import torch

    from rvllm import LLM
    from rvllm.jax.model import compile_count

    prompts = _prompts()
    one = LLM(path, **ENGINE, **extra)
    expected = _greedy(one, prompts)
    del one
    llm = LLM(path, tensor_parallel_size=DEVICES, **ENGINE, **extra)
    runner = llm.engine.runner
    before, pointers = compile_count(), _pointers(runner.caches)
    found = _greedy(llm, prompts)
    report = {
        "expected": expected, "found": found, "compiles": compile_count() - before,
        "devices": [str(d) for d in runner.mesh.devices.flat],
        # The step's outputs replaced the donated caches in their own buffers.
        "same_buffers": _pointers(runner.caches) == pointers,
        "weights": _shards(runner.weights), "caches": _shards(runner.caches),
        "multi_step_calls": runner.multi_step_calls,
        "spec": [[[k.num_kv_heads, k.head_dim] for k in s.pattern] for s in runner.spec.stacks],
        "collectives": _collectives(
            runner.step_fn.lower(*runner.step_args(16, 2), spec=runner.spec).compile()),
    }
    if name == "llama":  # the step's memory at two cache sizes
        report["memory"] = [_in_place(runner, 16, 2)]
        runner.allocate_kv_cache(4096, 2, 16, torch.float32, compile_buckets=False)
        report["memory"].append(_in_place(runner, 16, 2))
    return report


def _quantized(path: str) -> dict[str, Any]:
    """int8 and int4 weights on one and two devices: the logits of one prefill step, and
    the quantized weights' shards."""
    import numpy as np
    import torch

    from rvllm.config import ModelConfig, SchedulerConfig
    from rvllm.jax.runner import JaxModelRunner

    config = ModelConfig.from_path(path, torch.float32, 128)
    prompt = np.array(_prompts()[2], np.int32)
    n = len(prompt)
    out: dict[str, Any] = {}
    for method in ("int8", "int4"):
        logits = []
        for size in (1, DEVICES):
            runner = JaxModelRunner(config, SchedulerConfig(2, 16), 8, torch.device("cpu"),
                                    tensor_parallel_size=size, quantization=method)
            runner.allocate_kv_cache(16, 2, 16, torch.float32, compile_buckets=False)
            ids, pos, slots, starts, lens, tables, rows = runner._padding(16, 1, 1)
            ids[:n], pos[:n], slots[:n] = prompt, np.arange(n), np.arange(n)
            starts[1], lens[0], rows[0] = n, n, n - 1
            tables[0, :2] = [0, 1]
            logits.append(np.asarray(runner._run(ids, pos, slots, starts, lens, tables, rows)))
        out[method] = {"max_diff": float(np.abs(logits[0] - logits[1]).max()),
                       "argmax": [int(x.argmax()) for x in logits],
                       "weights": _shards(runner.weights["stacks"])}
    return out


def _weight_rules() -> dict[str, Any]:
    """The shardings ``weight_shardings`` gives a made-up tree: plain, fused, quantized
    (per channel and per group) and odd-sized arrays."""
    import jax
    import numpy as np

    from rvllm.jax import sharding

    mesh = sharding.make_mesh(DEVICES, "cpu")
    z = np.zeros
    layer = {
        "qkv": z((3, 8, 12)), "qkv_bias": z((3, 12)), "o": z((3, 8, 8)),
        "gate_up": {"w": z((3, 8, 16), np.int8), "scale": z((3, 16))},
        "down": {"w": z((3, 8, 8), np.int8), "scale": z((3, 2, 8))},
        "kv": z((3, 8, 5)), "input_norm": z((3, 8)), "window": z((3,), np.int32),
    }
    tree = {"embed": z((10, 8)), "lm_head": z((10, 8)), "stacks": [[layer]],
            "rope": {"global": {"cos": z((4, 2))}}, "per_tensor_o": z(())}
    tree["stacks"][0].append({"o": {"w": z((3, 8, 8), np.int8), "scale": z((3, 8))}})
    shardings = sharding.weight_shardings(tree, mesh)
    return {jax.tree_util.keystr(p): list(s.spec)
            for p, s in jax.tree_util.tree_flatten_with_path(shardings)[0]}


def _error(path: str, size: int) -> str:
    from rvllm import LLM

    try:
        LLM(path, tensor_parallel_size=size, skip_tokenizer_init=True, **ENGINE)
    except ValueError as e:
        return str(e)
    return ""


def run(llama: str, gemma3: str, mqa: str) -> dict[str, Any]:
    import jax

    assert len(jax.devices("cpu")) == DEVICES, jax.devices("cpu")
    return {
        "llama": _engines("llama", llama, num_scheduler_steps=4),
        "gemma3": _engines("gemma3", gemma3),
        "quantized": _quantized(llama),
        "rules": _weight_rules(),
        "too_few_devices": _error(llama, 4),
        "kv_heads": _error(mqa, DEVICES),
    }


if __name__ == "__main__":
    print(json.dumps(run(*sys.argv[1:4])))
    sys.stdout.flush()
    os._exit(0)  # JAX's threads: leave at once


# -- the tests --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def report(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from test_jax_gemma import GLOBAL, SLIDING, build_gemma3

    root = tmp_path_factory.mktemp("tp")
    # 8 layers: two scanned blocks of (sliding, sliding, global), two sliding left over.
    gemma3 = build_gemma3(root / "gemma3", 8, (SLIDING, SLIDING, GLOBAL))
    # The Llama model with a single KV head (start-up refuses before reading weights).
    mqa = root / "mqa"
    shutil.copytree(llama_dir, mqa)
    config = json.loads((mqa / "config.json").read_text())
    (mqa / "config.json").write_text(json.dumps({**config, "num_key_value_heads": 1}))
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES}",
           "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, __file__, str(llama_dir), str(gemma3), str(mqa)],
                         capture_output=True, text=True, timeout=300, env=env,
                         cwd=Path(__file__).parent)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("model", ["llama", "gemma3"])
def test_two_devices_make_one_devices_greedy_tokens(report: dict[str, Any], model: str
                                                    ) -> None:
    found = report[model]
    assert len(set(found["devices"])) == DEVICES
    assert found["found"] == found["expected"]
    assert [len(t) for t in found["found"]] == [NEW_TOKENS] * len(PROMPT_LENS)
    # Every step shape (and the device's sampling) was compiled at start-up.
    assert found["compiles"] == 0
    # The row-parallel products' partial sums are summed across the devices.
    assert found["collectives"].get("all-reduce", 0) >= 2
    if model == "llama":  # decode-only steps ran 4 greedy steps a call, sharded too
        assert found["multi_step_calls"] > 0


def test_the_weights_are_split_megatron_style(report: dict[str, Any]) -> None:
    w = report["llama"]["weights"]
    layer = "['stacks'][0][0]"
    # Llama: hidden 64, 4 heads and 2 KV heads of 16, MLP 128, vocabulary 512, 2 layers.
    assert w[layer + "['qkv']"] == [[2, 64, 128], [2, 64, 64]]  # columns (outputs)
    assert w[layer + "['gate_up']"] == [[2, 64, 256], [2, 64, 128]]
    assert w[layer + "['o']"] == [[2, 64, 64], [2, 32, 64]]  # rows (inputs)
    assert w[layer + "['down']"] == [[2, 128, 64], [2, 64, 64]]
    assert w["['lm_head']"] == [[512, 64], [256, 64]]  # by vocabulary
    for whole in ("['embed']", "['final_norm']", layer + "['input_norm']",
                  layer + "['post_norm']", "['rope']['global']['cos']"):
        assert w[whole][0] == w[whole][1], whole
    g = report["gemma3"]["weights"]
    assert g["['stacks'][0][2]['qkv']"] == [[2, 64, 128], [2, 64, 64]]
    assert g["['stacks'][1][1]['down']"] == [[1, 128, 64], [1, 64, 64]]
    assert g["['stacks'][0][0]['q_norm']"] == [[2, 16], [2, 16]]


def test_the_cache_is_split_by_kv_head(report: dict[str, Any]) -> None:
    # [repeats, blocks, block size, KV heads, head dim]: each device holds one KV head.
    assert report["llama"]["caches"] == {"[0][0]['k']": [[2, 64, 8, 2, 16], [2, 64, 8, 1, 16]],
                                         "[0][0]['v']": [[2, 64, 8, 2, 16], [2, 64, 8, 1, 16]]}
    gemma = report["gemma3"]["caches"]
    assert gemma["[0][2]['k']"] == [[2, 64, 8, 2, 16], [2, 64, 8, 1, 16]]
    assert gemma["[1][1]['v']"] == [[1, 64, 8, 2, 16], [1, 64, 8, 1, 16]]


def test_the_cache_is_updated_in_place(report: dict[str, Any]) -> None:
    for model in ("llama", "gemma3"):
        assert report[model]["same_buffers"], model
    small, large = report["llama"]["memory"]
    assert small["cache"] * 64 == large["cache"]  # 64 and 4096 blocks
    for memory in (small, large):
        # The donated cache (each device's shard) is the step's output buffer.
        assert memory["alias"] >= memory["cache"]
    # The scratch does not grow with the cache: no copy of it is made.
    assert small["temp"] == large["temp"] < large["cache"] / 10


def test_quantized_weights_are_split_alike(report: dict[str, Any]) -> None:
    for method in ("int8", "int4"):
        found = report["quantized"][method]
        assert found["max_diff"] < 1e-4, method
        assert found["argmax"][0] == found["argmax"][1]
        w = found["weights"]
        assert w["[0][0]['qkv']['w']"] == [[2, 64, 128], [2, 64, 64]]
        assert w["[0][0]['down']['w']"] == [[2, 128, 64], [2, 64, 64]]
    int8 = report["quantized"]["int8"]["weights"]
    assert int8["[0][0]['qkv']['scale']"] == [[2, 128], [2, 64]]  # with its columns
    assert int8["[0][0]['o']['scale']"] == [[2, 64], [2, 64]]  # per output: whole
    rules = report["rules"]
    layer = "['stacks'][0][0]"
    # Partition specs, axis by axis ([]: whole on every device).
    assert rules[layer + "['qkv']"] == [None, None, "tp"]
    assert rules[layer + "['qkv_bias']"] == [None, "tp"]
    assert rules[layer + "['o']"] == [None, "tp", None]
    assert rules[layer + "['gate_up']['w']"] == [None, None, "tp"]
    assert rules[layer + "['gate_up']['scale']"] == [None, "tp"]
    assert rules[layer + "['down']['w']"] == [None, "tp", None]
    # Per group of inputs: split with the rows of w.
    assert rules[layer + "['down']['scale']"] == [None, "tp", None]
    assert rules["['stacks'][0][1]['o']['scale']"] == []
    # 5 columns do not split in two: whole on each device.
    assert rules[layer + "['kv']"] == []
    assert rules["['lm_head']"] == ["tp", None]
    for whole in ("['embed']", layer + "['input_norm']", layer + "['window']",
                  "['per_tensor_o']", "['rope']['global']['cos']"):
        assert rules[whole] == [], whole


def test_too_few_devices_and_indivisible_kv_heads_are_refused(report: dict[str, Any]
                                                              ) -> None:
    message = report["too_few_devices"]
    assert "--tensor-parallel-size 4 needs 4 cpu devices; JAX lists 2" in message
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=4" in message
    assert ("--tensor-parallel-size 2 splits the KV cache by KV head, and 2 does not divide "
            "this model's 1 KV head a layer; run it on one device" in report["kv_heads"])
