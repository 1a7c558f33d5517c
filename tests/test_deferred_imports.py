"""An engine process may start without torch's Python meta kernels and import them idle
(``rvllm.deferred_imports``): the tokens are the same, and the torch it ends with is whole."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import hf_greedy

PROMPT = [5, 9, 2, 33, 7, 1, 18]

# Run in a fresh interpreter: the deferral needs a process whose torch is not imported.
ENGINE_PROCESS = f"PROMPT = {PROMPT!r}\n" + """
import json, sys
from rvllm.deferred_imports import defer_torch_meta_registrations, has_deferred
assert defer_torch_meta_registrations()
import torch
left_out = sorted(m for m in ("torch._prims", "torch._refs", "torch._decomp")
                  if m not in sys.modules)
from rvllm.config import EngineArgs
from rvllm.engine.llm_engine import LLMEngine
from rvllm.sampling_params import SamplingParams

engine = LLMEngine(EngineArgs(model=sys.argv[1], defer_weight_packing=True))
params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

def greedy(request_id):
    engine.add_request(request_id, {"prompt_token_ids": PROMPT}, params)
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = list(out.outputs[0].token_ids)
    return tokens

before = greedy("before")
slices = 0
while engine.has_idle_work:
    engine.idle_work()
    slices += 1
meta = torch.empty(4, device="meta")
print(json.dumps({"left_out": left_out, "before": before, "after": greedy("after"),
                  "deferred": has_deferred(), "slices": slices,
                  "meta_where": list(torch.where(meta > 0, meta, meta).shape),
                  "placeholder": torch._meta_registrations.__doc__}))
"""


def test_an_engine_started_without_torchs_meta_kernels_imports_them_when_idle(
        llama_dir: Path) -> None:
    out = subprocess.run([sys.executable, "-c", ENGINE_PROCESS, str(llama_dir)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["left_out"] == ["torch._decomp", "torch._prims", "torch._refs"]
    expected = hf_greedy(llama_dir, [PROMPT], 6)[0]
    assert result["before"] == expected and result["after"] == expected
    assert not result["deferred"] and result["slices"] >= 4
    assert result["meta_where"] == [4]  # a Python meta kernel, registered idle
    assert result["placeholder"] != "placeholder until rvllm's engine idles"


def test_nothing_is_deferred_once_torch_is_imported() -> None:
    from rvllm.deferred_imports import defer_torch_meta_registrations, has_deferred

    assert "torch" in sys.modules
    assert not defer_torch_meta_registrations() and not has_deferred()


def test_a_deferred_import_that_fails_is_logged_and_the_rest_dropped(
        monkeypatch, caplog) -> None:  # noqa: ANN001 - pytest fixtures
    from rvllm import deferred_imports

    monkeypatch.setattr(deferred_imports, "_deferred", ["torch._rvllm_no_such", "torch._refs"])
    assert not deferred_imports.import_next()  # the engine's idle loop goes on
    assert not deferred_imports.has_deferred()
    assert "could not import torch._rvllm_no_such" in caplog.text


SEEDED_BEFORE_IDLE = f"PROMPT = {PROMPT!r}\n" + """
import json, sys
from rvllm.deferred_imports import defer_torch_meta_registrations
assert defer_torch_meta_registrations()
from rvllm import LLM, SamplingParams

llm = LLM(sys.argv[1], load_format="dummy")  # dummy weights: drawn from a torch.Generator
params = SamplingParams(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
out = llm.generate({"prompt_token_ids": PROMPT}, params)[0].outputs[0].token_ids
print(json.dumps(list(out)))
"""


def test_seeds_and_dummy_weights_work_before_the_deferred_imports(llama_dir: Path) -> None:
    """torch refuses a Generator before torch._prims is in: a seeded request (or dummy
    weights) brings it in at once, and samples as in a whole torch."""
    from rvllm import LLM, SamplingParams

    out = subprocess.run([sys.executable, "-c", SEEDED_BEFORE_IDLE, str(llama_dir)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    here = LLM(str(llama_dir), load_format="dummy").generate(
        {"prompt_token_ids": PROMPT}, params)[0].outputs[0].token_ids
    assert json.loads(out.stdout.strip().splitlines()[-1]) == list(here)
