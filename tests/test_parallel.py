"""Tensor parallelism on the CPU (gloo): the same tokens as one process."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from test_engine import make_prompts

from rvllm import LLM, SamplingParams
from rvllm.executor.parallel import WorkerDiedError

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
# A hang watchdog: 10x and more what any wait below takes.
WATCHDOG_S = 60.0


def run(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(make_prompts(), PARAMS)]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_tp2_matches_tp1(model_dirs: dict[str, Path], arch: str) -> None:
    expected = run(LLM(str(model_dirs[arch])))
    llm = LLM(str(model_dirs[arch]), tensor_parallel_size=2)
    try:
        assert run(llm) == expected
    finally:
        llm.engine.shutdown()


def test_tp2_with_chunked_prefill_and_preemption(llama_dir: Path) -> None:
    kwargs = dict(num_gpu_blocks=16, max_model_len=128, block_size=8, max_num_batched_tokens=24)
    expected = run(LLM(str(llama_dir), **kwargs))
    llm = LLM(str(llama_dir), tensor_parallel_size=2, **kwargs)
    try:
        assert run(llm) == expected
        assert llm.engine.scheduler.num_preemptions > 0
    finally:
        llm.engine.shutdown()


def test_tp2_with_swap_preemption(llama_dir: Path) -> None:
    """Every rank swaps its own KV heads out to CPU blocks and back."""
    kwargs = dict(num_gpu_blocks=16, max_model_len=128, block_size=8, num_cpu_blocks=64,
                  max_num_batched_tokens=24)
    expected = run(LLM(str(llama_dir), **kwargs))
    llm = LLM(str(llama_dir), tensor_parallel_size=2, **kwargs)
    try:
        assert run(llm) == expected
        assert llm.engine.scheduler.num_swap_outs > 0
    finally:
        llm.engine.shutdown()


def test_killed_worker_fails_the_step_quickly(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), tensor_parallel_size=2)
    engine = llm.engine
    try:
        engine.add_request(None, make_prompts(lens=(20,))[0],
                           SamplingParams(max_tokens=100, ignore_eos=True))
        engine.step()
        engine.tp_group.procs[0].kill()
        engine.tp_group.procs[0].join(WATCHDOG_S)
        assert not engine.tp_group.procs[0].is_alive()
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match="died"):
            engine.step()  # the request has 99 tokens to go: this step is one of them
        assert time.monotonic() - start < WATCHDOG_S  # not stuck in a collective
    finally:
        engine.shutdown()


def test_check_alive_waits_for_an_exit_that_lags_the_broken_socket(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A collective can fail on a killed worker's reset socket before the worker's exit is
    reported; the engine then waits a grace period to classify the failure as fatal. The
    worker here exits when the test says, and check_alive's clock is the test's: seen
    alive, then gone after the first wait of the grace, it is reported then, not when the
    grace runs out."""
    import multiprocessing
    from types import SimpleNamespace

    from rvllm.executor import tp_workers
    from rvllm.executor.tp_workers import TensorParallelGroup

    ctx = multiprocessing.get_context("fork")
    exit_now = ctx.Event()
    group = object.__new__(TensorParallelGroup)
    group.procs = [ctx.Process(target=exit_now.wait, name="rvllm-tp1")]
    group.procs[0].start()
    clock = {"now": 0.0, "waits": 0}

    def sleep(seconds: float) -> None:
        clock["now"] += seconds
        clock["waits"] += 1
        if clock["waits"] == 1:  # the worker's exit lags the failure by one wait
            exit_now.set()
            group.procs[0].join(WATCHDOG_S)

    monkeypatch.setattr(tp_workers, "time", SimpleNamespace(monotonic=lambda: clock["now"],
                                                            sleep=sleep))
    try:
        group.check_alive()  # still running, and no grace: no error, no wait
        assert clock["waits"] == 0
        with pytest.raises(WorkerDiedError, match="rvllm-tp1"):
            group.check_alive(grace=10)
        assert clock["waits"] == 1 and clock["now"] < 10
    finally:
        exit_now.set()
        group.procs[0].join(WATCHDOG_S)
        group.procs[0].kill()


def test_heads_that_do_not_divide_are_refused(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="cannot be split over tensor_parallel_size=3"):
        LLM(str(llama_dir), tensor_parallel_size=3)


def test_unknown_backend_is_refused(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="mp or ray"):
        LLM(str(llama_dir), tensor_parallel_size=2, distributed_executor_backend="foo")


@pytest.fixture(scope="module")
def ray_cluster():
    """A private local Ray cluster, started by rvllm's ray backend inside the test.

    Ray's single-machine mode keeps every Ray address on loopback (127.0.0.1)."""
    import os

    pytest.importorskip("ray")
    env = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_ADDRESS": None}
    saved = {k: os.environ.get(k) for k in env}
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_tp2_on_ray_matches_tp1(llama_dir: Path, ray_cluster: None) -> None:
    expected = run(LLM(str(llama_dir)))
    llm = LLM(str(llama_dir), tensor_parallel_size=2, distributed_executor_backend="ray")
    try:
        assert run(llm) == expected
    finally:
        llm.engine.shutdown()


def test_killed_ray_worker_fails_the_step(llama_dir: Path, ray_cluster: None) -> None:
    import ray

    llm = LLM(str(llama_dir), tensor_parallel_size=2, distributed_executor_backend="ray")
    engine = llm.engine
    try:
        engine.add_request(None, [5, 6, 7], SamplingParams(max_tokens=100, ignore_eos=True))
        engine.step()
        engine.tp_group.kill_worker(0)
        # Ray reports the death in its own time: the step comes once it has, as in the
        # process test above once the worker is joined (how many steps a request had left
        # before Ray noticed is no business of this test).
        ended, _ = ray.wait(engine.tp_group.runs, num_returns=1, timeout=WATCHDOG_S)
        assert ended, "Ray did not report the killed worker"
        start = time.monotonic()
        with pytest.raises(WorkerDiedError):
            engine.step()
        assert time.monotonic() - start < WATCHDOG_S  # not stuck in a collective
    finally:
        engine.shutdown()


FAMILY_NAMES = ["qwen3", "gemma", "gemma2", "gemma3", "phi3", "phi", "mixtral", "qwen3_moe",
                "deepseek_v2"]


@pytest.fixture(scope="module")
def family_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tp-families")


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_tp2_matches_tp1_for_every_family(family_root: Path, family: str) -> None:
    from test_model_families import build_family
    from test_model_families import make_prompts as family_prompts

    path = str(build_family(family, family_root / family))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(path).generate(family_prompts(), params)]
    llm = LLM(path, tensor_parallel_size=2)
    try:
        assert [o.outputs[0].token_ids
                for o in llm.generate(family_prompts(), params)] == expected
    finally:
        llm.engine.shutdown()


def test_tp_refusal_during_load_leaves_no_workers(family_root: Path, llama_dir: Path) -> None:
    from test_model_families import build_family

    path = str(build_family("gemma4", family_root / "gemma4"))
    with pytest.raises(ValueError, match="cannot split"):
        LLM(path, tensor_parallel_size=2)
    # The process group is gone: a new tensor-parallel engine starts cleanly.
    llm = LLM(str(llama_dir), tensor_parallel_size=2)
    llm.engine.shutdown()
