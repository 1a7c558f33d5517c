"""The model's generation config as request defaults (``--generation-config``,
``--override-generation-config``), as in vLLM: the sampling fields a request leaves unset
take the model's values, over HTTP and in ``LLM.generate``; ``max_new_tokens`` caps
``max_tokens``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import openai
import pytest
from server_helpers import ServerProcess

from rvllm import LLM, SamplingParams
from rvllm.config import EngineArgs
from rvllm.generation_config import sampling_defaults

# top_k 1 makes every sample the greedy token, whatever the temperature: its effect is
# visible in the tokens.
GENERATION = {"top_k": 1, "temperature": 0.9, "repetition_penalty": 1.0,
              "max_new_tokens": 5, "do_sample": True, "bos_token_id": 0}
PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def model_dir(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Llama test model with a generation config that recommends sampling."""
    path = tmp_path_factory.mktemp("generation") / "llama"
    shutil.copytree(llama_dir, path)
    (path / "generation_config.json").write_text(json.dumps(GENERATION))
    return path


def test_the_sampling_keys_become_defaults_and_max_new_tokens_a_cap(model_dir, tmp_path):
    want = {"top_k": 1, "temperature": 0.9, "repetition_penalty": 1.0, "max_tokens": 5}
    assert sampling_defaults(str(model_dir)) == want
    assert sampling_defaults(str(model_dir), "vllm") == {}
    assert sampling_defaults(str(model_dir), "vllm", {"top_p": 0.5}) == {"top_p": 0.5}
    assert sampling_defaults(str(model_dir), override={"temperature": 0.2}) == {
        **want, "temperature": 0.2}
    (tmp_path / "generation_config.json").write_text('{"min_p": 0.1}')
    assert sampling_defaults(str(model_dir), str(tmp_path)) == {"min_p": 0.1}
    assert sampling_defaults(str(model_dir / "model.safetensors")) == {}  # a file: none


@pytest.mark.parametrize("kwargs, match", [
    ({"generation_config": "/nonexistent"}, "no generation_config.json there"),
    ({"override_generation_config": '{"temperature": -1}'}, "temperature"),
    ({"override_generation_config": '{"top_q": 1}'}, "no key 'top_q'"),
    ({"override_generation_config": "{"}, "not valid JSON"),
])
def test_a_bad_generation_config_is_refused_by_name(model_dir, kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(model=str(model_dir), **kwargs).sampling_defaults()


def test_generate_without_sampling_params_uses_the_models_defaults(model_dir):
    llm = LLM(str(model_dir))
    defaults = llm.get_default_sampling_params()
    assert (defaults.top_k, defaults.temperature, defaults.max_tokens) == (1, 0.9, 5)
    greedy = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=5))
    assert llm.generate(PROMPT)[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids
    plain = LLM(str(model_dir), generation_config="vllm").get_default_sampling_params()
    assert (plain.top_k, plain.temperature, plain.max_tokens) == (0, 1.0, 16)


def test_the_server_fills_unset_fields_and_caps_max_tokens(model_dir):
    server = ServerProcess(model_dir, "--override-generation-config", '{"max_new_tokens": 4}')
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        greedy = client.completions.create(model=model, prompt=PROMPT, temperature=0,
                                           max_tokens=4).choices[0].text
        # Unset: top_k 1 and the cap of 4 (under the completions default of 16).
        assert client.completions.create(model=model, prompt=PROMPT).choices[0].text == greedy
        # Set: the request's own values win, under the cap.
        out = client.completions.create(model=model, prompt=PROMPT, max_tokens=2, seed=1,
                                        extra_body={"top_k": 0})
        assert out.usage.completion_tokens == 2
    finally:
        server.stop()
