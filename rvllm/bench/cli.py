"""The benchmark commands of ``rvllm``: ``benchmark`` and
``bench serve|race|micro|soak|perplexity``.

Only argument definitions live at import; each command's module (and NumPy, torch,
the engine) loads when that command runs.
"""

from __future__ import annotations

import argparse
import importlib


def add_bench_parsers(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from rvllm.bench.engine import add_benchmark_args
    from rvllm.bench.perplexity import add_perplexity_args
    from rvllm.bench.race import add_race_args
    from rvllm.bench.serve import add_serve_bench_args
    from rvllm.bench.soak import add_soak_args

    direct = sub.add_parser("benchmark", help="direct-engine throughput per batch size")
    add_benchmark_args(direct)
    direct.set_defaults(bench_module="rvllm.bench.engine")

    bench = sub.add_parser("bench", help="serving load, launch-to-finished race, micro")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    serve = bench_sub.add_parser("serve", help="load an OpenAI-compatible server over HTTP")
    add_serve_bench_args(serve)
    serve.set_defaults(bench_module="rvllm.bench.serve")
    race = bench_sub.add_parser("race", help="launch a server, run a workload, shut it down")
    add_race_args(race)
    race.set_defaults(bench_module="rvllm.bench.race")
    micro = bench_sub.add_parser("micro", help="CPU sampling operations against NumPy")
    add_micro_args(micro)
    micro.set_defaults(bench_module="rvllm.bench.micro")
    soak = bench_sub.add_parser("soak", help="mixed, partly hostile traffic against a local "
                                "server for a while; every request accounted for")
    add_soak_args(soak)
    soak.set_defaults(bench_module="rvllm.bench.soak")
    ppl = bench_sub.add_parser("perplexity", help="perplexity of a fixed text (accuracy check)")
    add_perplexity_args(ppl)
    ppl.set_defaults(bench_module="rvllm.bench.perplexity")


def add_micro_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats (median kept)")
    parser.add_argument("--min-seconds", type=float, default=0.05,
                        help="least duration of one repeat")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results here")


def run_bench_command(args: argparse.Namespace) -> int:
    """Run the benchmark command ``args`` was parsed for."""
    return importlib.import_module(args.bench_module).main(args)
