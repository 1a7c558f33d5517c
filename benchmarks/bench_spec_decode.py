#!/usr/bin/env python3
"""What prompt-lookup (n-gram) speculative decoding gives the offline engine.

Per model (the default SmolLM2-135M-Instruct GGUF, and the random Llama of
``build_random_llama.py``), float32 on the CPU, per workload:

* quote: prompts that ask to repeat, copy or lightly reformat a passage of 200-400 tokens
  of rvllm's own source or docs given in the prompt (``rvllm bench serve --dataset
  quote``'s prompts), through the chat template. A model without one (the random Llama)
  gets the instruction and passage as plain text followed by the first half of the
  passage's tokens again, so that its prompt already quotes itself.
* chat: short open questions with no passage ("Write a short story about ...").

at N=1 (``--n1-prompts`` different prompts, one ``llm.generate`` each, max_tokens 256:
the sum of their tokens over the sum of their wall times) and N=8 and N=32 (that many
prompts in one ``llm.generate``, max_tokens 128), greedy, stopping at EOS. Decode tok/s
is generated tokens over the wall time of ``llm.generate``. Each configuration is its own
``LLM``: no speculation, and ``ngram`` with k=4, prompt_lookup_min 2, max 4 (and k=6,
min 1 on quote at N=1), vLLM's default ``disable_by_batch_size`` of 4, so a step with
more running sequences than that does not speculate (and, to see what that limit saves,
k=4 with the limit at 64 on quote at N=8 and 32: ``ngram_k4_batch``); at N=1 also the
model proposers, k=3: ``self_draft_k3`` (the target's first quarter of layers) and, for a
Hugging Face target, ``draft_model_k3`` (a checkpoint of its first ``--draft-layers``
layers, written to the temporary directory). Every instance
first prefills every prompt it runs once (max_tokens 1, which leaves them in its prefix
cache, so the timed runs are decode-bound) and generates 48 tokens of a quote prompt (the
draft-and-verify path); then the runs alternate (none, spec, none, spec) and the median
of each is reported (one more round, and the median of three, where a configuration's
two runs differ by more than 15%: another process took the cores), with their ratio, the
acceptance rate (accepted / drafted tokens), the mean acceptance length (1 + accepted /
drafts), the mean draft length and the accepted count per draft position, from the
engine's ``spec_stats`` over the timed runs. Greedy outputs with and without speculation
are compared token for token (and each configuration's repeats with each other): any
difference is printed loudly and recorded.

    python benchmarks/bench_spec_decode.py [--models default,/work/peers/random-llama]
        [--ns 1,8,32] [--n1-prompts 3] [--repeats 2] [--no-k6] [--no-batch-spec]
        [--no-self-draft] [--draft-layers 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent / "results" / "2026-12-06-spec" / "spec-decode.json"
RANDOM_LLAMA = "/work/peers/random-llama"

NGRAM_K4 = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
            "prompt_lookup_max": 4}
NGRAM_K6 = {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 1,
            "prompt_lookup_max": 4}
# Runs of one configuration that differ by more than this were disturbed (a shared
# machine): the alternation gets one more round and the median is of three.
NOISY = 1.15
# Batches speculate too: no step has more running sequences than this.
NGRAM_K4_BATCH = {**NGRAM_K4, "disable_by_batch_size": 64}
# The target's first quarter of layers (the default) as its own draft, at N=1.
SELF_DRAFT_K3 = {"method": "self_draft", "num_speculative_tokens": 3}

CHAT_QUESTIONS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue.",
    "What are the main differences between a cat and a dog as pets?",
    "Give me three tips for learning to play the guitar.",
    "Describe a perfect day at the beach.",
    "Why do leaves change color in autumn?",
    "Write a poem about the moon.",
    "How does a bicycle stay upright?",
    "What should I pack for a weekend camping trip?",
    "Explain how a rainbow forms.",
    "Write a short story about a robot learning to paint.",
    "What are some healthy breakfast ideas?",
    "Why is exercise good for the brain?",
    "Describe the water cycle to a ten-year-old.",
    "What makes a good friend?",
    "Write a letter to your future self.",
    "How do bees make honey?",
    "Explain what a computer program is.",
    "Write a short story about a dragon who is afraid of fire.",
    "What are the benefits of reading books?",
    "How do airplanes fly?",
    "Describe your favorite season and why you like it.",
    "Give me a recipe for a simple vegetable soup.",
    "Why do we need sleep?",
    "Write a short story about a lost kitten finding its way home.",
    "Explain how plants make their food.",
    "What are some ways to save energy at home?",
    "Describe a city in the year 2100.",
    "How do volcanoes erupt?",
    "Write a haiku about the ocean and explain it.",
    "What is the difference between weather and climate?",
    "Tell me about the history of the bicycle.",
]


def code_state() -> dict[str, Any]:
    """The commit and the files changed since it (read-only git): the engine may be
    edited between runs."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                                  check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return ""

    return {"commit": git("rev-parse", "HEAD"),
            "changed_files": git("status", "--porcelain", "--untracked-files=no").splitlines()}


