"""Read a folder of benchmark results and print them as Markdown tables, with rvllm's
ratio to each peer measured in the same run.

Result files are named ``<kind>-<workload>-<engine>.json`` (kind: engine, serve, race,
micro); ``scripts/bench_peers.sh`` writes them so.

    python -m rvllm.bench.compare benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from rvllm.bench.stats import ratio

KINDS = ("engine", "serve", "race", "micro")
OURS = "rvllm"


def is_ours(engine: str) -> bool:
    """rvllm and its variants (``rvllm-int8``, ...) as ``rvllm benchmark --label`` names them."""
    return engine == OURS or engine.startswith(OURS + "-")


def load_results(folder: str | Path) -> dict[str, dict[str, dict[str, dict[str, Any]]]]:
    """{kind: {workload: {engine: result}}} from the folder's ``<kind>-...json`` files."""
    grouped: dict[str, dict[str, dict[str, dict[str, Any]]]] = defaultdict(
        lambda: defaultdict(dict))
    for path in sorted(Path(folder).glob("*.json")):
        kind = path.stem.split("-", 1)[0]
        if kind not in KINDS:
            continue
        result = json.loads(path.read_text(encoding="utf-8"))
        engine = result.get("engine") or "?"
        workload = path.stem[len(kind) + 1:].removesuffix(f"-{engine}") or "default"
        grouped[kind][workload][engine] = result
    return grouped


def engine_order(engines: list[str]) -> list[str]:
    """rvllm and its variants first, the peers after them in name order."""
    return sorted(engines, key=lambda e: (not is_ours(e), e != OURS, e))


def _fmt(value: float, digits: int = 1) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) \
        else f"{value:.{digits}f}"


def _ratio_cell(ours: float, theirs: float) -> str:
    r = ratio(ours, theirs)
    return "-" if math.isnan(r) else f"{r:.2f}x"


def engine_table(results: dict[str, dict[str, Any]], key: str = "output_tok_s") -> str:
    """Rows per N; a column of ``key`` per engine, then each rvllm variant's ratio to each
    peer (measured in the same run)."""
    engines = engine_order(list(results))
    ours = [e for e in engines if is_ours(e)]
    peers = [e for e in engines if not is_ours(e)]
    pairs = [(o, p) for o in ours for p in peers]
    by_n: dict[int, dict[str, float]] = defaultdict(dict)
    for e in engines:
        for row in results[e]["rows"]:
            by_n[int(row["n"])][e] = float(row[key])
    head = ["N"] + engines + [f"{o}/{p}" for o, p in pairs]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for n in sorted(by_n):
        cells = [str(n)] + [_fmt(by_n[n].get(e, math.nan)) for e in engines]
        cells += [_ratio_cell(by_n[n].get(o, math.nan), by_n[n].get(p, math.nan))
                  for o, p in pairs]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


SERVE_ROWS = [("completed", "completed", 0), ("failed", "failed", 0),
              ("request_throughput", "req/s", 2), ("output_throughput", "output tok/s", 1),
              ("median_ttft_ms", "median TTFT ms", 1), ("p99_ttft_ms", "p99 TTFT ms", 1),
              ("median_tpot_ms", "median TPOT ms", 1), ("p99_tpot_ms", "p99 TPOT ms", 1),
              ("median_itl_ms", "median ITL ms", 1), ("p99_itl_ms", "p99 ITL ms", 1),
              ("median_e2el_ms", "median E2EL ms", 1), ("p99_e2el_ms", "p99 E2EL ms", 1)]


def serve_table(results: dict[str, dict[str, Any]]) -> str:
    engines = engine_order(list(results))
    lines = ["| metric | " + " | ".join(engines) + " |", "|---|" + "---|" * len(engines)]
    for key, label, digits in SERVE_ROWS:
        cells = [_fmt(float(results[e]["metrics"].get(key, math.nan)), digits)
                 for e in engines]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


RACE_ROWS = [("ready_s", "launch -> ready s"), ("first_completion_s", "first completion s"),
             ("workload_s", "workload s"), ("launch_to_finished_s", "launch -> finished s"),
             ("shutdown_s", "shutdown s")]


def race_table(results: dict[str, dict[str, Any]]) -> str:
    engines = engine_order(list(results))
    lines = ["| phase | " + " | ".join(engines) + " |", "|---|" + "---|" * len(engines)]
    for key, label in RACE_ROWS:
        cells = [_fmt(float(results[e]["phases"].get(key, math.nan)), 2) for e in engines]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    cells = [_fmt(float(results[e]["launch_to_finished_tok_s"])) for e in engines]
    lines.append("| launch-to-finished tok/s | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def micro_table(result: dict[str, Any]) -> str:
    lines = ["| operation | rvllm us | NumPy us | rvllm vs NumPy |", "|---|---|---|---|"]
    for r in result["rows"]:
        lines.append(f"| {r['op']} | {_fmt(r['rvllm_us'])} | {_fmt(r['numpy_us'])} | "
                     f"{_fmt(r['speedup_vs_numpy'], 2)}x |")
    return "\n".join(lines)


def markdown_report(folder: str | Path) -> str:
    grouped = load_results(folder)
    parts = []
    for workload, results in sorted(grouped["engine"].items()):
        parts.append(f"### Direct engine, {workload}: output tok/s (prefill + decode)\n\n"
                     + engine_table(results))
        parts.append(f"### Direct engine, {workload}: decode tok/s\n\n"
                     + engine_table(results, "decode_tok_s"))
        parts.append(f"### Direct engine, {workload}: prefill tok/s\n\n"
                     + engine_table(results, "prefill_tok_s"))
    for workload, results in sorted(grouped["serve"].items()):
        parts.append(f"### HTTP serving, {workload}\n\n" + serve_table(results))
    for workload, results in sorted(grouped["race"].items()):
        parts.append(f"### Launch-to-finished race, {workload}\n\n" + race_table(results))
    for workload, results in sorted(grouped["micro"].items()):
        for result in results.values():
            parts.append(f"### CPU-side micro-benchmarks ({workload})\n\n" + micro_table(result))
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rvllm.bench.compare",
                                     description="benchmark results as Markdown tables")
    parser.add_argument("folder", nargs="?", default="benchmarks/results")
    args = parser.parse_args(argv)
    print(markdown_report(args.folder), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
