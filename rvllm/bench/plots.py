"""PNG plots from the benchmark JSON (needs matplotlib: ``pip install rvllm[bench]``).

    python -m rvllm.bench.plots benchmarks/results --out-dir benchmarks

Writes ``engine_<workload>.png`` (tok/s against batch size, one line per engine),
``serve_<workload>.png`` (latency percentiles per engine) and ``race_<workload>.png``
(the race's phases per engine).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rvllm.bench.compare import engine_order, load_results

PERCENTILES = [("median", "median"), ("p90", "p90"), ("p99", "p99")]


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plots need matplotlib: pip install 'rvllm[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_engine(results: dict[str, dict[str, Any]], workload: str, out: Path) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    panels = [("output_tok_s", "output tok/s (whole run)"), ("decode_tok_s", "decode tok/s"),
              ("prefill_tok_s", "prefill tok/s (prompt tokens)")]
    for ax, (key, title) in zip(axes, panels):
        for engine in engine_order(list(results)):
            rows = sorted(results[engine]["rows"], key=lambda r: r["n"])
            ax.plot([r["n"] for r in rows], [r[key] for r in rows], marker="o",
                    linewidth=2.5 if engine == "rvllm" else 1.5, label=engine)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size N (sequences)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("tokens / s")
    axes[0].legend()
    cfg = next(iter(results.values()))["config"]
    fig.suptitle(f"Direct engine, {workload}: input {cfg['input_len']} / output "
                 f"{cfg['output_len']} tokens, greedy, EOS ignored")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_serve(results: dict[str, dict[str, Any]], workload: str, out: Path) -> None:
    plt = _pyplot()
    engines = engine_order(list(results))
    metrics = [("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL")]
    fig, axes = plt.subplots(1, 4, figsize=(16, 4.5))
    width = 0.8 / len(PERCENTILES)
    for ax, (key, name) in zip(axes, metrics):
        for j, (stat, label) in enumerate(PERCENTILES):
            values = [results[e]["metrics"][f"{stat}_{key}_ms"] for e in engines]
            ax.bar([i + j * width for i in range(len(engines))], values, width, label=label)
        ax.set_xticks([i + width for i in range(len(engines))], engines, rotation=15)
        ax.set_title(f"{name} (ms)")
        ax.grid(True, axis="y", alpha=0.3)
    axes[0].legend()
    cfg = results[engines[0]]["config"]
    fig.suptitle(f"HTTP serving, {workload}: {cfg['num_prompts']} requests, input "
                 f"{cfg['random_input_len']} / output {cfg['random_output_len']}, "
                 f"rate {cfg['request_rate']}, concurrency {cfg['max_concurrency']}")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def plot_race(results: dict[str, dict[str, Any]], workload: str, out: Path) -> None:
    plt = _pyplot()
    engines = engine_order(list(results))
    phases = [("ready_s", "launch -> ready"), ("first_completion_s", "first completion"),
              ("workload_s", "workload")]
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.7 * len(engines)))
    left = [0.0] * len(engines)
    for key, label in phases:
        widths = [results[e]["phases"][key] for e in engines]
        ax.barh(engines, widths, left=left, label=label)
        left = [a + b for a, b in zip(left, widths)]
    for i, e in enumerate(engines):
        ax.text(left[i], i, f"  {results[e]['launch_to_finished_tok_s']:.1f} tok/s",
                va="center")
    ax.set_xlabel("seconds from launch")
    ax.set_xlim(0, max(left) * 1.25)
    ax.invert_yaxis()
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=len(phases))
    ax.set_title(f"Launch-to-finished race, {workload}")
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rvllm.bench.plots",
                                     description="PNG plots from benchmark JSON")
    parser.add_argument("folder", nargs="?", default="benchmarks/results")
    parser.add_argument("--out-dir", default="benchmarks")
    args = parser.parse_args(argv)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    grouped = load_results(args.folder)
    plotters = {"engine": plot_engine, "serve": plot_serve, "race": plot_race}
    for kind, plot in plotters.items():
        for workload, results in sorted(grouped[kind].items()):
            path = out_dir / f"{kind}_{workload}.png"
            plot(results, workload, path)
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
