"""Data parallelism: replicas behind one engine face give the outputs of one replica;
each replica is its own process, and one that dies is failed cleanly and restarted."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from test_engine import make_prompts

from rvllm import LLM, SamplingParams
from rvllm.config import EngineArgs
from rvllm.engine.async_engine import AsyncEngine, EngineDeadError, RequestStream
from rvllm.engine.data_parallel import DataParallelEngine
from rvllm.engine.process_engine import ProcessEngine
from rvllm.outputs import RequestOutput
from rvllm.tokenizer import Tokenizer

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# A request still generating when the test kills its replica a few milliseconds after its
# first token: all the 4096-position model has room for (the prompts here are 3 tokens),
# seconds even at a fraction of a millisecond a step. The test ends it, not its length.
UNENDING = SamplingParams(temperature=0, max_tokens=4093, ignore_eos=True)
# A hang watchdog: 10x and more what any wait below takes.
WATCHDOG_S = 120.0


async def _run_all(engine: DataParallelEngine, prompts: list[list[int]]) -> list[list[int]]:
    async def one(i: int, prompt: list[int]) -> list[int]:
        final = None
        async for out in engine.generate(prompt, PARAMS, request_id=f"r{i}"):
            final = out
        assert final is not None and final.finished
        return final.outputs[0].token_ids

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


async def _last(outputs: AsyncIterator[RequestOutput] | RequestStream) -> RequestOutput:
    final = None
    async for out in outputs:
        final = out
    assert final is not None
    return final


def _wait(predicate) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + WATCHDOG_S
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return predicate()


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    return LLM(str(llama_dir))


@pytest.fixture(scope="module")
def expected(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(make_prompts(), PARAMS)]


@pytest.fixture(scope="module")
def dp_engine(llama_dir: Path) -> Iterator[DataParallelEngine]:
    engine = DataParallelEngine.from_engine_args(EngineArgs(model=str(llama_dir)), 2)
    yield engine
    engine.shutdown()


def test_two_replicas_match_one_engine_and_share_the_load(
        dp_engine: DataParallelEngine, expected: list[list[int]]) -> None:
    engine = dp_engine
    seen: list[set[str]] = [set(), set()]
    for index, replica in enumerate(engine.replicas):
        replica.step_observers.append(
            lambda outs, _aborted, i=index: seen[i].update(o.request_id for o in outs))
    assert asyncio.run(_run_all(engine, make_prompts())) == expected
    assert seen[0] and seen[1] and not seen[0] & seen[1]
    # Observers run on the reader threads, just after the outputs are handed out.
    assert _wait(lambda: engine.replica_loads() == [0, 0])
    snap = engine.snapshot()
    assert snap.num_free_blocks == snap.num_blocks
    assert snap.generation_tokens == 12 * len(expected)


def test_each_replica_is_its_own_process(dp_engine: DataParallelEngine) -> None:
    pids = [r.pid for r in dp_engine.replicas]
    assert all(isinstance(r, ProcessEngine) and r.is_running for r in dp_engine.replicas)
    assert len(set(pids)) == 2 and os.getpid() not in pids


def test_outputs_cross_the_process_boundary_whole(dp_engine: DataParallelEngine,
                                                  llm: LLM) -> None:
    prompt = make_prompts()[0]
    params = SamplingParams(temperature=0, max_tokens=20, logprobs=3, prompt_logprobs=2)
    params.stop = [llm.generate([prompt], params)[0].outputs[0].text[5:8]]
    want = llm.generate([prompt], params)[0]

    async def stream() -> list[RequestOutput]:
        return [o async for o in dp_engine.generate(prompt, params, "whole")]

    outs = asyncio.run(stream())
    got = outs[-1]
    assert got.finished and got.outputs[0].stop_reason == params.stop[0]
    assert got.prompt_token_ids == want.prompt_token_ids
    assert got.num_cached_tokens == want.num_cached_tokens
    # Logprobs to float32 rounding: a replica computes on its share of the cores, and
    # oneDNN's summation order follows the thread count.
    assert_logprobs_close(got.prompt_logprobs, want.prompt_logprobs)
    g, w = got.outputs[0], want.outputs[0]
    for field in ("index", "text", "token_ids", "finish_reason", "stop_reason"):
        assert getattr(g, field) == getattr(w, field), field
    assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-4)
    assert_logprobs_close(g.logprobs, w.logprobs)
    assert sum(sum(o.new_token_counts) for o in outs) == len(got.outputs[0].token_ids)
    for o in outs:  # every streamed output is a prefix of the final one
        c = o.outputs[0]
        assert got.outputs[0].text.startswith(c.text)
        assert got.outputs[0].token_ids[:len(c.token_ids)] == c.token_ids
        assert got.outputs[0].logprobs[:len(c.logprobs)] == c.logprobs


def assert_logprobs_close(got: list | None, want: list | None) -> None:
    assert (got is None) == (want is None) and len(got or []) == len(want or [])
    for g, w in zip(got or [], want or []):
        assert (g is None) == (w is None)
        if g is None:
            continue
        assert g.keys() == w.keys()
        for token in g:
            assert g[token].rank == w[token].rank
            assert g[token].logprob == pytest.approx(w[token].logprob, abs=1e-4)


def test_bad_request_on_a_replica_is_refused_and_released(dp_engine: DataParallelEngine) -> None:
    async def bad() -> None:
        await dp_engine.add_request("x", [5] * 300, SamplingParams(max_tokens=10))

    with pytest.raises(ValueError, match="maximum context length"):
        asyncio.run(bad())
    assert dp_engine.replica_loads() == [0, 0]


def test_in_process_replicas_still_work(llama_dir: Path, expected: list[list[int]]) -> None:
    engine = DataParallelEngine(
        [AsyncEngine.from_engine_args(EngineArgs(model=str(llama_dir))) for _ in range(2)])
    try:
        assert asyncio.run(_run_all(engine, make_prompts())) == expected
    finally:
        engine.shutdown()


def test_killed_replica_fails_its_requests_and_is_restarted(long_llama_dir: Path) -> None:
    engine = DataParallelEngine.from_engine_args(EngineArgs(model=str(long_llama_dir)), 2)
    victim = engine.replicas[0]
    # The restart waits for the test: while it is held, replica 0 is certainly down.
    restart, restart_allowed = engine._restart, threading.Event()

    def held_restart(index: int, dead: ProcessEngine) -> None:
        restart_allowed.wait(WATCHDOG_S)
        restart(index, dead)

    engine._restart = held_restart

    async def scenario() -> None:
        # The first goes to replica 0 (both idle), the second to replica 1.
        streams = [await engine.add_request(f"long{i}", [5, 6, 7], UNENDING) for i in range(2)]
        assert engine.replica_loads() == [1, 1]
        firsts = [await anext(s) for s in streams]  # both are generating
        os.kill(victim.pid, signal.SIGKILL)
        # The dead replica's request fails as soon as its pipe closes (a hang watchdog).
        with pytest.raises(EngineDeadError, match="died"):
            await asyncio.wait_for(_last(streams[0]), WATCHDOG_S)
        # The survivor's request runs on, and ends only when the test ends it.
        tokens = len(firsts[1].outputs[0].token_ids)
        out = await anext(streams[1])
        assert not out.finished and len(out.outputs[0].token_ids) > tokens
        engine.abort("long1")
        rest = [o async for o in streams[1]]  # it ends, with no error, once aborted
        alive = rest[-1] if rest else out
        assert not alive.finished
        # Where each request went is read at routing time: a 12-token request can finish
        # (and leave replica_loads) before gather returns.
        routes: dict[str, int] = {}
        route = engine._route

        def spy(request_id: str, tried: set[int]) -> tuple:
            index, replica = route(request_id, tried)
            routes[request_id] = index
            return index, replica

        engine._route = spy
        # While replica 0 is down, the survivor takes the new requests; the dead one has
        # no KV cache.
        assert engine.snapshot().num_blocks == engine.replicas[1].snapshot().num_blocks
        during = await _last(engine.generate([8, 9], PARAMS, "during"))
        assert len(during.outputs[0].token_ids) == 12 and routes["during"] == 1
        restart_allowed.set()
        deadline = time.monotonic() + WATCHDOG_S
        while not (engine.replicas[0] is not victim and engine.replicas[0].is_running):
            assert time.monotonic() < deadline, "replica 0 was not restarted"
            await asyncio.sleep(0.05)
        assert engine.replicas[0].pid != victim.pid
        # The new replica takes its share.
        after = await asyncio.gather(*(engine.add_request(f"after{i}", [8, 9], PARAMS)
                                       for i in range(2)))
        assert sorted(routes[f"after{i}"] for i in range(2)) == [0, 1]
        for s in after:
            assert (await _last(s)).outputs[0].token_ids == during.outputs[0].token_ids

    try:
        asyncio.run(scenario())
        assert _wait(lambda: engine.replica_loads() == [0, 0])
        # Counters survive the restart: the dead replica's tokens still count.
        lost = victim.snapshot().generation_tokens
        assert lost > 0
        assert engine.snapshot().generation_tokens == lost + sum(
            r.snapshot().generation_tokens for r in engine.replicas)
    finally:
        restart_allowed.set()
        engine.shutdown()


def test_lone_process_engine_death_is_fatal(long_llama_dir: Path) -> None:
    engine = ProcessEngine.from_engine_args(EngineArgs(model=str(long_llama_dir)))
    fatal = threading.Event()
    engine.on_fatal = lambda _error: fatal.set()

    async def scenario() -> None:
        stream = await engine.add_request("r", [5, 6, 7], UNENDING)
        await anext(stream)
        os.kill(engine.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="died"):
            await _last(stream)
        with pytest.raises(EngineDeadError):
            await engine.add_request("later", [5, 6, 7], PARAMS)

    try:
        asyncio.run(asyncio.wait_for(scenario(), WATCHDOG_S))
        assert fatal.wait(WATCHDOG_S) and not engine.is_running
    finally:
        engine.shutdown()


def test_bad_model_path_fails_fast_with_the_childs_error(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        DataParallelEngine.from_engine_args(EngineArgs(model=str(tmp_path / "missing")), 2)
    # A hang watchdog: the children's start (an interpreter, torch) and their error take
    # seconds; a parent waiting on children that never answer would wait for ever.
    assert time.monotonic() - start < WATCHDOG_S


def test_tokenizer_loaded_while_the_child_starts_is_the_models(llama_dir: Path) -> None:
    """The server loads its tokenizer while the engine process loads the model."""
    engine = ProcessEngine(EngineArgs(model=str(llama_dir)))
    try:
        engine.load_tokenizer()
        engine.wait_ready()
        text = "The quick brown fox"
        assert engine.tokenizer.encode(text) == Tokenizer.from_pretrained(llama_dir).encode(text)
    finally:
        engine.shutdown()


def test_early_tokenizer_failure_still_reports_the_childs_error(tmp_path: Path) -> None:
    """Both fail on a missing model; the child's error (naming the model path) wins."""
    engine = ProcessEngine(EngineArgs(model=str(tmp_path / "missing")))
    engine.load_tokenizer()
    with pytest.raises(FileNotFoundError, match="Model path"):
        engine.wait_ready()
    assert not engine.process.is_alive()


def test_tokenizer_failure_of_the_parent_alone_is_raised(llama_dir: Path, tmp_path: Path
                                                         ) -> None:
    """A chat template file the parent cannot read fails start-up after the child is up,
    and the child is stopped."""
    engine = ProcessEngine(EngineArgs(model=str(llama_dir), skip_tokenizer_init=True))
    engine.args = EngineArgs(model=str(llama_dir), tokenizer=str(tmp_path / "nowhere"))
    engine.load_tokenizer()
    with pytest.raises(FileNotFoundError, match="nowhere"):
        engine.wait_ready()
    assert not engine.process.is_alive()
