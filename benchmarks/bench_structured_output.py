#!/usr/bin/env python3
"""What structured output (a JSON-schema constraint) costs the offline engine.

On the default model (SmolLM2-135M-Instruct, float32 on the CPU), per grammar backend:

* throughput: 32 different short chat prompts asking for a person's record, all at once,
  greedy, ``max_tokens`` 128, stopping at EOS: output tokens per second of
  ``llm.generate`` with the JSON schema of ``rvllm bench serve --structured-outputs json``
  against the same prompts unconstrained, run alternately (none, json, none, json) after
  a warm-up of each, the median of each and their ratio. The constrained outputs are
  checked against the schema.
* mask cost: each constrained output's tokens replayed through a fresh matcher from the
  engine's manager, timing ``fill`` of a one-row int32 bitmask before every token
  (median and p99 over all tokens); and, as the engine runs them, the 32 matchers in
  lockstep through the sampler's ``apply_grammar_masks_`` (the bitmask, its unpacking
  and the masked fill of the logits) per step.
* compile time: a fresh backend (its one-time tokenizer setup timed on its own), then 20
  schemas of the same shape differing in one field name, each compiled cold.

    python benchmarks/bench_structured_output.py [--backends guidance,xgrammar]
        [--json OUT]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

OUT = (Path(__file__).resolve().parent / "results" / "2026-12-06-structured"
       / "structured-output.json")

PEOPLE = [("Alice Moreau", "Lyon"), ("Bongani Dlamini", "Durban"), ("Chen Wei", "Chengdu"),
          ("Dara O'Neill", "Cork"), ("Emeka Obi", "Lagos"), ("Freya Lind", "Malmo"),
          ("Gustavo Reis", "Porto"), ("Hana Sato", "Osaka"), ("Ivan Petrov", "Kazan"),
          ("Jasmine Khan", "Leeds"), ("Kofi Mensah", "Accra"), ("Lucia Rossi", "Turin"),
          ("Mateo Silva", "Cusco"), ("Nadia Haddad", "Beirut"), ("Oscar Berg", "Bergen"),
          ("Priya Nair", "Kochi")]
JOBS = ["software engineer", "graphic designer"]


def person_prompts(count: int) -> list[str]:
    """``count`` distinct short requests for a person's record."""
    prompts = []
    for i in range(count):
        name, city = PEOPLE[i % len(PEOPLE)]
        job = JOBS[(i // len(PEOPLE)) % len(JOBS)]
        prompts.append(f"Write a JSON profile record for {name}, a {20 + i}-year-old {job} "
                       f"living in {city}. Include a rating and a few tags.")
    return prompts


def pct(values: list[float], q: float) -> float:
    from rvllm.bench.stats import percentile

    return percentile(values, q)


# ------------------------------------------------------------------------ throughput


def timed_generate(llm: Any, prompts: list[list[int]], params: Any) -> dict[str, Any]:
    """One ``llm.generate``, with the process's CPU seconds beside its wall seconds: on a
    shared machine a run whose CPU time falls far below threads x wall time was starved
    by other processes."""
    load = os.getloadavg()[0]
    cpu = os.times()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    end = os.times()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"seconds": seconds, "output_tokens": tokens, "output_tok_s": tokens / seconds,
            "cpu_s": (end.user - cpu.user) + (end.system - cpu.system),
            "load_1m_before": load, "outputs": outputs}


def check_outputs(outputs: list[Any], schema: dict[str, Any]) -> dict[str, Any]:
    """How many outputs are JSON, how many match ``schema``, and why the rest do not."""
    import jsonschema

    parsed = valid = 0
    problems = []
    finish: dict[str, int] = {}
    for i, out in enumerate(outputs):
        c = out.outputs[0]
        finish[str(c.finish_reason)] = finish.get(str(c.finish_reason), 0) + 1
        try:
            value = json.loads(c.text)
        except json.JSONDecodeError as e:
            problems.append(f"#{i} ({c.finish_reason}, {len(c.token_ids)} tokens): not JSON: "
                            f"{e.msg} in {c.text[-60:]!r}")
            continue
        parsed += 1
        try:
            jsonschema.validate(value, schema)
            valid += 1
        except jsonschema.ValidationError as e:
            problems.append(f"#{i}: schema: {e.message[:120]}")
    return {"json_parsed": parsed, "schema_valid": valid, "finish_reasons": finish,
            "problems": problems[:8]}


# ------------------------------------------------------------------------- mask cost


def mask_cost(llm: Any, spec: Any, outputs: list[Any]) -> dict[str, Any]:
    """Replay each output through a fresh matcher, timing ``fill`` before every token."""
    import torch

    engine = llm.engine
    manager = engine.structured_outputs
    compiled = manager.compile(spec).result()  # the engine's cached grammar
    eos = engine.eos_token_ids
    bitmask = torch.zeros((1, (engine.model_config.vocab_size + 31) // 32), dtype=torch.int32)
    times_us: list[float] = []
    masked_out = rejected = 0
    for out in outputs:
        matcher = manager.matcher(compiled)
        token_ids = list(out.outputs[0].token_ids)
        for j, token in enumerate(token_ids):
            start = time.perf_counter_ns()
            matcher.fill(bitmask, 0)
            times_us.append((time.perf_counter_ns() - start) / 1000)
            if not int(bitmask[0, token >> 5]) >> (token & 31) & 1:
                masked_out += 1  # the engine sampled a token its grammar did not allow
            if j == len(token_ids) - 1 and token in eos:
                break  # the engine stops at EOS before its grammar sees it
            if not matcher.accept(token):
                rejected += 1
                break
    return {"tokens": len(times_us), "fill_p50_us": pct(times_us, 50),
            "fill_p99_us": pct(times_us, 99), "fill_mean_us": statistics.fmean(times_us),
            "fill_max_us": max(times_us), "tokens_outside_mask": masked_out,
            "tokens_rejected": rejected}


def engine_mask_steps(llm: Any, spec: Any, outputs: list[Any]) -> dict[str, Any]:
    """The outputs' matchers in lockstep, each step through the sampler's
    ``apply_grammar_masks_`` on float32 logits of the live rows, as a decode step does."""
    import torch

    from rvllm.layers.sampler import apply_grammar_masks_

    engine = llm.engine
    manager = engine.structured_outputs
    compiled = manager.compile(spec).result()
    vocab = engine.model_config.vocab_size
    live = [(manager.matcher(compiled), list(o.outputs[0].token_ids)) for o in outputs]
    logits = torch.zeros((len(live), vocab), dtype=torch.float32)
    step_ms = []
    for step in range(max(len(t) for _, t in live)):
        live = [(m, t) for m, t in live if step < len(t)]
        rows = logits[:len(live)]
        start = time.perf_counter()
        apply_grammar_masks_(rows, list(range(len(live))), [m for m, _ in live])
        step_ms.append((time.perf_counter() - start) * 1000)
        for m, t in live:
            if step < len(t) - 1 or t[step] not in engine.eos_token_ids:
                m.accept(t[step])
    return {"steps": len(step_ms), "rows_first_step": len(outputs),
            "step_p50_ms": pct(step_ms, 50), "step_p99_ms": pct(step_ms, 99),
            "step_mean_ms": statistics.fmean(step_ms)}


# ---------------------------------------------------------------------- compile time


def compile_cost(llm: Any, backend_name: str, num_schemas: int) -> dict[str, Any]:
    """A fresh backend (cold caches): its setup, then ``num_schemas`` distinct schemas."""
    from rvllm.bench.serve import bench_json_schema
    from rvllm.sampling_params import StructuredOutputsParams
    from rvllm.structured_output.backends import BACKENDS

    engine = llm.engine
    start = time.perf_counter()
    backend = BACKENDS[backend_name](engine.tokenizer.backend.to_str(),
                                     engine.model_config.vocab_size,
                                     sorted(engine.eos_token_ids))
    setup_s = time.perf_counter() - start
    times_ms = []
    for i in range(num_schemas):
        spec = StructuredOutputsParams(json=bench_json_schema(f"full_name_{i}"))
        start = time.perf_counter()
        backend.compile(spec)
        times_ms.append((time.perf_counter() - start) * 1000)
    return {"tokenizer_setup_s": setup_s, "num_schemas": num_schemas,
            "compile_p50_ms": pct(times_ms, 50), "compile_max_ms": max(times_ms),
            "compile_first_ms": times_ms[0], "compile_ms": times_ms}


# --------------------------------------------------------------------------- driver


def run_backend(backend_name: str, ns: argparse.Namespace) -> dict[str, Any]:
    import torch

    import rvllm
    from rvllm.bench.serve import bench_json_schema

    start = time.perf_counter()
    llm = rvllm.LLM(structured_outputs_config={"backend": backend_name})
    startup_s = time.perf_counter() - start
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True),
        add_special_tokens=False) for text in person_prompts(ns.num_requests)]
    schema = bench_json_schema()
    plain = rvllm.SamplingParams(temperature=0.0, max_tokens=ns.max_tokens)
    constrained = rvllm.SamplingParams(temperature=0.0, max_tokens=ns.max_tokens,
                                       structured_outputs=dict(json=schema))
    spec = constrained.structured_outputs
    # Warm-up, one short generate each way (this compiles the schema into the cache).
    llm.generate(prompts[:1], rvllm.SamplingParams(temperature=0.0, max_tokens=8))
    llm.generate(prompts[:1], rvllm.SamplingParams(temperature=0.0, max_tokens=8,
                                                   structured_outputs=dict(json=schema)))
    runs: dict[str, list[dict[str, Any]]] = {"none": [], "json": []}
    for i in range(2 * ns.repeats):
        kind = "none" if i % 2 == 0 else "json"
        run = timed_generate(llm, prompts, plain if kind == "none" else constrained)
        print(f"[{backend_name}] {kind:>4}: {run['output_tokens']} tokens in "
              f"{run['seconds']:.2f}s = {run['output_tok_s']:.1f} tok/s (cpu "
              f"{run['cpu_s']:.1f}s, load {run['load_1m_before']:.2f})", flush=True)
        runs[kind].append(run)
    last_json = runs["json"][-1]["outputs"]
    result: dict[str, Any] = {"backend": backend_name, "startup_s": startup_s,
                              "torch_threads": torch.get_num_threads()}
    for kind, kind_runs in runs.items():
        result[f"{kind}_runs"] = [{k: v for k, v in r.items() if k != "outputs"}
                                  for r in kind_runs]
        result[f"{kind}_output_tok_s"] = statistics.median(r["output_tok_s"] for r in kind_runs)
    result["json_vs_none_ratio"] = result["json_output_tok_s"] / result["none_output_tok_s"]
    result["json_outputs"] = check_outputs(last_json, schema)
    result["none_outputs"] = {k: v for k, v in check_outputs(runs["none"][-1]["outputs"],
                                                             schema).items()
                              if k != "problems"}
    result["json_output_sample"] = last_json[0].outputs[0].text
    mgr = llm.engine.structured_outputs
    result["engine_compile"] = {"count": mgr.compile_count,
                                "seconds_sum": mgr.compile_seconds_sum}
    result["mask"] = mask_cost(llm, spec, last_json)
    result["engine_mask_step"] = engine_mask_steps(llm, spec, last_json)
    result["compile"] = compile_cost(llm, backend_name, ns.num_schemas)
    llm.engine.shutdown()
    del llm
    gc.collect()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backends", default="guidance,xgrammar",
                        help="comma-separated grammar backends, in order")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs of each configuration, alternating")
    parser.add_argument("--num-schemas", type=int, default=20)
    parser.add_argument("--json", default=str(OUT), metavar="PATH")
    ns = parser.parse_args()

    from rvllm.bench.report import format_table, lscpu, machine_info, write_json
    from rvllm.bench.serve import bench_json_schema

    command = "python " + shlex.join(sys.argv)
    begin = time.perf_counter()
    backends = [run_backend(name.strip(), ns) for name in ns.backends.split(",")]
    rows = []
    for b in backends:
        rows.append({
            "backend": b["backend"],
            "none tok/s": b["none_output_tok_s"], "json tok/s": b["json_output_tok_s"],
            "ratio": f"{b['json_vs_none_ratio']:.3f}",
            "valid": f"{b['json_outputs']['schema_valid']}/{ns.num_requests}",
            "fill p50 us": f"{b['mask']['fill_p50_us']:.2f}",
            "fill p99 us": f"{b['mask']['fill_p99_us']:.2f}",
            "step p50 ms": f"{b['engine_mask_step']['step_p50_ms']:.2f}",
            "setup s": f"{b['compile']['tokenizer_setup_s']:.2f}",
            "compile p50 ms": f"{b['compile']['compile_p50_ms']:.2f}",
            "compile max ms": f"{b['compile']['compile_max_ms']:.2f}",
        })
    print(format_table(rows, [(k, k) for k in rows[0]]))
    for b in backends:
        for problem in b["json_outputs"]["problems"]:
            print(f"[{b['backend']}] {problem}")
    result = {
        "benchmark": "structured-output",
        "command": command,
        "machine": {"lscpu": lscpu(), **machine_info()},
        "model": "default (SmolLM2-135M-Instruct GGUF), float32, CPU",
        "config": {"num_requests": ns.num_requests, "max_tokens": ns.max_tokens,
                   "temperature": 0.0, "ignore_eos": False, "repeats": ns.repeats,
                   "order": "none, json, none, json", "num_schemas": ns.num_schemas},
        "schema": bench_json_schema(),
        "backends": backends,
        "total_s": time.perf_counter() - begin,
    }
    write_json(ns.json, result)
    print(f"wrote {ns.json} ({result['total_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
