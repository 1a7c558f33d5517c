"""The engine generates exactly what transformers generates, however it batches."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
import torch
from conftest import hf_greedy

from rvllm import LLM, SamplingParams
from rvllm.layers.cpu_linear import has_pending_reorders

NEW_TOKENS = 16
PROMPT_LENS = (1, 3, 7, 16, 17, 31, 48, 70)


def make_prompts(seed: int = 1, lens: tuple[int, ...] = PROMPT_LENS) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 400, (n,), generator=g).tolist() for n in lens]


@cache
def reference(model_dir: Path) -> list[list[int]]:
    return hf_greedy(model_dir, make_prompts(), NEW_TOKENS)


def greedy(llm: LLM, prompts: list[list[int]], n: int = NEW_TOKENS) -> list[list[int]]:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_batched_greedy_matches_transformers(model_dirs: dict[str, Path], arch: str) -> None:
    llm = LLM(str(model_dirs[arch]))
    assert greedy(llm, make_prompts()) == reference(model_dirs[arch])


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_chunked_prefill_matches_transformers(model_dirs: dict[str, Path], arch: str) -> None:
    llm = LLM(str(model_dirs[arch]), max_num_batched_tokens=24)
    assert greedy(llm, make_prompts()) == reference(model_dirs[arch])


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_preemption_matches_transformers(model_dirs: dict[str, Path], arch: str) -> None:
    llm = LLM(str(model_dirs[arch]), num_gpu_blocks=16, max_model_len=128, block_size=8)
    assert greedy(llm, make_prompts()) == reference(model_dirs[arch])
    assert llm.engine.scheduler.num_preemptions > 0


def test_preemption_without_chunking_loses_no_request(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), num_gpu_blocks=12, max_model_len=96, block_size=8,
              enable_chunked_prefill=False, max_num_batched_tokens=96)
    assert greedy(llm, make_prompts()) == reference(llama_dir)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.num_free_blocks == 12


def test_prefix_cache_hits_match_transformers(llama_dir: Path) -> None:
    shared = make_prompts(seed=7, lens=(40,))[0]
    prompts = [shared + tail for tail in make_prompts(seed=8, lens=(1, 5, 9, 20))]
    expected = hf_greedy(llama_dir, prompts, NEW_TOKENS)
    llm = LLM(str(llama_dir), block_size=8)
    assert greedy(llm, prompts[:1]) == expected[:1]
    outs = llm.generate(prompts[1:], SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                    ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected[1:]
    assert all(o.num_cached_tokens == 40 for o in outs)
    assert llm.engine.block_manager.prefix_cache_hits >= 3 * 40


def test_prefix_caching_can_be_disabled(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), block_size=8, enable_prefix_caching=False)
    prompt = make_prompts(seed=7, lens=(40,))
    greedy(llm, prompt)
    out = llm.generate(prompt, SamplingParams(max_tokens=2))[0]
    assert out.num_cached_tokens == 0
    assert llm.engine.block_manager.prefix_cache_hits == 0


def test_logprobs_match_transformers_log_softmax(llama_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    prompt = make_prompts(lens=(12,))[0]
    llm = LLM(str(llama_dir))
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, logprobs=5,
                                                prompt_logprobs=3, ignore_eos=True))[0]
    tokens = out.outputs[0].token_ids
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0]
    ref = torch.log_softmax(logits, dim=-1)
    for i, (tok, entry) in enumerate(zip(tokens, out.outputs[0].logprobs)):
        row = ref[len(prompt) - 1 + i]
        assert abs(entry[tok].logprob - row[tok].item()) < 1e-4
        top = row.topk(5)
        for tid, lp in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(entry[tid].logprob - lp) < 1e-4
    assert out.prompt_logprobs[0] is None
    for j in range(1, len(prompt)):
        assert abs(out.prompt_logprobs[j][prompt[j]].logprob - ref[j - 1, prompt[j]].item()) < 1e-4


def test_prompt_logprobs_survive_chunked_prefill(llama_dir: Path) -> None:
    prompt = make_prompts(lens=(40,))[0]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    whole = LLM(str(llama_dir)).generate([prompt], params)[0].prompt_logprobs
    chunked = LLM(str(llama_dir), max_num_batched_tokens=16).generate([prompt], params)[0]
    assert len(chunked.prompt_logprobs) == len(prompt)
    for a, b in zip(whole[1:], chunked.prompt_logprobs[1:]):
        assert a.keys() == b.keys()
        for k in a:
            assert abs(a[k].logprob - b[k].logprob) < 1e-5


def test_seeded_sampling_is_independent_of_the_batch(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir))
    prompt = make_prompts(lens=(9,))[0]
    seeded = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=20, seed=1234,
                            ignore_eos=True)
    alone = llm.generate([prompt], seeded)[0].outputs[0].token_ids
    others = make_prompts(seed=3)
    busy_params = [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)] * 4
    busy_params += [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)] * 4
    outs = llm.generate(others[:4] + [prompt] + others[4:], busy_params[:4] + [seeded]
                        + busy_params[4:])
    assert outs[4].outputs[0].token_ids == alone


def test_n_samples_per_prompt(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir))
    out = llm.generate([make_prompts(lens=(5,))[0]],
                       SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12,
                                      ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 12 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_text_prompts_stop_strings_and_stream_concatenation(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir))
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    rid = engine.add_request(None, "The quick brown fox", params)
    streamed, final = "", None
    while engine.has_unfinished_requests():
        for out in engine.step():
            text = out.outputs[0].text
            assert text.startswith(streamed)
            streamed = text
            final = out
    full = engine.tokenizer.decode(final.outputs[0].token_ids)
    assert streamed == full and final.request_id == rid
    stop = full[len(full) // 2:len(full) // 2 + 2]
    if stop.strip():
        cut = llm.generate(["The quick brown fox"], SamplingParams(
            temperature=0, max_tokens=24, ignore_eos=True, stop=[stop]))[0].outputs[0]
        assert cut.finish_reason == "stop" and cut.stop_reason == stop
        assert cut.text == full[:full.index(stop)]


def test_stop_token_ids_and_max_tokens_finish_reasons(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir))
    prompt = make_prompts(lens=(6,))[0]
    tokens = greedy(llm, [prompt])[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                stop_token_ids=[tokens[3]]))[0].outputs[0]
    assert out.token_ids == tokens[:tokens.index(tokens[3]) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == tokens[3]
    out = llm.generate([prompt], SamplingParams(max_tokens=5, ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_min_tokens_holds_back_eos(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir))
    prompt = make_prompts(lens=(6,))[0]
    eos = greedy(llm, [prompt], 4)[0][2]
    llm.engine.eos_token_ids = frozenset([eos])
    early = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16))[0].outputs[0]
    assert early.finish_reason == "stop" and len(early.token_ids) == 3
    late = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16,
                                                 min_tokens=10))[0].outputs[0]
    assert len(late.token_ids) >= 10


@pytest.mark.parametrize("kernel_backend", ["numba", "torch"])
def test_allowed_token_ids_keep_sampling_to_them(llama_dir: Path, kernel_backend: str) -> None:
    """Only the allowed tokens come out, greedy (the best of them: the raw logits'
    argmax over the set) or sampled."""
    llm = LLM(str(llama_dir), kernel_backend=kernel_backend)
    prompt = make_prompts(lens=(6,))[0]
    allowed = [7, 11, 42, 300]
    greedy_out = llm.generate([prompt], SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True, allowed_token_ids=allowed,
        logprobs=len(allowed)))[0].outputs[0]
    for token, entry in zip(greedy_out.token_ids, greedy_out.logprobs):
        assert token in allowed
        # The raw logprobs of the allowed ones: the chosen token has the largest.
        assert all(entry[token].logprob >= lp.logprob for t, lp in entry.items() if t in allowed)
    sampled = llm.generate([prompt], SamplingParams(
        temperature=1.0, seed=3, n=3, max_tokens=8, ignore_eos=True, allowed_token_ids=allowed))
    assert all(t in allowed for c in sampled[0].outputs for t in c.token_ids)


def test_the_priority_policy_runs_requests_by_priority(llama_dir: Path) -> None:
    """One sequence at a time: they run lowest priority value first, then by arrival,
    and each gives the tokens it gives alone."""
    llm = LLM(str(llama_dir), scheduling_policy="priority", max_num_seqs=1)
    prompts = make_prompts(lens=(5, 6, 7, 8))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    outs = llm.generate(prompts, params, priority=[5, 0, 1, 0])
    order = sorted(range(4), key=lambda i: outs[i].metrics.first_scheduled_time)
    assert order == [1, 3, 2, 0]
    assert [o.outputs[0].token_ids for o in outs] == greedy(llm, prompts, 3)
    with pytest.raises(ValueError, match="priority 1 needs .*--scheduling-policy priority"):
        LLM(str(llama_dir)).generate(prompts[:1], params, priority=[1])


def test_truncate_prompt_tokens_keeps_the_prompts_end(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), max_model_len=64)
    prompt = make_prompts(lens=(90,))[0]  # longer than the context: refused whole
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    cut = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                truncate_prompt_tokens=20))[0]
    assert cut.prompt_token_ids == prompt[-20:]
    assert cut.outputs[0].token_ids == greedy(llm, [prompt[-20:]], 4)[0]
    with pytest.raises(ValueError, match="truncate_prompt_tokens .100. is greater"):
        llm.engine.add_request(None, prompt, SamplingParams(truncate_prompt_tokens=100))
    with pytest.raises(ValueError, match="64 tokens.*65 tokens .64 in the prompt"):
        llm.engine.add_request(None, prompt, SamplingParams(max_tokens=1,
                                                            truncate_prompt_tokens=-1))
    with pytest.raises(ValueError, match="maximum context length"):
        llm.generate([prompt], params)


@pytest.mark.parametrize("kwargs", [
    dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2), dict(min_p=2),
    dict(n=0), dict(max_tokens=-1), dict(presence_penalty=3), dict(frequency_penalty=-3),
    dict(repetition_penalty=0), dict(logprobs=-1), dict(min_tokens=5, max_tokens=2),
    dict(seed="x"), dict(stop=[""]), dict(logit_bias={1: 500}), dict(allowed_token_ids=[]),
    dict(allowed_token_ids=[-1]), dict(truncate_prompt_tokens=0),
    dict(truncate_prompt_tokens=-2),
])
def test_invalid_sampling_params_name_the_field(kwargs: dict) -> None:
    field = next(iter(kwargs))
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(max_logprobs=-2), dict(scheduling_policy="lifo")])
def test_bad_engine_arguments_name_the_field(llama_dir: Path, kwargs: dict) -> None:
    field = next(iter(kwargs))
    with pytest.raises(ValueError, match=field):
        LLM(str(llama_dir), **kwargs)


def test_bad_requests_are_refused_and_the_engine_keeps_serving(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), max_model_len=128)
    engine = llm.engine
    good = engine.add_request(None, make_prompts(lens=(5,))[0],
                              SamplingParams(max_tokens=4, ignore_eos=True))
    with pytest.raises(ValueError, match=r"128 tokens.*130 tokens \(100 in the prompt, 30"):
        engine.add_request(None, [5] * 100, SamplingParams(max_tokens=30))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request(None, [], SamplingParams())
    with pytest.raises(ValueError, match="vocab|token ids"):
        engine.add_request(None, [10**6], SamplingParams())
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(good, [5], SamplingParams())
    with pytest.raises(ValueError, match="logprobs"):
        engine.add_request(None, [5], SamplingParams(logprobs=50))
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == [good]
    assert len(finished[0].outputs[0].token_ids) == 4
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_abort_frees_blocks(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir))
    engine = llm.engine
    rid = engine.add_request(None, make_prompts(lens=(30,))[0],
                             SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.block_manager.num_free_blocks < engine.block_manager.num_blocks
    assert engine.abort_request(rid)
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_request_metrics_are_ordered(llama_dir: Path) -> None:
    out = LLM(str(llama_dir)).generate([[5, 6, 7]], SamplingParams(max_tokens=3))[0]
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time
    assert m.first_token_time <= m.last_token_time <= m.finished_time


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["FooForCausalLM"]}')
    with pytest.raises(ValueError, match="FooForCausalLM.*LlamaForCausalLM"):
        LLM(str(tmp_path))


def test_missing_model_path_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        LLM(str(tmp_path / "nothing-here"))


def test_sharded_checkpoint_loads_identically(llama_dir: Path, tmp_path: Path) -> None:
    from conftest import build_tokenizer
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    build_tokenizer(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert greedy(LLM(str(tmp_path)), make_prompts()) == reference(llama_dir)


def test_bfloat16_runs_close_to_float32(llama_dir: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=3)
    prompt = make_prompts(lens=(20,))
    ref = LLM(str(llama_dir)).generate(prompt, params)[0].outputs[0]
    bf16 = LLM(str(llama_dir), dtype="bfloat16").generate(prompt, params)[0].outputs[0]
    assert next(iter(bf16.logprobs[0].values())).logprob == pytest.approx(
        ref.logprobs[0][bf16.token_ids[0]].logprob, abs=0.1)


def test_missing_weights_are_named(llama_dir: Path, tmp_path: Path) -> None:
    import shutil

    for f in llama_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, tmp_path / f.name)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(str(tmp_path))


def test_dummy_weights_and_token_ids_only(tmp_path: Path, llama_dir: Path) -> None:
    import shutil

    shutil.copy(llama_dir / "config.json", tmp_path / "config.json")
    llm = LLM(str(tmp_path), load_format="dummy", skip_tokenizer_init=True)
    assert llm.get_tokenizer() is None
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 6 and out.outputs[0].text == ""
    with pytest.raises(ValueError, match="token ids"):
        llm.generate(["text needs a tokenizer"])
    with pytest.raises(ValueError, match="stop strings"):
        llm.generate([[5]], SamplingParams(stop=["x"]))


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_swap_preemption_matches_transformers(model_dirs: dict[str, Path], arch: str) -> None:
    llm = LLM(str(model_dirs[arch]), num_gpu_blocks=16, max_model_len=128, block_size=8,
              num_cpu_blocks=64, max_num_batched_tokens=24)
    assert greedy(llm, make_prompts()) == reference(model_dirs[arch])
    bm = llm.engine.block_manager
    assert llm.engine.scheduler.num_swap_outs > 0
    assert bm.num_free_blocks == 16 and len(bm.cpu_free) == 64


def test_swap_needs_swap_space(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="num-cpu-blocks"):
        LLM(str(llama_dir), preemption_mode="swap")


def test_a_short_first_request_does_not_wait_for_the_deferred_packing(llama_dir: Path) -> None:
    """Steps of up to ``PENDING_GEMM_MAX_ROWS`` rows multiply the panels as fast as packed
    weights, so they leave the packing to idle time (a layer's took 30-70 ms)."""
    from rvllm.layers.cpu_linear import PENDING_GEMM_MAX_ROWS

    llm = LLM(str(llama_dir), defer_weight_packing=True)
    if not has_pending_reorders(llm.engine.model):
        pytest.skip("no oneDNN packing on this build")
    left = len(llm.engine.model.pending_reorders)
    prompt = make_prompts(lens=(PENDING_GEMM_MAX_ROWS,))[0]
    assert greedy(llm, [prompt]) == hf_greedy(llama_dir, [prompt], NEW_TOKENS)
    assert len(llm.engine.model.pending_reorders) == left


def test_idle_work_waits_until_the_engine_has_been_quiet(llama_dir: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """On the test's clock: a slow machine's pause between the last step and the check
    does not count."""
    import time
    from types import SimpleNamespace

    from rvllm.engine import idle_work

    now = [1000.0]
    monkeypatch.setattr(idle_work, "time", SimpleNamespace(monotonic=lambda: now[0],
                                                           perf_counter=time.perf_counter))
    llm = LLM(str(llama_dir), defer_weight_packing=True)
    monkeypatch.setattr(idle_work, "IDLE_WORK_AFTER_S", 60.0)
    now[0] = 2000.0
    greedy(llm, make_prompts(lens=(3,)), n=2)
    now[0] += 1.0
    assert llm.engine.idle_work_due_in() == 59.0  # counted from the last step
    monkeypatch.setattr(idle_work, "IDLE_WORK_AFTER_S", 0.0)
    assert llm.engine.idle_work_due_in() == 0.0


def test_a_tied_lm_head_makes_its_panels_in_the_embeddings_memory(
        model_dirs: dict[str, Path]) -> None:
    """``rvllm serve``'s case (packing deferred): the tied LM head's panels take the rows'
    memory instead of a copy, and the embedding reads its rows from them. The tokens stay
    transformers' before the packing and after it."""
    llm = LLM(str(model_dirs["qwen2"]), defer_weight_packing=True)
    model = llm.engine.model
    if not has_pending_reorders(llm.engine.model):
        pytest.skip("no oneDNN packing on this build")
    weight = model.model.embed_tokens.weight
    assert weight is model.lm_head.weight and weight.numel() == 0
    assert weight.row_panels is model.lm_head.panel_weight
    assert greedy(llm, make_prompts()) == reference(model_dirs["qwen2"])
    llm.engine.idle_work(seconds=60.0)
    assert not has_pending_reorders(model)
    assert greedy(llm, make_prompts()) == reference(model_dirs["qwen2"])


def test_deferred_weight_packing_matches_transformers(llama_dir: Path) -> None:
    """What ``rvllm serve``'s engine process does: the linear weights' slow work is done
    after start-up, the rest when idle (oneDNN's packing also a layer per batch step; the
    numba kernels' panels only move into huge pages, when idle). Tokens stay
    transformers' before, during and after."""
    llm = LLM(str(llama_dir), defer_weight_packing=True)
    engine = llm.engine
    if not has_pending_reorders(engine.model):
        pytest.skip("no oneDNN packing on this build")
    left = len(engine.model.pending_reorders)
    panels = getattr(engine.model.pending_reorders[0], "panel_weight", None) is not None
    assert greedy(llm, make_prompts()) == reference(llama_dir)
    if panels:
        assert len(engine.model.pending_reorders) == left
    else:
        assert 0 < len(engine.model.pending_reorders) < left  # the prefill steps packed some
    engine.idle_work(seconds=60.0)
    assert not has_pending_reorders(engine.model)
    assert greedy(llm, make_prompts()) == reference(llama_dir)


def test_idle_work_faults_in_the_cache_blocks_to_be_used_next(llama_dir: Path) -> None:
    """When idle, the engine faults in the CPU memory of the next fresh cache blocks (up
    to ``KV_POPULATE_AHEAD_BYTES``), so that a decode step does not pay for the pages its
    first writes touch. The blocks' contents are unchanged, in use or not, and the
    tokens stay transformers'."""
    from rvllm.engine import idle_work

    llm = LLM(str(llama_dir))
    engine, bm = llm.engine, llm.engine.block_manager
    prompts = make_prompts()
    assert greedy(llm, prompts) == reference(llama_dir)
    used = bm.fresh_from
    assert used > 0 and engine.idle.kv_populated_to == 0
    ahead = idle_work.KV_POPULATE_AHEAD_BYTES // engine.idle.kv_block_bytes
    window = min(bm.num_blocks, used + ahead)

    def blocks() -> list[torch.Tensor]:  # the bytes of the blocks in use and the window's
        return [t[:window].flatten().view(torch.uint8)
                for a in engine.model.attention_layers() for t in a.kv_cache]

    caches = [b.clone() for b in blocks()]
    slices = 0
    while engine.has_idle_work:
        engine.idle_work()
        slices += 1
        assert slices < 10_000
    if engine.idle.kv_block_bytes == 0:
        pytest.skip("no MADV_POPULATE_WRITE here")
    assert engine.idle.kv_populated_to == window
    assert all(torch.equal(a, b) for a, b in zip(caches, blocks()))  # what is there stays
    assert greedy(llm, prompts) == reference(llama_dir)
    assert bm.fresh_from > used  # fresh blocks were taken: the window moves on with them
    assert engine.has_idle_work == (min(bm.num_blocks, bm.fresh_from + ahead)
                                    > engine.idle.kv_populated_to)
