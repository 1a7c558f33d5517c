"""The CPU decode attention kernel on the decode steps of a serving-like load.

Decode attention over a KV cache far larger than the L3 is bound by how the kernel walks
memory, which a synthetic batch reproduces badly (the blocks of a real cache lie where
the block manager put them, and a step reads every layer's cache). So this first runs the
offline replay of the serving load (``LLM.generate``: random prompts of ``--input-len``
tokens, ``--output-len`` new ones, up to ``--max-num-seqs`` at once) and records each
decode step's block tables and lengths (through ``cpu_batch_step.step_arrays``). Then it
times the kernel on a sample of those steps, for every layer in turn over a cache of
the model's shape filled with random rows, float32 and bfloat16, and prints the mean time
of a layer's call and the KV bytes it read per second.

To compare two versions of the kernel, run the script from each tree, in turns.

    python scripts/bench_decode_attention.py --model MODEL [--quantization int8]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import numba
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rvllm import LLM, SamplingParams  # noqa: E402
from rvllm.kernels import cpu_batch_step  # noqa: E402
from rvllm.kernels.cpu_decode_attention import _paged_decode  # noqa: E402
from rvllm.kernels.cpu_math import kv_array  # noqa: E402


def record_steps(llm: LLM, ns: argparse.Namespace) -> list[tuple]:
    """(block tables, lengths, splits) of every batch-step decode of the replay."""
    steps = []
    step_arrays = cpu_batch_step.step_arrays

    def recording(tables: torch.Tensor, lens: torch.Tensor) -> tuple:
        arrays = step_arrays(tables, lens)
        steps.append((arrays[0].copy(), arrays[1].copy(), arrays[2]))
        return arrays

    rng = random.Random(0)
    vocab = llm.engine.model_config.vocab_size
    prompts, params = [], []
    for _ in range(ns.num_requests):
        prompts.append({"prompt_token_ids": [rng.randrange(10, vocab)
                                             for _ in range(rng.randint(*ns.input_len))]})
        params.append(SamplingParams(max_tokens=rng.randint(*ns.output_len), temperature=0,
                                     ignore_eos=True))
    cpu_batch_step.step_arrays = recording
    try:
        llm.generate(prompts, params)
    finally:
        cpu_batch_step.step_arrays = step_arrays
    return steps


def time_kernel(steps: list[tuple], shape: tuple, layers: int, dtype: torch.dtype,
                heads: int, reps: int) -> tuple[float, float]:
    """(ms per layer call, GB/s of keys and values) of the kernel on ``steps``."""
    gen = torch.Generator().manual_seed(0)
    caches = [(kv_array(torch.randn(shape, generator=gen).to(dtype)),
               kv_array(torch.randn(shape, generator=gen).to(dtype))) for _ in range(layers)]
    head_dim, kv_heads = shape[3], shape[2]
    element = torch.tensor([], dtype=dtype).element_size()
    queries = [np.random.default_rng(i).standard_normal((t.shape[0], heads, head_dim))
               .astype(np.float32) for i, (t, _, _) in enumerate(steps)]
    total, nbytes = 0.0, 0
    for rep in range(reps + 1):  # the first pass compiles and warms
        for q, (tables, lens, splits) in zip(queries, steps):
            out = np.empty_like(q)
            start = time.perf_counter()
            for keys, values in caches:
                _paged_decode(q, keys, values, tables, lens, np.float32(head_dim ** -0.5),
                              np.int64(0), np.float32(0.0), np.int64(splits),
                              np.int64(numba.get_num_threads()), out)
            if rep:
                total += time.perf_counter() - start
                nbytes += int(lens.sum()) * kv_heads * head_dim * element * 2 * layers
    calls = reps * len(steps) * layers
    return total / calls * 1e3, nbytes / total / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--num-requests", type=int, default=100)
    parser.add_argument("--input-len", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(32, 256),
                        metavar=("MIN", "MAX"))
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--sample", type=int, default=150, help="decode steps timed")
    parser.add_argument("--reps", type=int, default=2)
    ns = parser.parse_args()

    llm = LLM(ns.model, quantization=ns.quantization, max_num_seqs=ns.max_num_seqs,
              max_model_len=2048)
    steps = record_steps(llm, ns)
    if not steps:
        raise SystemExit("no batch-step decodes recorded (not the numba CPU path?)")
    lens = np.concatenate([s[1] for s in steps])
    print(f"{len(steps)} decode steps, {lens.size} rows, context median {np.median(lens):.0f} "
          f"tokens")
    attn = llm.engine.model.attention_layers()[0]
    shape = tuple(attn.kv_cache[0].shape)
    layers = len(llm.engine.model.attention_layers())
    sample = steps[::max(1, len(steps) // ns.sample)]
    del llm
    for dtype in (torch.float32, torch.bfloat16):
        ms, rate = time_kernel(sample, shape, layers, dtype, attn.num_heads, ns.reps)
        print(f"{str(dtype).split('.')[-1]:8s} cache {shape} x {layers} layers: "
              f"{ms:.3f} ms a layer's call, {rate:.1f} GB/s of keys and values")


if __name__ == "__main__":
    main()
