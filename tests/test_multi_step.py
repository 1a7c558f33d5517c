"""Multi-step decoding (``num_scheduler_steps``): several greedy decode steps in one
compiled CPU call must give exactly what one step at a time gives, and transformers:
the tokens, their logprobs, the stops, the prefix cache's blocks; and the scheduler
runs ahead only where it may."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import hf_greedy

from rvllm import LLM, SamplingParams
from rvllm.config import SchedulerConfig
from rvllm.engine.block_manager import BlockManager
from rvllm.engine.scheduler import Scheduler
from rvllm.engine.sequence import Sequence

PROMPTS = [[5, 6, 7], [11, 3, 99, 42, 8, 17, 250, 31, 64, 2, 77, 19], [40, 41, 42, 43, 44]]
NEW_TOKENS = 20  # the prefill's token and 19: the last run ahead is cut to what is left


def _llm(model_dir: Path, steps: int, **kwargs) -> LLM:  # noqa: ANN003
    return LLM(str(model_dir), kernel_backend="numba", block_size=8,
               num_scheduler_steps=steps, **kwargs)


def _greedy(llm: LLM, prompts: list[list[int]], **kwargs) -> list:  # noqa: ANN003
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, **kwargs)
    return [r.outputs[0] for r in llm.generate(prompts, params)]


def test_steps_ahead_match_transformers_and_single_steps(llama_dir: Path) -> None:
    ahead, single = _llm(llama_dir, 4), _llm(llama_dir, 1)
    want = hf_greedy(llama_dir, PROMPTS, NEW_TOKENS)
    for prompts in ([PROMPTS[1]], PROMPTS):  # one row, and three decoding together
        got, ref = _greedy(ahead, prompts), _greedy(single, prompts)
        assert [o.token_ids for o in got] == [want[PROMPTS.index(p)] for p in prompts]
        for o, r in zip(got, ref):
            assert o.token_ids == r.token_ids
            assert o.cumulative_logprob == pytest.approx(r.cumulative_logprob, abs=1e-4)
            assert o.finish_reason == "length"


def test_a_step_appends_several_tokens_at_once(llama_dir: Path) -> None:
    engine = _llm(llama_dir, 4).engine
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    engine.add_request("a", PROMPTS[0], params)
    counts = []
    while engine.has_unfinished_requests():
        counts.extend(out.new_token_counts[0] for out in engine.step())
    # The prefill's token, then runs of four, then the three left to make.
    assert counts == [1, 4, 4, 4, 4, 3]


def test_stop_tokens_end_a_run_ahead_where_single_steps_stop(llama_dir: Path) -> None:
    ahead, single = _llm(llama_dir, 4), _llm(llama_dir, 1)
    tokens = _greedy(single, [PROMPTS[1]])[0].token_ids
    for stop in (tokens[2], tokens[9]):  # inside a run, and in a later one
        got = _greedy(ahead, [PROMPTS[1]], stop_token_ids=[stop])[0]
        assert got.token_ids == tokens[:tokens.index(stop) + 1]
        assert got.finish_reason == "stop" and got.stop_reason == stop
        assert ahead.engine.block_manager.num_free_blocks == ahead.engine.block_manager.num_blocks


def test_stop_strings_cut_a_run_ahead_as_single_steps_do(llama_dir: Path) -> None:
    ahead, single = _llm(llama_dir, 4), _llm(llama_dir, 1)
    params = dict(temperature=0, max_tokens=24, ignore_eos=True)
    full = single.generate(["The quick brown fox"], SamplingParams(**params))[0].outputs[0].text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    if not stop.strip():
        pytest.skip("the test model's continuation has no printable middle")
    want = single.generate(["The quick brown fox"], SamplingParams(**params, stop=[stop]))
    got = ahead.generate(["The quick brown fox"], SamplingParams(**params, stop=[stop]))
    assert got[0].outputs[0].text == want[0].outputs[0].text == full[:full.index(stop)]
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids


def test_blocks_filled_by_a_run_ahead_are_found_in_the_prefix_cache(llama_dir: Path) -> None:
    llm = _llm(llama_dir, 4)
    first = _greedy(llm, [PROMPTS[0]])[0].token_ids
    # The prompt and 13 generated tokens fill two 8-token blocks, whose K/V the runs
    # ahead wrote: a prompt that goes one token past them hits both, and must go on as
    # the first request did.
    prompt = PROMPTS[0] + first[:14]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6,
                                                ignore_eos=True))[0]
    assert out.num_cached_tokens == 16
    assert out.outputs[0].token_ids == first[14:20]


def test_sampled_rows_take_single_steps_with_the_same_samples(llama_dir: Path) -> None:
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=12, ignore_eos=True)
    got = _llm(llama_dir, 4).generate([PROMPTS[1]], params)[0].outputs[0].token_ids
    want = _llm(llama_dir, 1).generate([PROMPTS[1]], params)[0].outputs[0].token_ids
    assert got == want


def _scheduler(steps: int, num_blocks: int = 16) -> Scheduler:
    return Scheduler(SchedulerConfig(8, 64, True, steps), BlockManager(num_blocks, 4, False))


def _decoding(scheduler: Scheduler, seq_id: int, prompt_len: int, max_tokens: int) -> Sequence:
    """A sequence whose prompt has been computed and whose first token is sampled."""
    seq = Sequence(seq_id, str(seq_id), 0, list(range(prompt_len)),
                   SamplingParams(temperature=0), 0.0, max_tokens)
    scheduler.add(seq)
    scheduler.schedule()  # the prefill
    seq.num_computed_tokens = prompt_len
    seq.token_ids.append(1)
    return seq


def test_scheduler_runs_ahead_only_over_decodes_with_nothing_waiting() -> None:
    scheduler = _scheduler(4)
    seq = _decoding(scheduler, 0, 6, max_tokens=20)
    out = scheduler.schedule()
    assert out.num_steps == 4
    assert len(seq.block_table) == 3  # positions 6-9 of 4-token blocks
    seq.num_computed_tokens += 4
    seq.token_ids.extend([1, 1, 1])
    scheduler.add(Sequence(1, "1", 0, [3, 4], SamplingParams(), 0.0, 4))
    assert scheduler.schedule().num_steps == 1  # a prefill joins: one step


def test_scheduler_runs_ahead_no_further_than_a_sequence_has_tokens_left() -> None:
    scheduler = _scheduler(8)
    seq = _decoding(scheduler, 0, 6, max_tokens=3)
    assert scheduler.schedule().num_steps == 2  # 1 sampled, 2 left
    assert seq.num_output_tokens == 1


def test_scheduler_never_preempts_to_run_ahead() -> None:
    scheduler = _scheduler(8, num_blocks=4)
    first = _decoding(scheduler, 0, 7, max_tokens=30)
    second = _decoding(scheduler, 1, 7, max_tokens=30)
    out = scheduler.schedule()
    assert out.num_steps == 1 and not out.preempted
    assert first in scheduler.running and second in scheduler.running


@pytest.mark.parametrize("kwargs", [dict(num_scheduler_steps=0),
                                    dict(num_scheduler_steps=2, kernel_backend="torch")])
def test_multi_step_settings_that_cannot_run_are_refused(llama_dir: Path, kwargs: dict
                                                         ) -> None:
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        LLM(str(llama_dir), **kwargs)
