"""The benchmark tools: argument parsing, workload building, and the arithmetic
(percentiles, throughput, TTFT/TPOT/ITL) on synthetic timings; the HTTP load generator
and the race against a tiny fake OpenAI server. No model is loaded."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from rvllm.bench import http_client
from rvllm.bench.engine import parse_batch_sizes, print_result, random_prompts
from rvllm.bench.micro import np_penalties, time_call
from rvllm.bench.report import format_table
from rvllm.bench.serve import (
    add_serve_bench_args,
    arrival_delays,
    build_dataset,
    parse_stream_event,
    request_payload,
    run_load,
)
from rvllm.bench.stats import (
    PhaseTimes,
    RequestTiming,
    median_row,
    percentile,
    ratio,
    serve_metrics,
    summarize_ms,
    throughput,
)
from rvllm.cli import build_parser


def serve_ns(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_bench_args(parser)
    return parser.parse_args(list(argv))


# ------------------------------------------------------------------ arithmetic


@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 95, 99, 100])
def test_percentile_matches_numpy_linear_interpolation(q: float) -> None:
    values = [0.31, 5.0, 0.02, 7.5, 1.25, 3.3, 9.9, 0.7]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_of_nothing_is_nan_and_bad_q_is_refused() -> None:
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match="q must be"):
        percentile([1.0], 101)


def test_summarize_ms_uses_vllm_names_and_converts_seconds() -> None:
    out = summarize_ms("ttft", [0.1, 0.2, 0.3, 0.4])
    assert out["mean_ttft_ms"] == pytest.approx(250.0)
    assert out["median_ttft_ms"] == pytest.approx(250.0)
    assert out["p99_ttft_ms"] == pytest.approx(397.0)
    assert set(out) == {"mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p50_ttft_ms",
                        "p90_ttft_ms", "p95_ttft_ms", "p99_ttft_ms"}


def test_throughput_and_ratio_are_nan_when_undefined() -> None:
    assert throughput(100, 4.0) == 25.0
    assert math.isnan(throughput(100, 0.0))
    assert ratio(3.0, 2.0) == 1.5
    assert math.isnan(ratio(3.0, 0.0))
    assert math.isnan(ratio(math.nan, 2.0))


def test_request_timing_gives_ttft_itl_and_tpot_as_vllm_defines_them() -> None:
    t = RequestTiming(start=10.0, success=True, output_tokens=4,
                      chunk_times=[10.5, 10.6, 10.8, 11.1], end=11.1)
    assert t.ttft == pytest.approx(0.5)
    assert t.itls == pytest.approx([0.1, 0.2, 0.3])
    assert t.latency == pytest.approx(1.1)
    assert t.tpot == pytest.approx((1.1 - 0.5) / 3)


def test_single_token_request_has_no_tpot() -> None:
    t = RequestTiming(start=0.0, success=True, output_tokens=1, chunk_times=[0.2], end=0.2)
    assert t.tpot is None


def test_serve_metrics_counts_failures_and_uses_only_successes() -> None:
    ok1 = RequestTiming(start=0.0, success=True, prompt_len=10, output_tokens=3,
                        chunk_times=[1.0, 1.5, 2.0], end=2.0)
    ok2 = RequestTiming(start=1.0, success=True, prompt_len=10, output_tokens=2,
                        chunk_times=[1.5, 2.5], end=3.0)
    failed = RequestTiming(start=0.0, success=False, error="boom", end=0.1)
    m = serve_metrics([ok1, ok2, failed], duration=4.0)
    assert (m["completed"], m["failed"]) == (2, 1)
    assert m["total_input_tokens"] == 20 and m["total_output_tokens"] == 5
    assert m["request_throughput"] == pytest.approx(0.5)
    assert m["output_throughput"] == pytest.approx(1.25)
    assert m["total_token_throughput"] == pytest.approx(25 / 4)
    assert m["mean_ttft_ms"] == pytest.approx(750.0)  # 1.0 s and 0.5 s
    assert m["mean_e2el_ms"] == pytest.approx(2000.0)  # 2.0 s both
    assert m["median_itl_ms"] == pytest.approx(500.0)  # gaps 0.5, 0.5, 1.0
    assert m["mean_tpot_ms"] == pytest.approx(((2.0 - 1.0) / 2 + (2.0 - 0.5) / 1) / 2 * 1000)


def test_phase_times_row_separates_prefill_and_decode() -> None:
    row = PhaseTimes(num_seqs=4, prompt_tokens=400, output_tokens=40, prefill_s=0.5,
                     decode_s=1.5, prefill_output_tokens=4).as_row()
    assert row["prefill_tok_s"] == pytest.approx(800.0)
    assert row["decode_tok_s"] == pytest.approx(36 / 1.5)
    assert row["output_tok_s"] == pytest.approx(20.0)
    assert row["total_ms"] == pytest.approx(2000.0)


def test_median_row_is_keywise() -> None:
    rows = [{"n": 4, "x": 1.0}, {"n": 4, "x": 9.0}, {"n": 4, "x": 2.0}]
    assert median_row(rows) == {"n": 4.0, "x": 2.0}


def test_format_table_aligns_and_marks_missing_values() -> None:
    text = format_table([{"a": 1, "b": 2.25}, {"a": 10, "b": math.nan}],
                        [("a", "A"), ("b", "B")])
    lines = text.splitlines()
    assert lines[0].split() == ["A", "B"]
    assert lines[2].split() == ["1", "2.2"] and lines[3].split() == ["10", "-"]


def test_result_header_names_quantized_weights(capsys: pytest.CaptureFixture[str]) -> None:
    result = {"engine": "rvllm", "model": "m", "dtype": "float32", "quantization": "int8",
              "config": {"input_len": 32, "output_len": 128, "num_iters": 1},
              "rows": [{"n": 1}]}
    print_result(result)
    assert capsys.readouterr().out.startswith("rvllm on m (float32, int8 weights), input 32")
    print_result({**result, "quantization": None})  # float32 weights
    assert capsys.readouterr().out.startswith("rvllm on m (float32), input 32")
    del result["quantization"]  # a peer's result has no such key
    print_result(result)
    assert capsys.readouterr().out.startswith("rvllm on m (float32), input 32")


# ------------------------------------------------------------------ parsing and workloads


def test_batch_sizes_parse_and_bad_ones_are_named() -> None:
    assert parse_batch_sizes("1, 4,8,") == [1, 4, 8]
    with pytest.raises(ValueError, match="'x'"):
        parse_batch_sizes("1,x")
    with pytest.raises(ValueError, match="at least 1"):
        parse_batch_sizes("0")


def test_random_prompts_are_reproducible_distinct_and_in_vocab() -> None:
    a = random_prompts(8, 32, 500, seed=3)
    assert a == random_prompts(8, 32, 500, seed=3)
    assert len({tuple(p) for p in a}) == 8
    assert all(len(p) == 32 and all(10 <= t < 500 for t in p) for p in a)


def test_poisson_arrivals_have_the_requested_rate() -> None:
    import random

    assert arrival_delays(5, math.inf, random.Random(0)) == [0.0] * 5
    gaps = arrival_delays(20000, 4.0, random.Random(0))
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.05)
    with pytest.raises(ValueError, match="request-rate"):
        arrival_delays(3, 0.0, random.Random(0))


def test_random_dataset_lengths_respect_the_range_ratio() -> None:
    ns = serve_ns("--num-prompts", "50", "--random-input-len", "100",
                  "--random-output-len", "20", "--random-range-ratio", "0.5",
                  "--random-vocab-size", "5000")
    reqs = build_dataset(ns)
    assert len(reqs) == 50
    assert all(50 <= len(r.prompt) <= 150 and r.prompt_len == len(r.prompt) for r in reqs)
    assert all(10 <= r.output_len <= 30 for r in reqs)
    assert all(1000 <= t < 5000 for r in reqs for t in r.prompt)


def test_fixed_and_chat_datasets_are_text(tmp_path: Path) -> None:
    fixed = build_dataset(serve_ns("--dataset", "fixed", "--num-prompts", "2",
                                   "--random-input-len", "12"))
    assert fixed[0].prompt == fixed[1].prompt and len(fixed[0].prompt.split()) == 12
    chat = build_dataset(serve_ns("--endpoint", "chat", "--num-prompts", "2"))
    assert isinstance(chat[0].prompt, str) and chat[0].prompt != chat[1].prompt


def test_quote_dataset_quotes_package_text_deterministically(tmp_path: Path) -> None:
    import random

    from rvllm.bench.serve import (
        QUOTE_INSTRUCTIONS,
        quote_prompts,
        quote_sources,
        workload_config,
    )

    def quote(*argv: str) -> list:
        return build_dataset(serve_ns("--dataset", "quote", "--endpoint", "chat",
                                      "--num-prompts", "6", *argv))

    reqs = quote("--random-output-len", "64")
    assert [r.prompt for r in reqs] == [r.prompt for r in quote("--random-output-len", "64")]
    assert [r.prompt for r in reqs] != [r.prompt for r in quote("--seed", "1")]
    sources = "\n".join(p.read_text(encoding="utf-8") for p in quote_sources())
    for r in reqs:
        instruction, passage = r.prompt.split("\n\n", 1)
        assert instruction in QUOTE_INSTRUCTIONS and r.output_len == 64
        body = passage.removeprefix("```python\n").removesuffix("\n```")
        assert body.strip() and body in sources  # whole lines of the package's own text
        assert 120 <= r.prompt_len <= 460  # ~300 tokens at 3.5 characters a token
    assert workload_config(serve_ns("--dataset", "quote"))["quote_len"] == 300
    # Short passages from a given source, and a source too short to quote is refused.
    text = tmp_path / "notes.md"
    text.write_text("".join(f"line {i} of the notes\n" for i in range(40)))
    short = quote_prompts(3, 20, random.Random(0), [text])
    assert all(p.split("\n\n", 1)[1] in text.read_text() for p in short)
    with pytest.raises(ValueError, match="no source text"):
        quote_prompts(1, 400, random.Random(0), [text])


def test_jsonl_dataset_cycles_its_lines_and_rejects_bad_ones(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "hello there", "output_len": 7}\n{"prompt": "bye"}\n')
    reqs = build_dataset(serve_ns("--dataset", str(path), "--num-prompts", "3"))
    assert [r.prompt for r in reqs] == ["hello there", "bye", "hello there"]
    assert [r.output_len for r in reqs] == [7, 128, 7]
    path.write_text("not json\n")
    with pytest.raises(ValueError, match=":1:"):
        build_dataset(serve_ns("--dataset", str(path)))


def test_payload_streams_with_usage_and_ignore_eos() -> None:
    ns = serve_ns("--ignore-eos", "--endpoint", "chat")
    body = request_payload(ns, "m", build_dataset(serve_ns("--endpoint", "chat",
                                                           "--num-prompts", "1"))[0])
    assert body["stream"] is True and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["messages"][0]["role"] == "user" and "prompt" not in body


def test_structured_outputs_payload_and_workload_config() -> None:
    from rvllm.bench.serve import bench_json_schema, workload_config
    from rvllm.sampling_params import StructuredOutputsParams

    def body(*argv: str) -> dict:
        ns = serve_ns("--num-prompts", "1", *argv)
        return request_payload(ns, "m", build_dataset(ns)[0])

    plain = body()
    assert not {"response_format", "structured_outputs"} & set(plain)
    assert workload_config(serve_ns())["structured_outputs"] == "none"
    chat = body("--endpoint", "chat", "--structured-outputs", "json")
    fmt = chat["response_format"]
    assert fmt["type"] == "json_schema" and fmt["json_schema"]["schema"] == bench_json_schema()
    schema = body("--structured-outputs", "json")["structured_outputs"]["json"]
    assert 5 <= len(schema["properties"]) <= 8
    assert schema["properties"]["address"]["type"] == "object"
    StructuredOutputsParams(json=schema)  # a schema the engine takes
    assert body("--endpoint", "chat", "--structured-outputs", "json_object")[
        "response_format"] == {"type": "json_object"}
    assert body("--structured-outputs", "choice")["structured_outputs"]["choice"]
    assert "regex" in body("--structured-outputs", "regex")["structured_outputs"]
    ns = serve_ns("--structured-outputs", "regex")
    assert workload_config(ns)["structured_outputs"] == "regex"
    with pytest.raises(SystemExit):
        serve_ns("--structured-outputs", "yaml")


def test_stream_events_are_read_for_text_and_usage() -> None:
    assert parse_stream_event('{"choices":[{"text":"hi"}]}', "completions") == (True, None)
    assert parse_stream_event('{"choices":[{"delta":{"content":""}}]}', "chat") == (False, None)
    usage = '{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":9}}'
    assert parse_stream_event(usage, "chat") == (False, 9)
    assert parse_stream_event("[DONE]", "completions") == (False, None)


def test_sse_lines_split_across_transport_chunks_are_reassembled() -> None:
    async def chunks():
        for piece in [b"data: {\"a\"", b": 1}\n\nda", b"ta: [DONE]\n\n"]:
            yield piece

    async def collect() -> list[str]:
        return [e async for e in http_client.sse_events(chunks())]

    assert asyncio.run(collect()) == ['{"a": 1}', "[DONE]"]


def test_cli_registers_the_benchmark_commands() -> None:
    parser = build_parser()
    ns = parser.parse_args(["benchmark", "--n", "1,2", "--output-len", "8", "--json", "x.json"])
    assert (ns.n, ns.output_len, ns.input_len, ns.json) == ("1,2", 8, 128, "x.json")
    ns = parser.parse_args(["bench", "serve", "--request-rate", "2.5", "--max-concurrency", "4"])
    assert (ns.request_rate, ns.max_concurrency, ns.endpoint) == (2.5, 4, "completions")
    ns = parser.parse_args(["bench", "race", "--server-cmd", "srv --port 1"])
    assert ns.server_cmd == "srv --port 1" and ns.ignore_eos is True
    ns = parser.parse_args(["bench", "micro", "--repeats", "3"])
    assert ns.repeats == 3 and ns.bench_module == "rvllm.bench.micro"


# ------------------------------------------------------------------ micro references


def test_numpy_penalty_reference_agrees_with_rvllm() -> None:
    from rvllm.sampler import apply_penalties

    rng = np.random.default_rng(0)
    logits = rng.standard_normal(1000).astype(np.float32)
    ids = rng.integers(0, 1000, 300)
    ours = apply_penalties(logits, ids.tolist(), repetition_penalty=1.3,
                           frequency_penalty=0.2, presence_penalty=0.1)
    np.testing.assert_allclose(ours, np_penalties(logits, ids, 1.3, 0.2, 0.1), rtol=1e-5,
                               atol=1e-5)


def test_time_call_reports_seconds_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the test's clock, where each call takes 1 ms: what the machine is doing
    meanwhile cannot move the answer."""
    from types import SimpleNamespace

    from rvllm.bench import micro

    clock = {"now": 0.0, "calls": 0}

    def call() -> None:
        clock["now"] += 0.001
        clock["calls"] += 1

    monkeypatch.setattr(micro, "time", SimpleNamespace(perf_counter=lambda: clock["now"]))
    assert time_call(call, repeats=3, min_seconds=0.001) == pytest.approx(0.001)
    # Calls are batched until a repeat lasts min_seconds: 16 a repeat for 10 ms (after the
    # warm-up call and the batches of 1, 2, 4 and 8 that were too short).
    clock["calls"] = 0
    assert time_call(call, repeats=3, min_seconds=0.01) == pytest.approx(0.001)
    assert clock["calls"] == 1 + (1 + 2 + 4 + 8 + 16) + 2 * 16


