"""The engine on the Triton kernels gives the same greedy tokens as on plain torch (and so
as transformers). Without CUDA the kernels run in Triton's interpreter on the CPU."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # triton.jit reads this when a kernel module is imported, which the engine does lazily.
    if any(name.startswith("rvllm.kernels.triton.") for name in sys.modules) and \
            os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("rvllm.kernels.triton was imported before TRITON_INTERPRET=1 was set.")
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="the Triton kernels need the triton package (test extras)")

from test_engine import NEW_TOKENS, greedy, make_prompts, reference  # noqa: E402

from rvllm import LLM, SamplingParams  # noqa: E402
from rvllm.layers.backend import resolve_kernel_backend, use_triton  # noqa: E402


@pytest.fixture(autouse=True)
def _back_to_torch():
    yield
    from rvllm.layers.backend import set_kernel_backend

    set_kernel_backend("torch")  # later tests in this process build torch engines


# Past llama, the interpreter's minutes go to the slow run.
@pytest.mark.parametrize("arch", ["llama", pytest.param("mistral", marks=pytest.mark.slow),
                                  pytest.param("qwen2", marks=pytest.mark.slow)])
def test_triton_path_matches_transformers(model_dirs: dict[str, Path], arch: str) -> None:
    llm = LLM(str(model_dirs[arch]), kernel_backend="triton", dtype="float32")
    assert llm.engine.kernel_backend == "triton" and use_triton()
    assert greedy(llm, make_prompts()) == reference(model_dirs[arch])


def test_triton_path_under_chunked_prefill_prefix_hits_and_preemption(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), kernel_backend="triton", dtype="float32", num_gpu_blocks=16,
              max_model_len=128, block_size=8, max_num_batched_tokens=24)
    prompts = make_prompts()
    assert greedy(llm, prompts) == reference(llama_dir)
    assert llm.engine.scheduler.num_preemptions > 0
    # The last three prompts again: their full blocks, the latest freed, come from the
    # prefix cache.
    hits = llm.engine.block_manager.prefix_cache_hits
    assert greedy(llm, prompts[-3:]) == reference(llama_dir)[-3:]
    assert llm.engine.block_manager.prefix_cache_hits > hits


@pytest.mark.slow  # 30 s interpreted; the overlap itself: test_async_scheduling.py
def test_triton_path_with_async_scheduling_matches_transformers(llama_dir: Path) -> None:
    # The steps on their own thread (the stand-in for a device stream), under chunked
    # prefill and preemption: on a GPU the same kernels run there.
    llm = LLM(str(llama_dir), kernel_backend="triton", dtype="float32", num_gpu_blocks=16,
              max_model_len=128, block_size=8, max_num_batched_tokens=24,
              async_scheduling=True)
    assert greedy(llm, make_prompts()) == reference(llama_dir)
    assert llm.engine.scheduler.num_preemptions > 0


def test_triton_greedy_sampling_returns_the_logprob(llama_dir: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = [LLM(str(llama_dir), kernel_backend=backend, dtype="float32")
            .generate([[5, 6, 7]], params)[0] for backend in ("torch", "triton")]
    torch_out, triton_out = outs
    assert triton_out.outputs[0].token_ids == torch_out.outputs[0].token_ids
    assert triton_out.outputs[0].cumulative_logprob == pytest.approx(
        torch_out.outputs[0].cumulative_logprob, abs=1e-4)


def test_auto_on_the_cpu_is_numba_in_float32_else_torch() -> None:
    assert resolve_kernel_backend("auto", torch.device("cpu"), torch.float32) == "numba"
    assert resolve_kernel_backend("auto", torch.device("cpu"), torch.bfloat16) == "torch"


def test_numba_outside_float32_on_the_cpu_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="CPU's float32 kernels"):
        resolve_kernel_backend("numba", torch.device("cpu"), torch.float16)


def test_triton_on_cpu_without_the_interpreter_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        resolve_kernel_backend("triton", torch.device("cpu"))


def _graphs_on_the_cpu(llm: LLM, num_blocks: int, block_size: int) -> list[int]:
    """Decode graphs for ``llm`` whose 'replay' reruns the captured forward on the static
    buffers (only the capture itself needs CUDA); returns the list of each replay's
    batch size, filled as they run."""
    from rvllm.executor.decode_graphs import DecodeGraphs

    engine = llm.engine
    mc = engine.model_config
    engine.runner.allocate_kv_cache(num_blocks + 1, mc.num_kv_heads, mc.head_dim, mc.dtype)
    graphs = DecodeGraphs(engine.model, engine.device, block_size, num_blocks, 128,
                          [1, 2, 4, 8])
    replays: list[int] = []

    def capture_one(inputs):
        out = graphs._forward(inputs)

        def replay() -> None:
            replays.append(inputs["input_ids"].shape[0])
            out.copy_(graphs._forward(inputs))
        return replay, out

    graphs.runner._capture_one = capture_one
    graphs.capture()
    engine.runner.decode_graphs = graphs
    return replays


def test_decode_graph_forward_with_padding_matches_transformers(llama_dir: Path) -> None:
    """The runner's graph path on the CPU: each 'replay' reruns the captured forward on the
    static buffers, so padding rows (scratch-block writes, zero lengths) and the buffer
    handling are exercised exactly as on a GPU."""
    num_blocks, block_size = 64, 8
    llm = LLM(str(llama_dir), kernel_backend="triton", dtype="float32",
              num_gpu_blocks=num_blocks, block_size=block_size, max_model_len=128,
              enforce_eager=True)
    replays = _graphs_on_the_cpu(llm, num_blocks, block_size)
    prompts = make_prompts()  # 8 prompts: decode batches of 8, then fewer as they finish
    assert greedy(llm, prompts) == reference(llama_dir)
    assert replays and set(replays) <= {1, 2, 4, 8}
    # A batch of 3 replays the graph of 4: one padding row.
    assert greedy(llm, prompts[:3]) == [r for r in reference(llama_dir)[:3]]
    assert replays[-1] == 4


def test_cuda_graph_sizes_flag() -> None:
    from rvllm.executor.decode_graphs import parse_capture_sizes

    assert parse_capture_sizes(None, 20) == [1, 2, 4, 8, 16, 20]
    assert parse_capture_sizes("1,4,64", 32) == [1, 4]
    with pytest.raises(ValueError, match="cuda-graph-sizes"):
        parse_capture_sizes("1,x", 8)


@pytest.mark.parametrize("method", ["ngram", pytest.param("self_draft", marks=pytest.mark.slow),
                                    pytest.param("draft_model", marks=pytest.mark.slow)])
def test_speculation_on_the_triton_kernels_keeps_greedy_output(llama_dir: Path,
                                                                method: str) -> None:
    """Verifying steps on the Triton kernels (eager: the prefill path, not a decode
    graph), with each proposer; the draft model is the target itself."""
    config = {"method": method, "num_speculative_tokens": 3,
              **({"model": str(llama_dir)} if method == "draft_model" else {})}
    prompts = [[7, 8, 9, 10] * 4, [30, 31, 32] * 5]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    plain = LLM(str(llama_dir), kernel_backend="triton", dtype="float32")
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    del plain
    spec = LLM(str(llama_dir), kernel_backend="triton", dtype="float32",
               speculative_config=config)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == expected
    assert spec.engine.spec_stats.num_drafts > 0


def test_fused_decode_gemv_matches_transformers(llama_dir: Path, monkeypatch) -> None:
    """--fused-decode-gemv: steps of up to four tokens fold each norm into the projection
    after it and SiLU * mul into the down projection, with the same greedy tokens."""
    from rvllm.models.llama import LlamaDecoderModel

    fused_rows = []
    forward = LlamaDecoderModel._fused_gemv_forward

    def counting(self, input_ids, positions):
        fused_rows.append(input_ids.shape[0])
        return forward(self, input_ids, positions)

    monkeypatch.setattr(LlamaDecoderModel, "_fused_gemv_forward", counting)
    # At most three sequences at once: every decode step and the short prefills fuse.
    # Plain weights, as on a GPU (the CPU's oneDNN copies would not fuse).
    llm = LLM(str(llama_dir), kernel_backend="triton", dtype="float32", max_num_seqs=3,
              cpu_linear_backend="torch", fused_decode_gemv=True)
    assert llm.engine.model.model.fuses_decode_gemv()
    # Prompts of 1, 3 and 7 tokens: the 7-token prefill runs the separate kernels.
    assert greedy(llm, make_prompts()[:3]) == reference(llama_dir)[:3]
    assert len(fused_rows) >= NEW_TOKENS - 1 and max(fused_rows) <= 4  # every decode step


def test_fused_decode_gemv_is_refused_off_the_triton_kernels(llama_dir: Path) -> None:
    with pytest.raises(ValueError, match="--fused-decode-gemv runs Triton kernels"):
        LLM(str(llama_dir), kernel_backend="torch", fused_decode_gemv=True)


def test_overlapped_graph_steps_keep_greedy_tokens_on_the_device(llama_dir: Path,
                                                                  monkeypatch) -> None:
    """--async-scheduling over decode graphs, every row greedy: each step's tokens stay
    where the greedy kernel wrote them, the next step's inputs are read from there, and
    the engine takes them afterwards; the tokens are transformers'."""
    from rvllm.executor import decode_graphs

    fed = []
    run = decode_graphs.DecodeGraphs.run

    def counting(self, *args):
        feed = args[5] if len(args) > 5 else None
        fed.append(feed is not None and max(feed[1]) >= 0)
        return run(self, *args)

    monkeypatch.setattr(decode_graphs.DecodeGraphs, "run", counting)
    num_blocks, block_size = 64, 8
    llm = LLM(str(llama_dir), kernel_backend="triton", dtype="float32",
              num_gpu_blocks=num_blocks, block_size=block_size, max_model_len=128,
              enforce_eager=True, async_scheduling=True)
    _graphs_on_the_cpu(llm, num_blocks, block_size)
    prompts = make_prompts()[:4]
    assert greedy(llm, prompts) == reference(llama_dir)[:4]
    # Every graph step after the first (which follows the prefill, sampled on the host)
    # takes its inputs from the device.
    assert len(fed) >= NEW_TOKENS - 2 and all(fed[1:])
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
