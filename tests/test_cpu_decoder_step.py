"""The one-token decoder step in numba (kernels/cpu_decoder_step.py) against the torch
layers it replaces and against transformers: float32 and int8 weights, GQA, Qwen2's
biases, Mistral's sliding window, and the models it must leave to the layers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import hf_greedy

from rvllm import LLM, SamplingParams
from rvllm.kernels.cpu_decoder_step import build_plan

PROMPTS = [[5, 6, 7], [11, 3, 99, 42, 8, 17, 250, 31, 64, 2, 77, 19, 5, 5, 300, 12, 40, 41]]
NEW_TOKENS = 40  # past Mistral's 24-token window in the test models


def generate(llm: LLM, prompt: list[int], fused: bool) -> tuple[list[int], float]:
    """Greedy tokens and their cumulative logprob, one sequence at a time (every decode
    step has one row), with the fused step or the torch layers."""
    decoder = llm.engine.model.model
    if not fused:
        decoder._decoder_step_plan = None
    else:
        decoder.__dict__.pop("_decoder_step_plan", None)  # built again on first use
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    out = llm.generate([prompt], params)[0].outputs[0]
    return out.token_ids, out.cumulative_logprob


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_fused_step_matches_transformers_and_the_layers(model_dirs: dict[str, Path],
                                                        arch: str) -> None:
    llm = LLM(str(model_dirs[arch]), kernel_backend="numba", block_size=8)
    assert build_plan(llm.engine.model.model) is not None
    want = hf_greedy(model_dirs[arch], PROMPTS, NEW_TOKENS)
    for prompt, expected in zip(PROMPTS, want):
        tokens, logprob = generate(llm, prompt, fused=True)
        assert llm.engine.model.model._decoder_step_plan is not None  # it did run
        assert tokens == expected
        layer_tokens, layer_logprob = generate(llm, prompt, fused=False)
        assert layer_tokens == tokens
        assert logprob == pytest.approx(layer_logprob, abs=1e-3)


def test_fused_step_with_int8_weights_matches_the_int8_layers(llama_dir: Path) -> None:
    # No prefix cache: int8 prefills quantize activations over the whole chunk, so a
    # prefix hit (a shorter chunk) would change the prompt's K/V by ~1e-3.
    llm = LLM(str(llama_dir), kernel_backend="numba", quantization="int8",
              enable_prefix_caching=False)
    for prompt in PROMPTS:
        tokens, logprob = generate(llm, prompt, fused=True)
        assert llm.engine.model.model._decoder_step_plan is not None
        layer_tokens, layer_logprob = generate(llm, prompt, fused=False)
        assert tokens == layer_tokens
        assert logprob == pytest.approx(layer_logprob, abs=1e-3)


def test_hidden_state_matches_the_layers_closely(llama_dir: Path) -> None:
    """One step's final hidden state, both ways, from the same cache."""
    from rvllm.forward_context import AttentionMetadata, set_forward_context

    llm = LLM(str(llama_dir), kernel_backend="numba", block_size=8)
    engine, bs = llm.engine, 8
    engine.add_request(None, PROMPTS[1], SamplingParams(temperature=0, max_tokens=4))
    engine.step()  # the prefill: the prompt's K/V are in the cache
    seq = next(iter(engine.requests.values())).seqs[0]
    pos = seq.num_computed_tokens
    table = torch.tensor([seq.block_table], dtype=torch.long)
    slots = table[0, torch.arange(pos + 1) // bs] * bs + torch.arange(pos + 1) % bs
    decoder = engine.model.model
    outs = []
    for plan in (build_plan(decoder), None):
        decoder._decoder_step_plan = plan
        md = AttentionMetadata(slots[-1:], 1, slots.unsqueeze(0), torch.tensor([pos + 1]), [],
                               decode_block_tables=table)
        with torch.inference_mode(), set_forward_context(md):
            outs.append(decoder(torch.tensor([9]), torch.tensor([pos])))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def test_other_shapes_keep_the_layers(model_dirs: dict[str, Path]) -> None:
    llm = LLM(str(model_dirs["llama"]), kernel_backend="numba", cpu_linear_backend="torch")
    assert build_plan(llm.engine.model.model) is None  # no row-major weights