# ------------------------------------------------------------------ against a fake server

FAKE_SERVER = textwrap.dedent('''
    import json, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        def log_message(self, *a): pass
        def do_GET(self):
            body = b'{"data": [{"id": "fake"}]}' if self.path == "/v1/models" else b""
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            def send(obj):
                data = ("data: " + (obj if isinstance(obj, str) else json.dumps(obj))
                        + "\\n\\n").encode()
                self.wfile.write(b"%x\\r\\n%s\\r\\n" % (len(data), data))
                self.wfile.flush()
            for i in range(req["max_tokens"]):
                time.sleep(0.01)
                send({"choices": [{"index": 0, "text": "t%d" % i}]})
            send({"choices": [], "usage": {"prompt_tokens": len(req["prompt"]),
                                           "completion_tokens": req["max_tokens"]}})
            send("[DONE]")
            self.wfile.write(b"0\\r\\n\\r\\n")

    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
''')


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def fake_server_cmd(tmp_path: Path) -> tuple[str, int]:
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    port = free_port()
    return f"{sys.executable} {script} {port}", port


def test_load_generator_times_streamed_tokens_against_a_server(
        fake_server_cmd: tuple[str, int]) -> None:
    import shlex
    import subprocess

    cmd, port = fake_server_cmd
    proc = subprocess.Popen(shlex.split(cmd))
    try:
        from rvllm.bench.race import wait_ready

        # A hang watchdog: the fake server is up in well under a second.
        asyncio.run(wait_ready(f"http://127.0.0.1:{port}/health", proc, 60.0))
        ns = serve_ns("--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "4",
                      "--random-input-len", "5", "--random-output-len", "6",
                      "--max-concurrency", "2")
        timings, duration = asyncio.run(run_load(ns, build_dataset(ns), "fake"))
    finally:
        proc.terminate()
        proc.wait()
    m = serve_metrics(timings, duration)
    assert (m["completed"], m["failed"], m["total_output_tokens"]) == (4, 0, 24)
    assert all(len(t.chunk_times) == 6 for t in timings)
    # Only what the fake server's pacing guarantees: a 10 ms wait before each of its six
    # tokens. The gaps one at a time are not guaranteed (a busy client can read two
    # chunks at once), their sum after the first token's wait is.
    assert m["mean_ttft_ms"] >= 10.0
    assert m["mean_ttft_ms"] + 5 * m["mean_itl_ms"] >= 60.0
    assert m["mean_e2el_ms"] >= 60.0


