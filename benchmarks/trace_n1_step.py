"""Where an N=1 decode step's time goes, phase by phase, beside a read of its weights'
bytes.

The one-row step runs in one parallel region (``kernels/cpu/decoder_step.py: _one_region``).
This script copies the package into a scratch folder, has each of the region's threads
read the cycle counter at the ends of every layer's phases there (``instrument``), and
runs the copy through the engine (``LLMEngine.step``, one sequence, greedy), with a read
of as many bytes as the weights (``bench_n1_bandwidth.read_vectors``) every ten steps. It
prints each phase summed over the layers (median over the steps, mean of the threads),
the LM head, the time outside the region, and the GEMVs' and the step's rates as shares
of the read. The copy compiles into its own numba cache (the first run takes minutes);
the package's own kernels and cache are left alone.

A step's share of the read mixes what the memory delivers with what does not depend on
it; here they come apart: the GEMVs against the read of the same minutes, and the fixed
costs (attention, the tails and waits, the Python around the call) in microseconds.
Single steps only (the multi-step decode calls the step without the trace).

    python benchmarks/trace_n1_step.py [--model MODEL] [--steps 120] [--prompt-len 32]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEP_SOURCE = Path("rvllm/kernels/cpu/decoder_step.py")

# The points each thread reads the cycle counter at, every layer: after the first line of
# ``_one_region`` past the previous point whose text (stripped) is this, at the layer
# loop's indent. Segment k of a layer is the time from point k to point k + 1.
POINTS = [
    "keys, values = key_cache[layer], value_cache[layer]",
    "qkv_s[layer], qkv_b[layer], qkv, items, sums)",
    "publish(counters, phase)",
    "windows[layer], num_splits, split, starts, span)",
    "publish(counters, phase + 1)",
    "_wait_fetching(counters, phase + 1, starts, span, fetched)",
    "w_o, o_s[layer], o_b[layer], delta, items, sums)",
    "publish(counters, phase + 2)",
    "_span(w_gu, 2 * items), 0)",
    "gu_b[layer], act, items, sums)",
    "publish(counters, phase + 3)",
    "_span(w_down, items), 0)",
    "down_b[layer], delta, items, sums)",
    "publish(counters, phase + 4)",
    "_span(w_next, items), 0)",
]
LAYER_INDENT = 12
SEGMENTS = [
    "QKV GEMV", "QKV tail (RoPE, cache write)", "wait for QKV (fetching the split)",
    "attention (and merge)", "wait for attention", "output GEMV",
    "output tail (residual, norm)", "wait for output", "gate/up GEMV", "gate/up tail",
    "wait for gate/up", "down GEMV", "down tail (residual, next norm)", "wait for down",
]
GEMVS = (0, 5, 8, 11)
# The LM head: a point before it and one after its wait, in row ``layers`` of the trace.
HEAD_START = "        if head_w.shape[0] > 0:\n"
HEAD_END = "            wait(counters, phase)\n"
CYCLES = '''

@intrinsic
def _cycles(typingctx):
    """The CPU's cycle counter (the trace's clock)."""
    def codegen(context, builder, signature, args):
        fn = builder.module.declare_intrinsic(
            "llvm.readcyclecounter", [], llvmlite_ir.FunctionType(llvmlite_ir.IntType(64), []))
        return builder.call(fn, [])
    return types.int64(), codegen


# [threads, layers + 1, points]; the script sets one of its model's size before it steps.
TRACE = np.zeros((64, 257, 16), np.int64)
'''


def _replace_once(source: str, old: str, new: str) -> str:
    if source.count(old) != 1:
        raise SystemExit(f"{STEP_SOURCE} changed: expected one {old.strip()!r}; update "
                         f"benchmarks/trace_n1_step.py to match it")
    return source.replace(old, new)


def instrument(source: str) -> str:
    """``decoder_step``'s source with the trace: ``_one_region`` and
    ``_step_to_logits`` take an int64 array [threads, layers + 1, 16] last, which
    ``decode_logits`` passes (the module's ``TRACE``); each thread writes its cycle
    counter at ``POINTS`` into its row."""
    source = _replace_once(source, "from numba.extending import intrinsic, overload\n",
                           "from llvmlite import ir as llvmlite_ir\n"
                           "from numba.extending import intrinsic, overload\n")
    source = _replace_once(source, "\n\n@numba.njit(cache=True, inline=\"always\")\ndef _weight(",
                           CYCLES + "\n\n@numba.njit(cache=True, inline=\"always\")\n"
                           "def _weight(")
    begin = source.index("def _one_region(")
    end = source.index("def _by_op(")
    region = source[begin:end]
    region = _replace_once(region, "greedy_logprobs, parts):", "greedy_logprobs, parts, trace):")
    region = _replace_once(region, "for _ in prange(parts):", "for th in prange(parts):")
    lines = region.split("\n")
    at = 0
    for point, after in enumerate(POINTS):
        at = next((i for i in range(at, len(lines)) if lines[i].strip() == after), None)
        if at is None:
            raise SystemExit(f"{STEP_SOURCE} changed: no line {after!r} in _one_region "
                             f"after the previous point; update benchmarks/trace_n1_step.py")
        lines.insert(at + 1, " " * LAYER_INDENT + f"trace[th, layer, {point}] = _cycles()")
        at += 2
    region = "\n".join(lines)
    region = _replace_once(region, HEAD_START,
                           "        trace[th, layers, 0] = _cycles()\n" + HEAD_START)
    region = _replace_once(region, HEAD_END,
                           HEAD_END + "            trace[th, layers, 1] = _cycles()\n")
    source = source[:begin] + region + source[end:]
    # _step_to_logits passes the trace on; the other callers pass a scratch one.
    begin = source.index("def _step_to_logits(")
    call = source.index("def stack_linears(")
    caller = _replace_once(source[begin:call], "greedy_logprobs, parts, region_rows):",
                           "greedy_logprobs, parts, region_rows, trace):")
    caller = _replace_once(caller, "        _one_region(*args)\n",
                           "        _one_region(*args, trace)\n")
    source = source[:begin] + caller + source[call:]
    source = _replace_once(
        source, "    if hidden.shape[0] == 1:\n        _one_region(*args)\n",
        "    if hidden.shape[0] == 1:\n        _one_region(*args, np.zeros("
        "(parts, norms1.shape[0] + 1, 16), np.int64))\n")
    source = _replace_once(source, "head.scale, logits, ids, logprobs, threads, region)",
                           "head.scale, logits, ids, logprobs, threads, region, TRACE)")
    return _replace_once(source,
                         "np.empty(1, np.int64), np.empty(1, np.float32),\n"
                         "                        numba.get_num_threads(), 1)",
                         "np.empty(1, np.int64), np.empty(1, np.float32),\n"
                         "                        numba.get_num_threads(), 1, TRACE)")


def traced_copy(folder: Path) -> None:
    """The package in ``folder``, its decoder step instrumented."""
    shutil.copytree(ROOT / "rvllm", folder / "rvllm",
                    ignore=shutil.ignore_patterns("__pycache__", "*.nbi", "*.nbc"))
    step = folder / STEP_SOURCE
    step.write_text(instrument(step.read_text()))


def run_traced(ns: argparse.Namespace) -> None:
    """In the child, with the traced copy first on the path."""
    import numba
    import numpy as np

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_n1_bandwidth import read_vectors, weight_bytes

    import rvllm.kernels.cpu.decoder_step as step
    from rvllm import LLM, SamplingParams

    assert Path(step.__file__).resolve().is_relative_to(Path(ns.copy).resolve())
    llm = LLM(ns.model) if ns.model else LLM()
    engine = llm.engine
    layers = engine.model_config.num_layers
    threads = numba.get_num_threads()
    step.TRACE = np.zeros((threads, layers + 1, 16), np.int64)
    nbytes = weight_bytes(llm)
    buf = np.random.default_rng(0).random((nbytes // 4096, 1024), dtype=np.float32)
    read_vectors(buf, threads)
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=ns.steps + 8)
    engine.add_request("trace", {"prompt_token_ids": list(range(10, 10 + ns.prompt_len))},
                       params)
    while engine.has_idle_work:  # the fresh cache blocks faulted in, as a server does
        engine.idle_work()
    for _ in range(3):
        engine.step()
    traces, seconds, reads = [], [], []
    for i in range(ns.steps):
        if i % 10 == 0:
            t = time.perf_counter()
            read_vectors(buf, threads)
            reads.append(buf.nbytes / (time.perf_counter() - t))
        t = time.perf_counter()
        engine.step()
        seconds.append(time.perf_counter() - t)
        traces.append(step.TRACE.copy())
    report(np.array(traces), seconds, reads, nbytes, layers, _lm_head_bytes(llm))


def _lm_head_bytes(llm) -> int:  # noqa: ANN001 - an LLM
    panels = getattr(llm.engine.model.lm_head, "panel_weight", None)
    return 0 if panels is None else panels.nbytes


def _cycles_per_us() -> float:
    """The cycle counter's rate: the TSC's, which Linux reports as the CPU's MHz where
    the TSC is constant (as on the machines this was written on)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("cpu MHz"):
                return float(line.split(":")[1])
    except OSError:
        pass
    raise SystemExit("no cpu MHz in /proc/cpuinfo: this script reads the TSC's rate there")


def report(trace, seconds: list[float], reads: list[float], nbytes: int, layers: int,
           head_bytes: int) -> None:
    """Print the phases (us a step) and the shares of the read."""
    import numpy as np

    per_us = _cycles_per_us()
    segments = np.diff(trace[:, :, :layers, :len(POINTS)], axis=3)  # steps, threads, L, 14
    per_step = np.median(segments.sum(axis=2), axis=0).mean(axis=0) / per_us
    head = np.median(trace[:, :, layers, 1] - trace[:, :, layers, 0], axis=0).mean() / per_us
    region = np.median(trace[:, :, layers, 1].max(axis=1) - trace[:, :, 0, 0].min(axis=1))
    step_us = statistics.median(seconds) * 1e6
    read = statistics.median(reads)
    print(f"read of {nbytes / 1e6:.1f} MB: median {read / 1e9:.1f} GB/s "
          f"({min(reads) / 1e9:.1f}-{max(reads) / 1e9:.1f}); step: median {step_us:.0f} us, "
          f"{nbytes / read * 1e6 / step_us:.1%} of the read")
    print(f"{'phase, summed over the layers':40s} {'us a step':>10s}")
    for name, us in zip(SEGMENTS, per_step):
        print(f"{name:40s} {us:10.0f}")
    gemvs = sum(per_step[i] for i in GEMVS)
    layer_bytes = nbytes - head_bytes
    print(f"{'LM head (and its wait)':40s} {head:10.0f}")
    print(f"{'outside the region (engine, Python)':40s} {step_us - region / per_us:10.0f}")
    print(f"layers' GEMVs: {layer_bytes / gemvs / 1e3:.1f} GB/s, "
          f"{layer_bytes / read * 1e6 / gemvs:.1%} of the read; LM head: "
          f"{head_bytes / head / 1e3:.1f} GB/s, {head_bytes / read * 1e6 / head:.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the built-in default model")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--work-dir", default=str(Path(tempfile.gettempdir()) / "rvllm-trace"),
                        help="where the traced copy and its numba cache go (the cache is "
                        "kept: numba's cache is per source path, so a rerun loads it)")
    parser.add_argument("--copy", help=argparse.SUPPRESS)  # the child's: the traced copy
    ns = parser.parse_args()
    if ns.copy:
        run_traced(ns)
        return
    work = Path(ns.work_dir)
    folder = work / "copy"
    shutil.rmtree(folder, ignore_errors=True)
    traced_copy(folder)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(work / "numba-cache"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(folder),
                                                        os.environ.get("PYTHONPATH")])))
    command = [sys.executable, str(Path(__file__).resolve()), "--copy", str(folder),
               "--steps", str(ns.steps), "--prompt-len", str(ns.prompt_len)]
    command += ["--model", ns.model] if ns.model else []
    sys.exit(subprocess.call(command, env=env, cwd=folder))


if __name__ == "__main__":
    main()
