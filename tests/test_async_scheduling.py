"""Asynchronous scheduling (``--async-scheduling``): the model's steps run on a thread of
their own, one in flight while the engine schedules the next (the CPU's stand-in for a
device stream). Output must be what the engine gives without it, token for token, and
transformers' under greedy: with chunked prefill, prefix hits, both kinds of preemption,
stops of every kind, aborts while a step is in flight, seeded sampling and logprobs;
and no token is lost or repeated where one step's outputs meet the next."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import hf_greedy

from rvllm import LLM, SamplingParams
from rvllm.engine.async_steps import PLACEHOLDER
from rvllm.sampling_params import StructuredOutputsParams

NEW_TOKENS = 24


def _prompts(seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 400, (n,), generator=g).tolist() for n in (5, 31, 12, 47, 9)]
    # A shared prefix: the second of these hits the first's cached blocks.
    return prompts + [prompts[3][:40] + [7, 8, 9]]


def _greedy(llm: LLM, prompts: list[list[int]], **kwargs) -> list:  # noqa: ANN003
    kwargs = {"temperature": 0, "max_tokens": NEW_TOKENS, "ignore_eos": True, **kwargs}
    return [o.outputs[0] for o in llm.generate(prompts, SamplingParams(**kwargs))]


def _pair(model_dir: Path, **kwargs) -> tuple[LLM, LLM]:  # noqa: ANN003
    return (LLM(str(model_dir), async_scheduling=True, **kwargs),
            LLM(str(model_dir), **kwargs))


def _all_free(llm: LLM) -> bool:
    bm = llm.engine.block_manager
    swap = llm.engine.args.num_cpu_blocks
    return bm.num_free_blocks == bm.num_blocks and len(bm.cpu_free) == swap


@pytest.mark.parametrize("arch, backend", [("llama", "numba"), ("llama", "torch"),
                                           ("qwen2", "numba"), ("mistral", "torch")])
def test_greedy_matches_transformers_with_chunks_and_prefix_hits(
        model_dirs: dict[str, Path], arch: str, backend: str) -> None:
    prompts = _prompts()
    llm = LLM(str(model_dirs[arch]), async_scheduling=True, kernel_backend=backend,
              max_num_batched_tokens=24, block_size=8)
    got = _greedy(llm, prompts)
    assert [o.token_ids for o in got] == hf_greedy(model_dirs[arch], prompts, NEW_TOKENS)
    assert llm.engine.block_manager.prefix_cache_hits > 0
    assert _all_free(llm) and llm.engine.settings()["async_scheduling"]


@pytest.mark.parametrize("swap", [False, True])
def test_preemption_of_a_sequence_in_flight_matches_single_steps(llama_dir: Path,
                                                                  swap: bool) -> None:
    kwargs = dict(num_gpu_blocks=16, max_model_len=128, block_size=8, max_num_batched_tokens=24,
                  num_cpu_blocks=64 if swap else 0)
    overlapped, plain = _pair(llama_dir, **kwargs)
    prompts = _prompts()
    got, want = _greedy(overlapped, prompts), _greedy(plain, prompts)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.token_ids for o in got] == hf_greedy(llama_dir, prompts, NEW_TOKENS)
    scheduler = overlapped.engine.scheduler
    assert (scheduler.num_swap_outs if swap else scheduler.num_preemptions) > 0
    assert _all_free(overlapped)


def test_stops_and_lengths_end_where_single_steps_end(llama_dir: Path) -> None:
    # Each request of a batch ends its own way, at its own step, while others go on:
    # max_tokens (1, 7, 24), a stop token, EOS (not ignored), a stop string.
    overlapped, plain = _pair(llama_dir)
    prompts = _prompts()
    first = _greedy(plain, prompts)
    stop_token = first[3].token_ids[5]
    text = first[5].text
    stop_string = text[len(text) // 2:len(text) // 2 + 2]
    cases = [dict(max_tokens=1), dict(max_tokens=7), dict(),
             dict(stop_token_ids=[stop_token]), dict(ignore_eos=False),
             dict(stop=[stop_string] if stop_string.strip() else [])]
    params = [SamplingParams(temperature=0, **{"max_tokens": NEW_TOKENS, "ignore_eos": True,
                                               "logprobs": 2, **case}) for case in cases]
    got = overlapped.generate(prompts, params)
    want = plain.generate(prompts, params)
    for g, w in zip(got, want):
        a, b = g.outputs[0], w.outputs[0]
        assert (a.token_ids, a.text, a.finish_reason, a.stop_reason) == (
            b.token_ids, b.text, b.finish_reason, b.stop_reason)
        assert [list(e) for e in a.logprobs] == [list(e) for e in b.logprobs]
        assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob, abs=1e-4)
    assert len(got[0].outputs[0].token_ids) == 1 and len(got[1].outputs[0].token_ids) == 7
    assert got[3].outputs[0].finish_reason == "stop"
    assert _all_free(overlapped)


def test_seeded_sampling_and_several_samples_match_single_steps(llama_dir: Path) -> None:
    overlapped, plain = _pair(llama_dir)
    params = SamplingParams(temperature=0.9, top_p=0.9, seed=7, n=2, max_tokens=NEW_TOKENS,
                            ignore_eos=True, presence_penalty=0.5, repetition_penalty=1.2)
    got = overlapped.generate(_prompts()[:3], params)
    want = plain.generate(_prompts()[:3], params)
    assert [[o.token_ids for o in r.outputs] for r in got] == [
        [o.token_ids for o in r.outputs] for r in want]


def test_no_token_is_lost_or_repeated_between_steps(llama_dir: Path) -> None:
    # Stepping the engine by hand: each output extends the one before it by the tokens it
    # counts as new, never shows a placeholder, and the whole equals single steps'.
    overlapped, plain = _pair(llama_dir, max_num_batched_tokens=16, block_size=8)
    prompts = _prompts()
    want = {str(i): o.token_ids for i, o in enumerate(_greedy(plain, prompts))}
    engine = overlapped.engine
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    seen: dict[str, list[int]] = {k: [] for k in want}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = list(out.outputs[0].token_ids)
            assert PLACEHOLDER not in tokens
            before = seen[out.request_id]
            assert tokens[:len(before)] == before
            assert len(tokens) - len(before) == out.new_token_counts[0]
            seen[out.request_id] = tokens
    assert seen == want
    assert _all_free(overlapped)


def test_an_abort_while_its_step_is_in_flight_leaves_the_others_unchanged(
        llama_dir: Path) -> None:
    overlapped, plain = _pair(llama_dir, block_size=8)
    prompts = _prompts()
    want = [o.token_ids for o in _greedy(plain, prompts)]
    engine = overlapped.engine
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    finals: dict[str, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
        if steps in (3, 9):
            assert engine._in_flight is not None  # the aborted requests are in it
            engine.abort_request("1" if steps == 3 else "4")
    assert set(finals) == {"0", "2", "3", "5"}
    assert all(finals[k] == want[int(k)] for k in finals)
    engine.step()  # the last step in flight, with nothing left to report
    assert _all_free(overlapped)


def test_a_structured_request_runs_its_steps_without_overlap(llama_dir: Path) -> None:
    overlapped, plain = _pair(llama_dir)
    choice = SamplingParams(temperature=0, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    free = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = ["Is it?", "The quick brown fox"]
    got = overlapped.generate(prompts, [choice, free])
    want = plain.generate(prompts, [choice, free])
    assert [r.outputs[0].text for r in got] == [r.outputs[0].text for r in want]
    assert got[0].outputs[0].text in ("yes", "no")
    assert _all_free(overlapped)


@pytest.mark.parametrize("kwargs, flag", [
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     "--speculative-config"),
    (dict(num_scheduler_steps=4, kernel_backend="numba"), "--num-scheduler-steps 4"),
])
def test_what_it_does_not_overlap_is_refused_at_start_up(llama_dir: Path, kwargs: dict,
                                                         flag: str) -> None:
    with pytest.raises(ValueError, match=f"--async-scheduling does not run with {flag}"):
        LLM(str(llama_dir), async_scheduling=True, **kwargs)


def test_a_server_with_it_streams_what_the_engine_gives_without_it(llama_dir: Path) -> None:
    # The official client, 6 requests at once (some streamed), against `rvllm serve
    # --async-scheduling`; the texts are the engine's without the overlap.
    from concurrent.futures import ThreadPoolExecutor

    import openai
    from server_helpers import ServerProcess

    prompts = ["The quick brown fox", "Paris is", "def add(a, b):", "1, 2, 3,", "Hello", "Once"]
    plain = LLM(str(llama_dir))
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    want = [r.outputs[0].text for r in plain.generate(prompts, params)]
    server = ServerProcess(llama_dir, "--async-scheduling", "--num-gpu-blocks", "256")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")

        def complete(i: int) -> str:
            args = dict(model=str(llama_dir), prompt=prompts[i], max_tokens=NEW_TOKENS,
                        temperature=0, extra_body={"ignore_eos": True})
            if i % 2:
                chunks = client.completions.create(stream=True, **args)
                return "".join(c.choices[0].text for c in chunks if c.choices)
            return client.completions.create(**args).choices[0].text

        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(complete, range(len(prompts))))
    finally:
        server.stop()
    assert got == want
