"""The engine's compiled CPU decode step (``kernels/cpu_decoder_step._step_to_logits``)
against the same function as it was at an earlier git revision, alternated in one
process on one engine, so that the machine's drift reaches both alike (issue 6).

The old file is taken from git and imported beside the package; it must import only
what the current tree still has, and keep ``_step_to_logits``'s arguments.

    python scripts/bench_step_kernel_ab.py --model MODEL --old-rev REV [--num-seqs 1]
        [--quantization int8] [--rounds 24]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numba
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_n1_bandwidth import read_vectors, weight_bytes  # noqa: E402

from rvllm import LLM, SamplingParams  # noqa: E402
from rvllm.kernels import cpu_decoder_step  # noqa: E402

STEPS = 8  # timed steps a turn


def old_module(rev: str, folder: Path):  # noqa: ANN201 - a module
    """``cpu_decoder_step`` at ``rev``, imported from a copy in ``folder``."""
    root = Path(__file__).resolve().parents[1]
    text = subprocess.run(["git", "show", f"{rev}:rvllm/kernels/cpu_decoder_step.py"],
                          cwd=root, check=True, capture_output=True, text=True).stdout
    path = folder / "old_cpu_decoder_step.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("old_cpu_decoder_step", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look themselves up there
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--old-rev", required=True)
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--num-seqs", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=24)
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        old = old_module(ns.old_rev, Path(folder))
        llm = LLM(ns.model, quantization=ns.quantization)
        engine = llm.engine
        nbytes = weight_bytes(llm)
        buf = np.random.default_rng(0).random((nbytes // 4096, 1024), dtype=np.float32)
        parts = numba.get_num_threads()
        params = SamplingParams(temperature=0, ignore_eos=True,
                                max_tokens=2 * ns.rounds * (STEPS + 1) + 8)
        for n in range(ns.num_seqs):
            engine.add_request(None, {"prompt_token_ids": list(range(10 + n, 42 + n))}, params)
        kernels = {"new": cpu_decoder_step._step_to_logits, "old": old._step_to_logits}
        for kernel in kernels.values():  # compile or load both, and fill the prompts
            cpu_decoder_step._step_to_logits = kernel
            engine.step()
            engine.step()
        times: dict[str, list[float]] = {name: [] for name in kernels}
        reads = []
        for turn in range(ns.rounds):
            t = time.perf_counter()
            read_vectors(buf, parts)
            reads.append(buf.nbytes / (time.perf_counter() - t))
            for name in (("new", "old") if turn % 2 == 0 else ("old", "new")):
                cpu_decoder_step._step_to_logits = kernels[name]
                engine.step()  # the first step after a switch is not timed
                for _ in range(STEPS):
                    t = time.perf_counter()
                    engine.step()
                    times[name].append(time.perf_counter() - t)
        cpu_decoder_step._step_to_logits = kernels["new"]
    read = statistics.median(reads)
    print(f"{ns.model} ({ns.quantization or 'float32'}), {ns.num_seqs} sequence(s), "
          f"{parts} threads; read of {nbytes / 1e6:.0f} MB: median {read / 1e9:.1f} GB/s")
    for name, steps in times.items():
        step = statistics.median(steps)
        print(f"{name}: median step {step * 1e3:.2f} ms ({ns.num_seqs / step:.1f} tok/s, "
              f"weights at {nbytes / step / read:.0%} of the read)")


if __name__ == "__main__":
    main()