# --------------------------------------------------------------------------- prompts


def has_chat_template(tokenizer: Any) -> bool:
    if not tokenizer.chat_template:
        return False
    try:
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                      add_generation_prompt=True)
    except Exception:  # a template that does not render: plain text instead
        return False
    return True


def encode_chat(tokenizer: Any, text: str, chat: bool) -> list[int]:
    if chat:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                 add_generation_prompt=True)
        return tokenizer.encode(rendered, add_special_tokens=False)
    return tokenizer.encode(text)


def build_prompts(tokenizer: Any, count: int, seed: int) -> dict[str, list[list[int]]]:
    """Token ids of ``count`` quote prompts and ``count`` chat prompts."""
    from rvllm.bench.serve import quote_prompts

    chat = has_chat_template(tokenizer)
    quote = []
    for text in quote_prompts(count, 300, random.Random(seed)):
        ids = encode_chat(tokenizer, text, chat)
        if not chat:  # no template: the passage's first half again, "twice-ish"
            passage = tokenizer.encode(text.split("\n\n", 1)[1], add_special_tokens=False)
            ids = ids + passage[:len(passage) // 2]
        quote.append(ids)
    questions = [CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)] for i in range(count)]
    return {"quote": quote, "chat": [encode_chat(tokenizer, q, chat) for q in questions]}


# ------------------------------------------------------------------------------ runs


def spec_counters(llm: Any) -> tuple[int, int, int, list[int]]:
    s = llm.engine.spec_stats
    return s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, list(s.accepted_per_pos)


def timed_run(llm: Any, prompts: list[list[int]], n: int, max_tokens: int) -> dict[str, Any]:
    """One measured run: N=1 is one ``generate`` per prompt (times summed), else all the
    prompts in one ``generate``. Tokens, seconds, CPU seconds, spec counters' deltas."""
    import rvllm

    params = rvllm.SamplingParams(temperature=0.0, max_tokens=max_tokens)
    before = spec_counters(llm)
    load = os.getloadavg()[0]
    cpu = os.times()
    seconds = 0.0
    outputs = []
    groups = [[p] for p in prompts] if n == 1 else [prompts]
    for group in groups:
        start = time.perf_counter()
        outputs += llm.generate(group, params)
        seconds += time.perf_counter() - start
    end = os.times()
    after = spec_counters(llm)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    drafts, drafted, accepted = (a - b for a, b in zip(after[:3], before[:3]))
    return {"seconds": seconds, "output_tokens": tokens, "output_tok_s": tokens / seconds,
            "cpu_s": (end.user - cpu.user) + (end.system - cpu.system),
            "load_1m_before": load, "num_drafts": drafts, "num_draft_tokens": drafted,
            "num_accepted_tokens": accepted,
            "accepted_per_pos": [a - b for a, b in zip(after[3], before[3])],
            "finish_reasons": _count(str(o.outputs[0].finish_reason) for o in outputs),
            "token_ids": [list(o.outputs[0].token_ids) for o in outputs]}