@pytest.mark.slow  # 30 s; test_bench_real_server.py races a real rvllm server in 6
def test_race_reports_every_phase_and_stops_the_server(
        fake_server_cmd: tuple[str, int], tmp_path: Path) -> None:
    from rvllm.bench.race import main as race_main

    cmd, port = fake_server_cmd
    out = tmp_path / "race.json"
    ns = build_parser().parse_args([
        "bench", "race", "--server-cmd", cmd, "--base-url", f"http://127.0.0.1:{port}",
        "--num-prompts", "3", "--random-input-len", "4", "--random-output-len", "5",
        "--json", str(out)])
    assert race_main(ns) == 0
    result = json.loads(out.read_text())
    phases = result["phases"]
    assert set(phases) == {"ready_s", "first_completion_s", "workload_s",
                           "launch_to_finished_s", "shutdown_s"}
    assert phases["launch_to_finished_s"] >= phases["ready_s"] + phases["workload_s"]
    assert result["metrics"]["completed"] == 3
    assert result["launch_to_finished_tok_s"] == pytest.approx(
        (15 + 5) / phases["launch_to_finished_s"])


# ------------------------------------------------------------------ comparison tables


def test_comparison_table_puts_rvllm_first_with_its_ratio_to_each_peer(tmp_path: Path) -> None:
    from rvllm.bench.compare import load_results, markdown_report

    def write(engine: str, tok_s: list[float]) -> None:
        rows = [{"n": n, "output_tok_s": t, "decode_tok_s": t, "prefill_tok_s": t}
                for n, t in zip([1, 4], tok_s)]
        body = {"engine": engine, "config": {"input_len": 8, "output_len": 8}, "rows": rows}
        (tmp_path / f"engine-tiny-{engine}.json").write_text(json.dumps(body))

    write("vllm", [10.0, 40.0])
    write("rvllm", [20.0, 20.0])
    assert set(load_results(tmp_path)["engine"]["tiny"]) == {"rvllm", "vllm"}
    table = markdown_report(tmp_path).split("\n\n")[1]
    assert table.splitlines()[0] == "| N | rvllm | vllm | rvllm/vllm |"
    assert table.splitlines()[2] == "| 1 | 20.0 | 10.0 | 2.00x |"
    assert table.splitlines()[3] == "| 4 | 20.0 | 40.0 | 0.50x |"
