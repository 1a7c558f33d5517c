"""``rvllm bench micro``: the CPU-side sampling operations, rvllm's implementation against a
plain NumPy one on the same inputs in the same run (median over repeats, microseconds).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from rvllm.bench.report import format_table, machine_info, write_json
from rvllm.bench.stats import percentile, ratio


@dataclass(slots=True)
class MicroCase:
    name: str
    ours: Callable[[], Any]
    numpy: Callable[[], Any]


def time_call(fn: Callable[[], Any], repeats: int, min_seconds: float) -> float:
    """Median seconds per call of ``fn``: calls are batched so each repeat lasts at least
    ``min_seconds`` (timer resolution stops mattering), then the median repeat is kept."""
    fn()  # warm-up: first-call allocations and lazy imports are not the steady state
    number = 1
    while True:
        t = time.perf_counter()
        for _ in range(number):
            fn()
        elapsed = time.perf_counter() - t
        if elapsed >= min_seconds or number >= 1 << 20:
            break
        number *= 2
    per_call = [elapsed / number]
    for _ in range(repeats - 1):
        t = time.perf_counter()
        for _ in range(number):
            fn()
        per_call.append((time.perf_counter() - t) / number)
    return percentile(per_call, 50.0)


# ---------------------------------------------------------------- NumPy references


def np_penalties(logits: np.ndarray, ids: np.ndarray, rep: float, freq: float,
                 pres: float) -> np.ndarray:
    counts = np.bincount(ids, minlength=logits.shape[0])
    seen = counts > 0
    out = np.where(seen, np.where(logits > 0, logits / rep, logits * rep), logits)
    return out - freq * counts - pres * seen


def np_softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def np_multinomial(logits: np.ndarray, rng: np.random.Generator) -> int:
    cdf = np.cumsum(np_softmax(logits))
    return int(np.searchsorted(cdf, rng.random() * cdf[-1]))


def np_top_p(logits: np.ndarray, top_p: float, rng: np.random.Generator) -> int:
    order = np.argsort(-logits)
    probs = np_softmax(logits[order])
    cdf = np.cumsum(probs)
    keep = int(np.searchsorted(cdf, top_p)) + 1
    kept = cdf[:keep]
    return int(order[np.searchsorted(kept, rng.random() * kept[-1])])


def np_batch_sample(logits: np.ndarray, temperature: float, top_p: float,
                    rng: np.random.Generator) -> np.ndarray:
    order = np.argsort(-logits, axis=1)
    sorted_logits = np.take_along_axis(logits, order, axis=1) / temperature
    probs = np_softmax(sorted_logits)
    cdf = np.cumsum(probs, axis=1)
    probs[(cdf - probs) > top_p] = 0.0  # keep the smallest prefix reaching top_p
    cdf = np.cumsum(probs, axis=1)
    u = rng.random((logits.shape[0], 1)) * cdf[:, -1:]
    picked = (cdf < u).sum(axis=1)
    return order[np.arange(logits.shape[0]), picked]


# ---------------------------------------------------------------- the cases


def build_cases(seed: int = 0) -> list[MicroCase]:
    from rvllm.sampler import Sampler, apply_penalties, sample_batch

    rng = np.random.default_rng(seed)
    sampler = Sampler()
    v32 = rng.standard_normal(32000).astype(np.float32)
    v128 = rng.standard_normal(128000).astype(np.float32)
    b64 = rng.standard_normal((64, 32000)).astype(np.float32)
    hist_512 = rng.integers(0, 32000, 512)
    hist_2k = rng.integers(0, 32000, 2048)
    hist_512_list, hist_2k_list = hist_512.tolist(), hist_2k.tolist()
    return [
        MicroCase(
            "penalties rep+freq+pres (32K vocab, 512 seen)",
            lambda: apply_penalties(v32, hist_512_list, repetition_penalty=1.1,
                                    frequency_penalty=0.2, presence_penalty=0.3),
            lambda: np_penalties(v32, hist_512, 1.1, 0.2, 0.3),
        ),
        MicroCase(
            "repetition penalty (32K vocab, 2K seen)",
            lambda: apply_penalties(v32, hist_2k_list, repetition_penalty=1.1),
            lambda: np_penalties(v32, hist_2k, 1.1, 0.0, 0.0),
        ),
        MicroCase(
            "multinomial sampling (32K vocab)",
            lambda: sampler.sample(v32, temperature=1.0),
            lambda: np_multinomial(v32, rng),
        ),
        MicroCase(
            "top-p 0.9 sampling (128K vocab)",
            lambda: sampler.sample(v128, temperature=1.0, top_p=0.9),
            lambda: np_top_p(v128, 0.9, rng),
        ),
        MicroCase(
            "batch sampling (64 seqs x 32K, T=0.8, top-p 0.95)",
            lambda: sample_batch(b64, temperature=0.8, top_p=0.95),
            lambda: np_batch_sample(b64, 0.8, 0.95, rng),
        ),
    ]


def run_micro(repeats: int, min_seconds: float, seed: int = 0) -> dict[str, Any]:
    rows = []
    for case in build_cases(seed):
        ours = time_call(case.ours, repeats, min_seconds)
        ref = time_call(case.numpy, repeats, min_seconds)
        rows.append({"op": case.name, "rvllm_us": ours * 1e6, "numpy_us": ref * 1e6,
                     "speedup_vs_numpy": ratio(ref, ours)})
    return {"benchmark": "micro", "engine": "rvllm",
            "config": {"repeats": repeats, "min_seconds": min_seconds, "seed": seed},
            "machine": machine_info(), "numpy": np.__version__, "rows": rows}


def print_micro_result(result: dict[str, Any]) -> None:
    rows = [{**r, "speedup": f"{r['speedup_vs_numpy']:.2f}x"} for r in result["rows"]]
    print(format_table(rows, [("op", "operation"), ("rvllm_us", "rvllm us"),
                              ("numpy_us", "numpy us"), ("speedup", "rvllm vs numpy")]))


def main(ns: argparse.Namespace) -> int:
    if ns.repeats < 1 or ns.min_seconds <= 0:
        raise ValueError("--repeats must be at least 1 and --min-seconds positive.")
    result = run_micro(ns.repeats, ns.min_seconds, ns.seed)
    print_micro_result(result)
    if ns.json:
        write_json(ns.json, result)
        print(f"wrote {ns.json}")
    return 0
