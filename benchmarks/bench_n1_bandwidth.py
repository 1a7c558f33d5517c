"""N=1 decode on the CPU against what this machine's memory delivers, measured in turns.

A one-sequence decode step reads every linear layer's weight once: its speed is bounded
by the memory's read bandwidth. This prints the weight bytes a step reads, then
alternates two measurements so a drift in the machine's speed reaches both alike:
- a read of a buffer of the same size by numba on every thread, as eight streams a
  thread, as one, and as four streams of 16-lane vector loads, in turns (the fastest is
  the limit: on an Intel machine eight streams read 25-30% more than one, on an AMD Zen 4
  one read 10-20% more, on a 2-core Zen 3 the vector streams were 0-5% faster than eight);
- ``--steps`` decode tokens of one sequence through the engine (``LLMEngine.step``, the
  sampling and Python included), one engine step a token; and with
  ``--num-scheduler-steps K`` as many again, K tokens an engine step (multi-step
  decoding), in turns with the first; with ``--idle``, after the engine's idle work (what
  a server's engine does when it has nothing to step: the memory of the cache blocks it
  hands out next is faulted in, not written for the first time inside the steps).
A token's weight bytes over its median time (per round: the round's time over its
tokens), as a share of the fastest read's median rate, is the "share of the bandwidth
limit" that docs/benchmarks.md reports. The step also reads the sequence's KV cache,
which grows with it: the share with those bytes counted too is printed beside it. Where
the memory's speed drifts from second to second (a shared host), the medians of the two
come from different moments; so each round's rate is also set against the reads on
either side of it (the fastest kind's median of each batch of reads, the two batches
averaged), and the median of those paired shares is printed too.

    python benchmarks/bench_n1_bandwidth.py --model MODEL [--quantization int8] [--rounds 5]
        [--num-scheduler-steps 8] [--idle]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numba
import numpy as np
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from rvllm import LLM, SamplingParams
from rvllm.engine.sequence import Sequence
from rvllm.kernels.cpu.vectors import _FAST, _VEC, LANES, _int, _vector_at

STREAMS = 4


@intrinsic
def _vector_streams(typingctx, address, stride, lines, out):
    """out[0:16] = the sum of ``lines`` 64-byte lines (16 float32) from each of STREAMS
    streams at address + s * stride (bytes), read side by side a line of each in turn."""
    def codegen(context, builder, signature, args):
        address, stride, lines, out = args
        zero = ir.Constant(_VEC, [0.0] * LANES)
        sums = [cgutils.alloca_once_value(builder, zero) for _ in range(STREAMS)]
        with cgutils.for_range(builder, lines) as loop:
            offset = builder.mul(loop.index, _int(LANES))
            for s in range(STREAMS):
                start = builder.add(address, builder.mul(stride, _int(s)))
                line = builder.load(_vector_at(builder, start, offset), align=4)
                builder.store(builder.fadd(builder.load(sums[s]), line, flags=_FAST), sums[s])
        total = builder.load(sums[0])
        for s in range(1, STREAMS):
            total = builder.fadd(total, builder.load(sums[s]), flags=_FAST)
        builder.store(total, _vector_at(builder, out, _int(0)), align=4)
        return context.get_dummy_value()
    return types.void(types.int64, types.int64, types.int64, types.int64), codegen


@numba.njit(parallel=True)
def read_vectors(buf, parts):
    """Sum of buf [R, C] (float32, C-contiguous): each of ``parts`` threads reads its share
    as STREAMS streams of 16-lane vector loads (what the one-row GEMV's panel passes do,
    without the arithmetic)."""
    flat = buf.reshape(-1)
    totals = np.zeros((parts, LANES), np.float32)
    for part in prange(parts):
        lo = flat.shape[0] * part // parts
        lines = (flat.shape[0] * (part + 1) // parts - lo) // LANES // STREAMS
        _vector_streams(flat.ctypes.data + lo * 4, lines * LANES * 4, lines,
                        totals[part].ctypes.data)
    return totals.sum()


@numba.njit(parallel=True, fastmath=True)
def read_streams(buf, parts):
    """Sum of buf [R, C] (float32): each of ``parts`` threads reads its share of the rows
    as eight streams at once."""
    rows, cols = buf.shape
    totals = np.zeros(parts, np.float32)
    for part in prange(parts):
        lo, hi = rows * part // parts, rows * (part + 1) // parts
        q = (hi - lo) // 8
        a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
        for r in range(lo, lo + q):
            for i in range(cols):
                a0 += buf[r, i]
                a1 += buf[r + q, i]
                a2 += buf[r + 2 * q, i]
                a3 += buf[r + 3 * q, i]
                a4 += buf[r + 4 * q, i]
                a5 += buf[r + 5 * q, i]
                a6 += buf[r + 6 * q, i]
                a7 += buf[r + 7 * q, i]
        totals[part] = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7
    return totals.sum()


@numba.njit(parallel=True, fastmath=True)
def read_stream(buf, parts):
    """Sum of buf [R, C] (float32): each of ``parts`` threads reads its share of the rows
    in order, one stream."""
    rows, cols = buf.shape
    totals = np.zeros(parts, np.float32)
    for part in prange(parts):
        total = np.float32(0.0)
        for r in range(rows * part // parts, rows * (part + 1) // parts):
            for i in range(cols):
                total += buf[r, i]
        totals[part] = total
    return totals.sum()


def weight_bytes(llm: LLM) -> int:
    """Bytes of the weights (and int8 scales) a one-row step reads: every linear layer's
    panels (``kernels.cpu.gemv``), which is what the one-row kernels read."""
    return sum(module.panel_weight.nbytes for module in llm.engine.model.modules()
               if getattr(module, "panel_weight", None) is not None)


def kv_bytes_per_position(llm: LLM) -> int:
    """Bytes of keys and values one position of context adds to what a step reads."""
    config = llm.engine.model_config
    size = llm.engine.cache_config.cache_dtype.itemsize
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * size


def decode_round(llm: LLM, seq: Sequence, tokens: int, num_steps: int) -> tuple[float, float]:
    """Seconds a token over ``tokens`` tokens of decoding with ``num_steps`` scheduler
    steps, and the mean context length their steps read."""
    engine = llm.engine
    engine.scheduler.config.num_scheduler_steps = num_steps
    start_tokens, contexts = seq.num_tokens, []
    t = time.perf_counter()
    while seq.num_tokens - start_tokens < tokens and not seq.status.is_finished:
        before = seq.num_tokens
        engine.step()
        contexts.extend(range(before, seq.num_tokens))
    elapsed = time.perf_counter() - t
    return elapsed / (seq.num_tokens - start_tokens), statistics.fmean(contexts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=32, help="decode tokens a round")
    parser.add_argument("--num-scheduler-steps", type=int, default=1,
                        help="also time rounds of this many tokens an engine step")
    parser.add_argument("--idle", action="store_true",
                        help="first run the engine's idle work, as a server's engine does in "
                        "its first seconds (the fresh cache blocks' memory faulted in)")
    ns = parser.parse_args()

    ahead = ns.num_scheduler_steps
    llm = LLM(ns.model, quantization=ns.quantization, num_scheduler_steps=ahead)
    engine = llm.engine
    nbytes = weight_bytes(llm)
    if nbytes == 0:
        raise SystemExit("this model keeps no weight panels (not the numba one-row path)")
    buf = np.random.default_rng(0).random((nbytes // 4096, 1024), dtype=np.float32)
    parts = numba.get_num_threads()
    reads = {"eight streams a thread": (read_streams, []), "one stream a thread": (read_stream, []),
             f"{STREAMS} vector streams a thread": (read_vectors, [])}
    for read, _ in reads.values():
        read(buf, parts)
    kinds = [1] if ahead == 1 else [1, ahead]
    # Room for the warm-up's steps (each up to ``ahead`` tokens) and every round's tokens.
    params = SamplingParams(temperature=0, ignore_eos=True,
                            max_tokens=ns.rounds * len(kinds) * ns.steps + 3 * ahead)
    engine.add_request("n1", {"prompt_token_ids": list(range(10, 42))}, params)
    if ns.idle:
        t = time.perf_counter()
        while engine.has_idle_work:
            engine.idle_work()
        print(f"idle work: {time.perf_counter() - t:.2f} s")
    seq = engine.requests["n1"].seqs[0]
    for _ in range(3):  # the prefill and the first decode steps
        engine.step()
    rounds: dict[int, list[tuple[float, float]]] = {k: [] for k in kinds}
    batches = []  # each batch of reads' fastest kind's median rate, before each round
    for r in range(ns.rounds + 1):
        batch: dict[str, list[float]] = {name: [] for name in reads}
        for _ in range(3):
            for name, (read, rates) in reads.items():
                t = time.perf_counter()
                read(buf, parts)
                batch[name].append(buf.nbytes / (time.perf_counter() - t))
                rates.append(batch[name][-1])
        batches.append(max(statistics.median(rates) for rates in batch.values()))
        if r == ns.rounds:
            break
        for k in kinds:
            rounds[k].append(decode_round(llm, seq, ns.steps, k))
    print(f"model {ns.model} ({ns.quantization or 'float32'}), {parts} threads")
    print(f"weight bytes a step reads: {nbytes / 1e6:.1f} MB")
    for name, (_, rates) in reads.items():
        print(f"read of {buf.nbytes / 1e6:.0f} MB, {name}: median "
              f"{statistics.median(rates) / 1e9:.1f} GB/s (best {max(rates) / 1e9:.1f})")
    read_rate = max(statistics.median(rates) for _, rates in reads.values())
    per_position = kv_bytes_per_position(llm)
    for k, results in rounds.items():
        token = statistics.median(t for t, _ in results)
        context = statistics.fmean(c for _, c in results)
        with_kv = nbytes + per_position * context
        print(f"N=1 decode, {k} token(s) an engine step: median {token * 1e3:.2f} ms a token"
              f" = {1 / token:.1f} tok/s = {nbytes / token / 1e9:.1f} GB/s of weights, "
              f"{nbytes / token / read_rate:.1%} of the read; with the KV cache (mean "
              f"context {context:.0f}, {per_position * context / 1e6:.1f} MB) "
              f"{with_kv / token / read_rate:.1%}")
        paired = [nbytes / t / ((batches[i] + batches[i + 1]) / 2)
                  for i, (t, _) in enumerate(results)]
        print(f"  paired with the reads on either side of each round: median "
              f"{statistics.median(paired):.1%} of the read (rounds: "
              f"{', '.join(f'{x:.1%}' for x in paired)})")


if __name__ == "__main__":
    main()
