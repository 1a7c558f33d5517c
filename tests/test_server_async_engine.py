"""AsyncEngine: the step loop on its own thread, streams per request, and failure handling."""

from __future__ import annotations

import asyncio
import os
import threading
import time

import pytest
from server_helpers import wait_for

from rvllm.config import EngineArgs
from rvllm.engine.async_engine import AsyncEngine, EngineDeadError
from rvllm.engine.llm_engine import LLMEngine
from rvllm.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
# Every wall-clock bound below is a hang watchdog, 10x and more what its wait takes: no test
# passes or fails by how fast the machine is.
WATCHDOG_S = 60.0


class StepGate:
    """Holds an AsyncEngine's loop before each engine step until the test lets it through
    (``allow``), so how far a request has got when the test looks is the test's choice,
    not the machine's speed. Test-only: it wraps the ``step`` of the engine's LLMEngine."""

    def __init__(self, engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
        self._cond = threading.Condition()
        self._allowed: int | None = 0  # steps that may start; None: no gate any more
        step = engine.engine.step

        def gated_step():  # noqa: ANN202
            with self._cond:
                if not self._cond.wait_for(lambda: self._allowed != 0, WATCHDOG_S):
                    raise RuntimeError("a step was held past the test's watchdog")
                if self._allowed is not None:
                    self._allowed -= 1
            return step()

        monkeypatch.setattr(engine.engine, "step", gated_step)

    def allow(self, steps: int) -> None:
        with self._cond:
            if self._allowed is not None:
                self._allowed += steps
            self._cond.notify_all()

    def open(self) -> None:
        with self._cond:
            self._allowed = None
            self._cond.notify_all()


@pytest.fixture
def gate(engine, monkeypatch):
    g = StepGate(engine, monkeypatch)
    yield g
    g.open()  # before monkeypatch puts the step back: the loop may be waiting in it


def observe(engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch, seen) -> None:  # noqa: ANN001
    """Calls ``seen(outputs, aborted)`` after each loop iteration, for this test only."""
    monkeypatch.setattr(engine, "step_observers", [*engine.step_observers, seen])


@pytest.fixture(scope="module")
def engine(llama_dir):
    eng = AsyncEngine(LLMEngine(EngineArgs(model=str(llama_dir), num_gpu_blocks=64)))
    yield eng
    eng.shutdown()


async def final_output(engine: AsyncEngine, prompt, params, request_id: str):
    last = None
    async for out in engine.generate(prompt, params, request_id):
        last = out
    return last


def test_generate_streams_to_the_same_result_as_the_engine(engine, llama_dir):
    async def run():
        outs = [out async for out in engine.generate("Hello there", GREEDY, "a")]
        return outs

    outs = asyncio.run(run())
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert sum(sum(o.new_token_counts) for o in outs) == 12
    direct = LLMEngine(EngineArgs(model=str(llama_dir), num_gpu_blocks=64))
    direct.add_request("x", "Hello there", GREEDY)
    final = None
    while direct.has_unfinished_requests():
        final = next((o for o in direct.step() if o.finished), final)
    assert outs[-1].outputs[0].token_ids == final.outputs[0].token_ids


def test_invalid_request_raises_value_error_and_queues_nothing(engine, gate):
    async def run():
        with pytest.raises(ValueError, match="maximum context length"):
            await engine.add_request("too-long", "hi", SamplingParams(max_tokens=10_000))
        with pytest.raises(ValueError, match="empty"):
            await engine.add_request("empty", [], GREEDY)
        await engine.add_request("dup", "hi", GREEDY)
        # The first "dup" is held at its first step; the second is queued before that step
        # is let through, so it meets the first still running, on any machine.
        twin = asyncio.create_task(engine.add_request("dup", "hi", GREEDY))
        await asyncio.sleep(0)  # the task runs to its wait for the engine: it is queued
        gate.allow(1)
        with pytest.raises(ValueError, match="already in use"):
            await twin
        engine.abort("dup")

    asyncio.run(run())
    gate.open()
    assert wait_idle(engine)
    assert "too-long" not in engine.engine.requests


def wait_idle(engine: AsyncEngine) -> bool:
    def idle() -> bool:
        s = engine.snapshot()
        return s.num_requests_running == 0 and s.num_free_blocks == s.num_blocks

    return wait_for(idle, WATCHDOG_S, interval=0.01)


def test_max_tokens_0_finishes_after_prefill_with_prompt_logprobs(engine):
    params = SamplingParams(max_tokens=0, prompt_logprobs=2, n=2)
    out = asyncio.run(final_output(engine, "Score this prompt", params, "score"))
    assert out.finished
    assert [c.token_ids for c in out.outputs] == [[], []]
    assert [c.finish_reason for c in out.outputs] == ["length", "length"]
    assert len(out.prompt_logprobs) == len(out.prompt_token_ids)
    assert out.prompt_logprobs[0] is None and all(out.prompt_logprobs[1:])
    assert wait_idle(engine)


def test_leaving_the_stream_early_aborts_and_frees_blocks(engine, gate, monkeypatch):
    aborted = threading.Event()
    observe(engine, monkeypatch,
            lambda _outputs, ids: aborted.set() if "early" in ids else None)

    async def run():
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        gate.allow(3)  # three tokens; the fourth step waits until the reader has left
        async for out in engine.generate("Abort me", params, "early"):
            if sum(len(c.token_ids) for c in out.outputs) >= 3:
                break

    asyncio.run(run())
    gate.open()
    # Aborted while live (the loop reports only those), a few tokens into its 200.
    assert aborted.wait(WATCHDOG_S)
    assert wait_idle(engine)
    assert not engine.engine.has_unfinished_requests()


def test_a_failing_step_fails_requests_in_flight_and_the_loop_goes_on(engine, monkeypatch):
    runner = engine.engine.runner
    real = runner.execute
    calls = {"n": 0}

    def flaky(sched):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return real(sched)

    monkeypatch.setattr(runner, "execute", flaky)

    async def run():
        with pytest.raises(EngineDeadError, match="boom"):
            await final_output(engine, "Doomed", GREEDY, "doomed")
        return await final_output(engine, "Hello there", GREEDY, "after")

    after = asyncio.run(run())
    assert after.finished and len(after.outputs[0].token_ids) == 12
    assert wait_idle(engine)


def test_concurrent_requests_from_two_threads_loops(engine):
    results: dict[str, int] = {}

    def worker(name: str) -> None:
        out = asyncio.run(final_output(engine, f"Thread {name}", GREEDY, name))
        results[name] = len(out.outputs[0].token_ids)

    threads = [threading.Thread(target=worker, args=(f"t{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WATCHDOG_S)
    assert results == {f"t{i}": 12 for i in range(4)}


def test_slow_consumer_gets_merged_outputs_and_loses_no_tokens(engine, monkeypatch):
    finished = threading.Event()
    observe(engine, monkeypatch, lambda outputs, _ids: finished.set() if any(
        o.request_id == "slow" and o.finished for o in outputs) else None)

    async def run():
        stream = await engine.add_request("slow", "Slow reader", SamplingParams(
            max_tokens=20, temperature=0, ignore_eos=True))
        # The reader reads nothing until the request has finished: all 20 outputs wait in
        # the stream (the loop hands them to this event loop before it tells observers).
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, finished.wait, WATCHDOG_S)
        outs = [out async for out in stream]
        return outs

    outs = asyncio.run(run())
    assert len(outs) == 1
    assert sum(o.new_token_counts[0] for o in outs) == 20 == len(outs[-1].outputs[0].token_ids)


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux /proc")
def test_idle_loop_sleeps_instead_of_spinning(engine):
    assert wait_idle(engine)
    # Deferred work (cache memory faulted in after the last request, say) is CPU time the
    # loop should spend: watch it only once none is left.
    assert wait_for(lambda: not engine.engine.has_idle_work, WATCHDOG_S)
    tid = engine._thread.native_id

    def cpu_ticks() -> int:
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime

    before = cpu_ticks()
    time.sleep(0.5)  # the window watched: a spinning loop uses ticks in it on any machine
    assert cpu_ticks() - before <= 1


def test_shutdown_ends_streams_and_refuses_new_requests(llama_dir, monkeypatch):
    eng = AsyncEngine(LLMEngine(EngineArgs(model=str(llama_dir), num_gpu_blocks=64)))
    gate = StepGate(eng, monkeypatch)

    async def run():
        gate.allow(1)
        stream = await eng.add_request("long", "x", SamplingParams(max_tokens=200,
                                                                   ignore_eos=True))
        await anext(stream)
        # The loop is held at the second step until shutdown has begun: the request is
        # mid-way when the engine stops, however fast its steps are.
        loop = asyncio.get_running_loop()
        stopped = loop.run_in_executor(None, eng.shutdown)
        assert await loop.run_in_executor(None, wait_for, lambda: not eng.is_running,
                                          WATCHDOG_S)
        gate.open()
        await stopped
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await eng.add_request("late", "x", GREEDY)

    try:
        asyncio.run(run())
    finally:
        gate.open()
    assert not eng.is_running


def test_idle_loop_finishes_the_deferred_weight_packing(llama_dir):
    """With nothing to step, the loop packs the weights start-up left (and still serves)."""
    engine = AsyncEngine(LLMEngine(EngineArgs(model=str(llama_dir), defer_weight_packing=True)))
    try:
        if engine.engine.model.linear_backend != "onednn":
            pytest.skip("no oneDNN packing on this build")
        assert wait_for(lambda: not engine.engine.has_idle_work, WATCHDOG_S, interval=0.01)
        assert "pending_reorders" not in engine.engine.model.__dict__
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        out = asyncio.run(final_output(engine, [5, 6, 7], params, "after"))
        assert len(out.outputs[0].token_ids) == 4
    finally:
        engine.shutdown()
