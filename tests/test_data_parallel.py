"""Data parallelism: replicas behind one engine face give the outputs of one replica."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from test_engine import make_prompts

from rvllm import LLM, SamplingParams
from rvllm.config import EngineArgs
from rvllm.engine.data_parallel import DataParallelEngine

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


async def _run_all(engine: DataParallelEngine, prompts: list[list[int]]) -> list[list[int]]:
    async def one(i: int, prompt: list[int]) -> list[int]:
        final = None
        async for out in engine.generate(prompt, PARAMS, request_id=f"r{i}"):
            final = out
        assert final is not None and final.finished
        return final.outputs[0].token_ids

    return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))


def test_two_replicas_match_one_engine_and_share_the_load(llama_dir: Path) -> None:
    prompts = make_prompts()
    expected = [o.outputs[0].token_ids for o in LLM(str(llama_dir)).generate(prompts, PARAMS)]
    engine = DataParallelEngine.from_engine_args(EngineArgs(model=str(llama_dir)), 2)
    seen: list[set[str]] = [set(), set()]
    for index, replica in enumerate(engine.replicas):
        replica.step_observers.append(
            lambda outs, _aborted, i=index: seen[i].update(o.request_id for o in outs))
    try:
        assert asyncio.run(_run_all(engine, prompts)) == expected
        assert seen[0] and seen[1] and not seen[0] & seen[1]
        deadline = time.monotonic() + 5  # observers run on the loop threads, just after
        while engine.replica_loads() != [0, 0] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.replica_loads() == [0, 0]
        snap = engine.snapshot()
        assert snap.num_free_blocks == snap.num_blocks
        assert snap.generation_tokens == 12 * len(prompts)
    finally:
        engine.shutdown()


def test_bad_request_on_a_replica_is_refused_and_released(llama_dir: Path) -> None:
    engine = DataParallelEngine.from_engine_args(EngineArgs(model=str(llama_dir)), 2)

    async def bad() -> None:
        await engine.add_request("x", [5] * 300, SamplingParams(max_tokens=10))

    try:
        try:
            asyncio.run(bad())
        except ValueError as e:
            assert "maximum context length" in str(e)
        else:
            raise AssertionError("an over-long prompt was accepted")
        assert engine.replica_loads() == [0, 0]
    finally:
        engine.shutdown()
