"""Percentile and throughput arithmetic shared by every benchmark, on plain floats.

Latency summaries use the names ``vllm bench serve`` prints (``mean_ttft_ms``,
``p99_itl_ms``, ...), so results from rvllm and vLLM line up key for key.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

DEFAULT_PERCENTILES = (50.0, 90.0, 95.0, 99.0)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation, as ``numpy.percentile``.

    NaN for an empty sequence, so a metric nobody produced reads as missing, not zero.
    """
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}.")
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if values else math.nan


def summarize_ms(name: str, seconds: Sequence[float],
                 percentiles: Iterable[float] = DEFAULT_PERCENTILES) -> dict[str, float]:
    """``mean_<name>_ms``, ``median_<name>_ms``, ``std_<name>_ms`` and ``p<q>_<name>_ms``
    of durations given in seconds."""
    ms = [s * 1000.0 for s in seconds]
    m = mean(ms)
    std = math.sqrt(mean([(x - m) ** 2 for x in ms])) if ms else math.nan
    out = {f"mean_{name}_ms": m, f"median_{name}_ms": percentile(ms, 50.0),
           f"std_{name}_ms": std}
    for q in percentiles:
        out[f"p{_q_label(q)}_{name}_ms"] = percentile(ms, q)
    return out


def _q_label(q: float) -> str:
    return str(int(q)) if float(q).is_integer() else str(q)


def throughput(count: float, seconds: float) -> float:
    """``count`` per second; NaN when no time passed (nothing measurable)."""
    return count / seconds if seconds > 0 else math.nan


@dataclass(slots=True)
class RequestTiming:
    """What the client saw of one streamed request. Times are ``time.perf_counter()`` seconds.

    ``chunk_times`` holds the arrival time of each streamed chunk that carried output;
    ``chunk_tokens`` how many tokens each brought (1 unless the server batched them).
    """

    start: float
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    end: float = 0.0
    error: str = ""

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start if self.chunk_times else math.nan

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive output chunks (vLLM's inter-token latencies)."""
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (E2E - TTFT) / (tokens - 1), as vLLM.
        None for a single-token output, which has no such time."""
        if self.output_tokens < 2 or not self.chunk_times:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def serve_metrics(timings: Sequence[RequestTiming], duration: float,
                  percentiles: Iterable[float] = DEFAULT_PERCENTILES) -> dict[str, float]:
    """vLLM's serving summary of one run: counts, throughputs and the TTFT / TPOT / ITL /
    E2EL distributions over the successful requests."""
    ok = [t for t in timings if t.success]
    percentiles = tuple(percentiles)
    input_tokens = sum(t.prompt_len for t in ok)
    output_tokens = sum(t.output_tokens for t in ok)
    out: dict[str, float] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(timings) - len(ok),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": throughput(len(ok), duration),
        "output_throughput": throughput(output_tokens, duration),
        "total_token_throughput": throughput(input_tokens + output_tokens, duration),
    }
    out.update(summarize_ms("ttft", [t.ttft for t in ok if t.chunk_times], percentiles))
    out.update(summarize_ms("tpot", [v for t in ok if (v := t.tpot) is not None], percentiles))
    out.update(summarize_ms("itl", [g for t in ok for g in t.itls], percentiles))
    out.update(summarize_ms("e2el", [t.latency for t in ok], percentiles))
    return out


@dataclass(slots=True)
class PhaseTimes:
    """One direct-engine run of N sequences: prefill and decode wall time and token counts."""

    num_seqs: int
    prompt_tokens: int
    output_tokens: int
    prefill_s: float
    decode_s: float
    prefill_output_tokens: int = 0  # tokens sampled during the prefill phase (first tokens)

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s

    def as_row(self) -> dict[str, float]:
        """The table row: wall ms per phase, and tok/s for prompt, decode and whole run."""
        decode_tokens = self.output_tokens - self.prefill_output_tokens
        return {
            "n": self.num_seqs,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "prefill_ms": self.prefill_s * 1000.0,
            "decode_ms": self.decode_s * 1000.0,
            "total_ms": self.total_s * 1000.0,
            "prefill_tok_s": throughput(self.prompt_tokens, self.prefill_s),
            "decode_tok_s": throughput(decode_tokens, self.decode_s),
            "output_tok_s": throughput(self.output_tokens, self.total_s),
        }


def median_row(rows: Sequence[dict[str, float]]) -> dict[str, float]:
    """Key-wise median of repeated runs' rows (iterations of the same N)."""
    if not rows:
        raise ValueError("median_row needs at least one row.")
    return {k: percentile([float(r[k]) for r in rows], 50.0) for k in rows[0]}


def ratio(ours: float, theirs: float) -> float:
    """ours / theirs, NaN when either side is missing or theirs is zero."""
    if theirs == 0 or math.isnan(ours) or math.isnan(theirs):
        return math.nan
    return ours / theirs