def _count(values: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    return counts


def compare(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """How many outputs differ, and where the first few part."""
    diffs = []
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            at = next((j for j, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            diffs.append({"prompt": i, "first_diff_at": at, "len_a": len(x), "len_b": len(y)})
    return {"identical": not diffs and len(a) == len(b), "num_different": len(diffs),
            "first_diffs": diffs[:5]}


def noisy(runs: dict[str, list[dict[str, Any]]]) -> bool:
    """Whether any configuration's runs differ by more than ``NOISY``."""
    return any(max(r["output_tok_s"] for r in rs) > NOISY * min(r["output_tok_s"] for r in rs)
               for rs in runs.values() if rs)


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    drafts = sum(r["num_drafts"] for r in runs)
    drafted = sum(r["num_draft_tokens"] for r in runs)
    accepted = sum(r["num_accepted_tokens"] for r in runs)
    per_pos = [sum(col) for col in zip(*(r["accepted_per_pos"] for r in runs))]
    rates = [r["output_tok_s"] for r in runs]
    return {"output_tok_s": statistics.median(rates),
            "spread": max(rates) / min(rates),  # well above 1: a run was starved
            "runs": [{k: v for k, v in r.items() if k != "token_ids"} for r in runs],
            "num_drafts": drafts, "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else None,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
            "mean_draft_len": drafted / drafts if drafts else None,
            "accepted_per_pos": per_pos}


# --------------------------------------------------------------------------- driver


def runs_config(name: str, workload: str, n: int) -> bool:
    """Whether configuration ``name`` runs this workload at this N."""
    if name == "ngram_k6_min1":
        return workload == "quote" and n == 1
    if name == "ngram_k4_batch":
        return workload == "quote" and n > 1
    if name in ("self_draft_k3", "draft_model_k3"):
        return n == 1
    return True


def first_layers_checkpoint(model: str, layers: int, out_dir: Path) -> str:
    """A Hugging Face checkpoint of ``model``'s first ``layers`` decoder layers with its
    embeddings, final norm, LM head and tokenizer: a draft model with the target's
    vocabulary, written to ``out_dir``."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    src = Path(model)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {}
    for shard in sorted(src.glob("*.safetensors")):
        for name, t in load_file(shard).items():
            parts = name.split(".")
            if "layers" in parts and int(parts[parts.index("layers") + 1]) >= layers:
                continue
            tensors[name] = t
    save_file(tensors, out_dir / "model.safetensors")
    for extra in ("tokenizer.json", "tokenizer_config.json", "generation_config.json",
                  "special_tokens_map.json"):
        if (src / extra).exists():
            shutil.copy(src / extra, out_dir / extra)
    return str(out_dir)


def run_model(model: str | None, ns: argparse.Namespace) -> dict[str, Any]:
    import torch

    import rvllm

    configs: dict[str, dict[str, Any] | None] = {"none": None, "ngram_k4": NGRAM_K4}
    if ns.k6:
        configs["ngram_k6_min1"] = NGRAM_K6
    if ns.batch_spec and any(n > 1 for n in ns.ns):
        configs["ngram_k4_batch"] = NGRAM_K4_BATCH
    if ns.self_draft and 1 in ns.ns:
        configs["self_draft_k3"] = SELF_DRAFT_K3
    if ns.draft_layers and 1 in ns.ns and model is not None and Path(model).is_dir():
        draft = first_layers_checkpoint(model, ns.draft_layers,
                                        Path(tempfile.gettempdir())
                                        / f"rvllm-draft-{ns.draft_layers}-{Path(model).name}")
        configs["draft_model_k3"] = {"method": "draft_model", "num_speculative_tokens": 3,
                                     "model": draft}
    llms = {}
    startup = {}
    for name, spec in configs.items():
        start = time.perf_counter()
        llms[name] = rvllm.LLM(model, speculative_config=spec)
        startup[name] = time.perf_counter() - start
    tokenizer = llms["none"].get_tokenizer()
    count = max(ns.ns + [ns.n1_prompts])
    prompts = build_prompts(tokenizer, count, ns.seed)
    label = model or "default (SmolLM2-135M-Instruct GGUF)"
    # Warm-up: every prompt prefilled once (into the prefix cache), then drafting.
    for name, llm in llms.items():
        start = time.perf_counter()
        n1 = prompts["quote"][:ns.n1_prompts] + prompts["chat"][:ns.n1_prompts]
        used = {"ngram_k6_min1": prompts["quote"][:ns.n1_prompts], "self_draft_k3": n1,
                "draft_model_k3": n1,
                "ngram_k4_batch": prompts["quote"]}.get(name,
                                                        prompts["quote"] + prompts["chat"])
        llm.generate(used, rvllm.SamplingParams(temperature=0.0, max_tokens=1))
        llm.generate(prompts["quote"][:1], rvllm.SamplingParams(temperature=0.0,
                                                                max_tokens=48))
        print(f"[{label}] warm-up {name}: {time.perf_counter() - start:.1f}s", flush=True)
    results = []
    for workload in ("quote", "chat"):
        for n in ns.ns:
            max_tokens = ns.n1_max_tokens if n == 1 else ns.max_tokens
            batch = prompts[workload][:ns.n1_prompts if n == 1 else n]
            names = [c for c in configs if runs_config(c, workload, n)]
            runs: dict[str, list[dict[str, Any]]] = {c: [] for c in names}
            rounds = 0
            while rounds < ns.repeats or (rounds == ns.repeats and ns.retry
                                          and noisy(runs)):
                rounds += 1
                if rounds > ns.repeats:
                    print(f"!!! [{label}] {workload} N={n}: repeats differ by more than "
                          f"{NOISY:.2f}x (another process on the cores?): one more round",
                          flush=True)
                for c in names:
                    run = timed_run(llms[c], batch, n, max_tokens)
                    runs[c].append(run)
                    rate = (f", accept {run['num_accepted_tokens']}/{run['num_draft_tokens']}"
                            if run["num_drafts"] else "")
                    print(f"[{label}] {workload} N={n} {c:>14}: {run['output_tokens']} tok in "
                          f"{run['seconds']:.2f}s = {run['output_tok_s']:.1f} tok/s (cpu "
                          f"{run['cpu_s']:.1f}s, load {run['load_1m_before']:.2f}{rate})",
                          flush=True)
            entry: dict[str, Any] = {
                "workload": workload, "n": n, "max_tokens": max_tokens,
                "num_prompts": len(batch), "rounds": rounds,
                "prompt_tokens": [len(p) for p in batch],
                "configs": {c: summarize(r) for c, r in runs.items()}}
            base = entry["configs"]["none"]["output_tok_s"]
            entry["ratio_vs_none"] = {c: s["output_tok_s"] / base
                                      for c, s in entry["configs"].items() if c != "none"}
            ref = runs["none"][0]["token_ids"]
            checks = {}
            for c, r in runs.items():
                for i, run in enumerate(r):
                    if c == "none" and i == 0:
                        continue
                    checks[f"none#0 vs {c}#{i}"] = compare(ref, run["token_ids"])
            for c, summary in entry["configs"].items():
                if summary["spread"] > NOISY:
                    print(f"!!! [{label}] {workload} N={n} {c}: runs differ "
                          f"{summary['spread']:.2f}x", flush=True)
            entry["output_checks"] = checks
            entry["outputs_identical"] = all(v["identical"] for v in checks.values())
            if not entry["outputs_identical"]:
                bad = {k: v for k, v in checks.items() if not v["identical"]}
                print(f"!!! [{label}] {workload} N={n}: GREEDY OUTPUTS DIFFER: {bad}",
                      flush=True)
            results.append(entry)
    out = {"model": label, "chat_template": has_chat_template(tokenizer),
           "startup_s": startup, "torch_threads": torch.get_num_threads(),
           "dtype": str(llms["none"].engine.model_config.dtype), "results": results,
           "sample_quote_output": tokenizer.decode(
               runs_sample(llms["none"], prompts["quote"][0]))}
    for llm in llms.values():
        llm.engine.shutdown()
    llms.clear()
    gc.collect()
    return out


def runs_sample(llm: Any, prompt: list[int]) -> list[int]:
    """The first 80 greedy tokens of one prompt, to show what the model does with it."""
    import rvllm

    out = llm.generate([prompt], rvllm.SamplingParams(temperature=0.0, max_tokens=80))
    return list(out[0].outputs[0].token_ids)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=f"default,{RANDOM_LLAMA}",
                        help="comma-separated; 'default' is the built-in SmolLM2")
    parser.add_argument("--ns", default="1,8,32", help="concurrencies")
    parser.add_argument("--n1-prompts", type=int, default=3,
                        help="different prompts run one at a time at N=1")
    parser.add_argument("--n1-max-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128, help="at N > 1")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each, alternating")
    parser.add_argument("--no-k6", dest="k6", action="store_false",
                        help="skip ngram k=6, min 1 (quote, N=1)")
    parser.add_argument("--no-retry", dest="retry", action="store_false",
                        help="no extra round where a configuration's repeats differ by more "
                             f"than {NOISY}x")
    parser.add_argument("--no-batch-spec", dest="batch_spec", action="store_false",
                        help="skip ngram k=4 with disable_by_batch_size 64 (quote, N>1)")
    parser.add_argument("--no-self-draft", dest="self_draft", action="store_false",
                        help="skip self-draft (the first quarter of layers), k=3, at N=1")
    parser.add_argument("--draft-layers", type=int, default=3, metavar="L",
                        help="draft_model k=3 at N=1 with a draft of the target's first L "
                             "layers, written to the temporary directory (Hugging Face "
                             "targets only; 0: none)")
    parser.add_argument("--seed", type=int, default=0, help="picks the quoted passages")
    parser.add_argument("--json", default=str(OUT), metavar="PATH")
    ns = parser.parse_args()
    ns.ns = [int(x) for x in ns.ns.split(",")]

    from rvllm.bench.report import format_table, lscpu, machine_info, write_json

    command = "python " + shlex.join(sys.argv)
    code = code_state()  # before the engine's modules load
    begin = time.perf_counter()
    load_start = os.getloadavg()
    models = []
    for name in ns.models.split(","):
        name = name.strip()
        models.append(run_model(None if name == "default" else name, ns))
    rows = []
    for m in models:
        for e in m["results"]:
            for c, s in e["configs"].items():
                if c == "none":
                    continue
                rows.append({
                    "model": Path(m["model"]).name if "/" in m["model"] else "smollm2",
                    "workload": e["workload"], "N": e["n"], "spec": c,
                    "none tok/s": e["configs"]["none"]["output_tok_s"],
                    "spec tok/s": s["output_tok_s"],
                    "ratio": f"{e['ratio_vs_none'][c]:.2f}",
                    "accept rate": ("-" if s["acceptance_rate"] is None
                                    else f"{s['acceptance_rate']:.2f}"),
                    "mean acc len": ("-" if s["mean_acceptance_length"] is None
                                     else f"{s['mean_acceptance_length']:.2f}"),
                    "drafts": s["num_drafts"],
                    "identical": "yes" if e["outputs_identical"] else "NO"})
    print(format_table(rows, [(k, k) for k in rows[0]]))
    result = {
        "benchmark": "spec-decode",
        "command": command,
        "machine": {"lscpu": lscpu(), **machine_info()},
        "code": code,
        "load_avg_start": load_start, "load_avg_end": os.getloadavg(),
        "config": {"ns": ns.ns, "n1_prompts": ns.n1_prompts,
                   "n1_max_tokens": ns.n1_max_tokens, "max_tokens": ns.max_tokens,
                   "repeats": ns.repeats, "temperature": 0.0, "ignore_eos": False,
                   "retry": (f"one more round where a configuration's runs differ by more "
                             f"than {NOISY}x" if ns.retry else None),
                   "seed": ns.seed, "order": "alternating per repeat: none, ngram_k4"
                   + (", ngram_k6_min1 (quote N=1)" if ns.k6 else "")
                   + (", ngram_k4_batch (quote N>1)" if ns.batch_spec else ""),
                   "warm_up": "each instance: every prompt with max_tokens 1 (prefix cache), "
                              "then one quote prompt with max_tokens 48",
                   "spec_configs": {"ngram_k4": NGRAM_K4, "ngram_k6_min1": NGRAM_K6,
                                    "ngram_k4_batch": NGRAM_K4_BATCH,
                                    "self_draft_k3": SELF_DRAFT_K3,
                                    "draft_model_k3": (f"the target's first {ns.draft_layers} "
                                                       "layers as a checkpoint, k=3")},
                   "disable_by_batch_size": "default (4) but ngram_k4_batch's 64"},
        "summary": rows,
        "models": models,
        "total_s": time.perf_counter() - begin,
    }
    write_json(ns.json, result)
    print(f"wrote {ns.json} ({result['total_s']:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
