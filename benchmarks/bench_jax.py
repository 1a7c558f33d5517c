"""The JAX backend's step under its layer layouts: compile time and step time.

Builds tiny random Gemma 3 (or Llama) checkpoints with transformers, loads each under the
layouts of ``rvllm.jax.weights.LAYOUTS`` and, per layout, times the compilation of two step
shapes (a 64-token prefill step of one sequence, a decode step of 8 sequences) and the
steady-state time of each step (median of ``--repeats`` runs):

- ``blocks``: a scan over pattern blocks (a stack per position in the pattern), the
  block's layers a static loop inside, leftover layers after the scan (the default).
- ``flat``: one scan over every layer, each layer's window and RoPE table chosen by
  arrays beside its weights (Gemma only).
- ``unrolled``: every layer a Python loop, no scan.

    python benchmarks/bench_jax.py                       # Gemma 3, 8 and 26 layers
    python benchmarks/bench_jax.py --arch llama --layers 8 26 --hidden 256
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch


def build(arch: str, out: Path, layers: int, hidden: int, pattern: int) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    heads = max(4, hidden // 64)
    common = dict(vocab_size=2048, hidden_size=hidden, intermediate_size=4 * hidden,
                  num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=max(1, heads // 4), max_position_embeddings=4096,
                  rms_norm_eps=1e-6, initializer_range=0.02, bos_token_id=0, eos_token_id=2)
    if arch == "gemma3":
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                 for i in range(layers)]
        config = AutoConfig.for_model(
            "gemma3_text", architectures=["Gemma3ForCausalLM"], head_dim=hidden // heads,
            query_pre_attn_scalar=hidden // heads, sliding_window=128, layer_types=types,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                             "full_attention": {"rope_type": "linear", "rope_theta": 1e6,
                                                "factor": 8.0}}, **common)
    else:
        config = AutoConfig.for_model("llama", architectures=["LlamaForCausalLM"], **common)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    return out


def step_inputs(runner: Any, seqs: int, new: int, context: int) -> tuple[np.ndarray, ...]:
    """``seqs`` sequences, each ``new`` new tokens after ``context - new`` cached ones."""
    bs = runner.block_size
    tokens = max(seqs * new, seqs)
    ids, pos, slots, query_start, seq_lens, tables, rows = runner._padding(tokens, seqs, seqs)
    per_seq = -(-context // bs)
    for i in range(seqs):
        table = np.arange(per_seq, dtype=np.int32) + i * per_seq
        positions = np.arange(context - new, context)
        ids[i * new:(i + 1) * new] = 5 + i
        pos[i * new:(i + 1) * new] = positions
        slots[i * new:(i + 1) * new] = table[positions // bs] * bs + positions % bs
        tables[i, :per_seq] = table
        seq_lens[i] = context
        query_start[i + 1] = (i + 1) * new
        rows[i] = (i + 1) * new - 1
    return ids, pos, slots, query_start, seq_lens, tables, rows


def measure(model_dir: Path, layout: str, repeats: int, context: int) -> dict[str, Any]:
    from rvllm.config import ModelConfig, SchedulerConfig
    from rvllm.jax.model import jitted_step
    from rvllm.jax.runner import JaxModelRunner

    config = ModelConfig.from_path(str(model_dir), torch.float32, 2 * context)
    runner = JaxModelRunner(config, SchedulerConfig(8, 64), 16, torch.device("cpu"),
                            layout=layout)
    runner.allocate_kv_cache(8 * (2 * context // 16), 0, 0, torch.float32,
                             compile_buckets=False)
    out: dict[str, Any] = {"layout": layout, "layers": config.num_layers,
                           "stacks": [(s.repeats, len(s.pattern)) for s in runner.spec.stacks]}
    for name, (seqs, new) in {"prefill": (1, 64), "decode": (8, 1)}.items():
        inputs = step_inputs(runner, seqs, new, context)
        start = time.perf_counter()
        compiled = jitted_step.lower(runner.weights, runner.caches, *inputs,
                                     spec=runner.spec).compile()
        out[f"{name}_compile_s"] = round(time.perf_counter() - start, 2)
        times = []
        for _ in range(repeats + 2):
            start = time.perf_counter()
            logits, runner.caches = compiled(runner.weights, runner.caches, *inputs)
            logits.block_until_ready()
            times.append(time.perf_counter() - start)
        out[f"{name}_step_ms"] = round(1000 * statistics.median(times[2:]), 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=("gemma3", "llama"), default="gemma3")
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 26])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--pattern", type=int, default=6, help="Gemma 3: a global layer "
                        "every this many")
    parser.add_argument("--layouts", nargs="+", default=None)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--context", type=int, default=512,
                        help="each sequence's length after the step")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    layouts = args.layouts or (["blocks", "flat", "unrolled"] if args.arch == "gemma3"
                               else ["blocks", "unrolled"])
    import jax

    print(f"# jax {jax.__version__} on {jax.devices()[0].device_kind}, "
          f"{os.cpu_count()} CPUs; {' '.join(sys.argv)}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for layers in args.layers:
            model_dir = build(args.arch, Path(tmp) / f"m{layers}", layers, args.hidden,
                              args.pattern)
            for layout in layouts:
                row = measure(model_dir, layout, args.repeats, args.context)
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
