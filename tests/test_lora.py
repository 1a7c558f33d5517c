"""LoRA adapters (``--enable-lora``): each request runs with its own adapter, or none, in
one batch, and its greedy tokens equal transformers' on the base weights with that
adapter merged in (W + alpha / r * B A), in float32, on the numba and torch kernels; the
prefix cache keeps adapters apart; ``--max-loras`` bounds the adapters of a step; bad
adapters are refused by name; the server serves ``--lora-modules`` by model name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import openai
import pytest
import torch
from conftest import hf_greedy
from safetensors.torch import save_file
from server_helpers import ServerProcess

from rvllm import LLM, SamplingParams
from rvllm.lora.request import LoRARequest, parse_lora_modules

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = [[1, 5, 9, 33, 7], list(range(3, 40)), [4, 8]]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def write_adapter(model_dir: Path, out: Path, seed: int, targets=ALL, rank: int = 4,
                  alpha: float = 8, **config) -> dict[str, torch.Tensor]:
    """A PEFT LoRA folder for ``model_dir``'s model with random A and B."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    shapes = {"q_proj": (cfg.hidden_size, cfg.num_attention_heads * head_dim),
              "k_proj": (cfg.hidden_size, cfg.num_key_value_heads * head_dim),
              "v_proj": (cfg.hidden_size, cfg.num_key_value_heads * head_dim),
              "o_proj": (cfg.num_attention_heads * head_dim, cfg.hidden_size),
              "gate_proj": (cfg.hidden_size, cfg.intermediate_size),
              "up_proj": (cfg.hidden_size, cfg.intermediate_size),
              "down_proj": (cfg.intermediate_size, cfg.hidden_size)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(cfg.num_hidden_layers):
        for name in targets:
            block = "mlp" if name in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{i}.{block}.{name}"
            inputs, outputs = shapes[name]
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inputs, generator=g) * 0.3
            tensors[f"{key}.lora_B.weight"] = torch.randn(outputs, rank, generator=g) * 0.3
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "bias": "none",
        "target_modules": list(targets), **config}))
    return tensors


def merged_model(model_dir: Path, tensors: dict[str, torch.Tensor], scale: float,
                 out: Path) -> Path:
    """``model_dir``'s model with the adapter merged into its weights."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    state = model.state_dict()
    for key, a in tensors.items():
        if key.endswith("lora_A.weight"):
            b = tensors[key.replace("lora_A", "lora_B")]
            name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            state[name] += scale * b @ a
    model.load_state_dict(state)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory):
    """Two adapters (one on every projection, one on q and v with rsLoRA) and transformers'
    greedy tokens with each merged, and with none."""
    root = tmp_path_factory.mktemp("lora")
    first = write_adapter(llama_dir, root / "all", 1)
    second = write_adapter(llama_dir, root / "qv", 2, targets=("q_proj", "v_proj"), rank=8,
                           alpha=4, use_rslora=True)
    return {
        "base": hf_greedy(llama_dir, PROMPTS, 8),
        "all": (LoRARequest("all", 1, str(root / "all")), hf_greedy(
            merged_model(llama_dir, first, 8 / 4, root / "merged-all"), PROMPTS, 8)),
        "qv": (LoRARequest("qv", 2, str(root / "qv")), hf_greedy(
            merged_model(llama_dir, second, 4 / 8 ** 0.5, root / "merged-qv"), PROMPTS, 8)),
        "root": root,
    }


@pytest.mark.parametrize("kernels", ["numba", "torch"])
def test_each_request_runs_its_own_adapter_in_one_batch(llama_dir, adapters, kernels):
    llm = LLM(str(llama_dir), enable_lora=True, max_loras=2, kernel_backend=kernels)
    (all_lora, want_all), (qv_lora, want_qv) = adapters["all"], adapters["qv"]
    assert want_all != adapters["base"] and want_qv != adapters["base"]
    outputs = llm.generate(PROMPTS * 3, GREEDY,
                           lora_request=[None] * 3 + [all_lora] * 3 + [qv_lora] * 3)
    got = [o.outputs[0].token_ids for o in outputs]
    assert got[:3] == adapters["base"]
    assert got[3:6] == want_all
    assert got[6:] == want_qv


def test_the_prefix_cache_keeps_adapters_apart(llama_dir, adapters):
    llm = LLM(str(llama_dir), enable_lora=True)
    all_lora, want_all = adapters["all"]
    prompt = PROMPTS[1]
    base = llm.generate([prompt], GREEDY)[0]
    adapted = llm.generate([prompt], GREEDY, lora_request=all_lora)[0]
    again = llm.generate([prompt], GREEDY, lora_request=all_lora)[0]
    assert base.outputs[0].token_ids == adapters["base"][1]
    assert adapted.num_cached_tokens == 0  # the base's blocks are not the adapter's
    assert adapted.outputs[0].token_ids == again.outputs[0].token_ids == want_all[1]
    assert again.num_cached_tokens > 0


def test_max_loras_bounds_the_adapters_of_each_step(llama_dir, adapters):
    llm = LLM(str(llama_dir), enable_lora=True, max_loras=1)
    (all_lora, want_all), (qv_lora, want_qv) = adapters["all"], adapters["qv"]
    engine = llm.engine
    for i, (prompt, lora) in enumerate(zip(PROMPTS * 2, [all_lora] * 3 + [qv_lora] * 3)):
        engine.add_request(str(i), prompt, SamplingParams(
            max_tokens=8, temperature=0, ignore_eos=True, lora_request=lora))
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        assert len({s.lora_id for s in engine.scheduler.running}) <= 1
    assert [finished[str(i)] for i in range(6)] == want_all + want_qv


def test_the_snapshot_names_the_running_and_waiting_adapters(llama_dir, adapters):
    from rvllm.engine.async_engine import snapshot_of
    from rvllm.engine.data_parallel import _plus

    llm = LLM(str(llama_dir), enable_lora=True, max_loras=1, max_cpu_loras=2)
    engine = llm.engine
    for i, lora in enumerate([adapters["all"][0], adapters["qv"][0], None]):
        engine.add_request(str(i), PROMPTS[0], SamplingParams(max_tokens=4,
                                                              lora_request=lora))
    snap = snapshot_of(engine)
    assert (snap.running_lora_adapters, snap.waiting_lora_adapters, snap.max_loras) == \
        ((), ("all", "qv"), 1)
    engine.step()  # one adapter at a time: "all" runs, "qv" waits
    snap = snapshot_of(engine)
    assert (snap.running_lora_adapters, snap.waiting_lora_adapters) == (("all",), ("qv",))
    assert _plus(("qv",), ("all", "qv")) == ("all", "qv")  # data parallel: the union
    while engine.has_unfinished_requests():
        engine.step()


def test_bad_adapters_are_refused_by_name(llama_dir, adapters, tmp_path):
    llm = LLM(str(llama_dir), enable_lora=True, max_lora_rank=8)
    root = adapters["root"]

    def refused(path: Path, match: str, lora_id: int = 7) -> None:
        with pytest.raises(ValueError, match=match):
            llm.generate("hi", GREEDY, lora_request=LoRARequest("bad", lora_id, str(path)))

    refused(tmp_path / "nowhere", "no adapter_config.json")
    wide = write_adapter(llama_dir, tmp_path / "wide", 3, rank=16)
    assert wide
    refused(tmp_path / "wide", "rank 16 is larger than --max-lora-rank 8")
    shutil.copytree(root / "all", tmp_path / "embed")
    save_file({"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 512)},
              str(tmp_path / "embed" / "adapter_model.safetensors"))
    refused(tmp_path / "embed", "lora_embedding_A is not a LoRA A or B weight")
    shutil.copytree(root / "all", tmp_path / "dora")
    config = json.loads((tmp_path / "dora" / "adapter_config.json").read_text())
    (tmp_path / "dora" / "adapter_config.json").write_text(json.dumps({**config,
                                                                      "use_dora": True}))
    refused(tmp_path / "dora", "use_dora is not supported")
    (tmp_path / "bin").mkdir()
    shutil.copy(root / "all" / "adapter_config.json", tmp_path / "bin")
    (tmp_path / "bin" / "adapter_model.bin").write_bytes(b"x")
    refused(tmp_path / "bin", "save the adapter as safetensors")
    # An id already taken by another adapter; the engine still serves the good ones.
    llm.generate("hi", GREEDY, lora_request=adapters["all"][0])
    refused(root / "qv", "already the adapter 'all'", lora_id=1)
    assert llm.generate([PROMPTS[0]], GREEDY)[0].outputs[0].token_ids == adapters["base"][0]
    with pytest.raises(ValueError, match="--enable-lora"):
        LLM(str(llama_dir)).generate("hi", GREEDY, lora_request=adapters["all"][0])
    with pytest.raises(ValueError, match="tensor parallelism"):
        LLM(str(llama_dir), enable_lora=True, tensor_parallel_size=2)


def test_past_max_cpu_loras_the_least_recently_used_idle_adapter_is_dropped(llama_dir,
                                                                            adapters):
    llm = LLM(str(llama_dir), enable_lora=True, max_cpu_loras=1)
    (all_lora, want_all), (qv_lora, want_qv) = adapters["all"], adapters["qv"]
    manager = llm.engine.lora_manager
    qkv = llm.engine.model.model.layers[0].self_attn.qkv_proj
    assert llm.generate([PROMPTS[0]], GREEDY, lora_request=all_lora)[0].outputs[0].token_ids \
        == want_all[0]
    assert list(manager.loaded) == [1]
    assert llm.generate([PROMPTS[0]], GREEDY, lora_request=qv_lora)[0].outputs[0].token_ids \
        == want_qv[0]
    assert list(manager.loaded) == [2] and set(qkv.lora_weights) == {2}
    assert llm.generate([PROMPTS[1]], GREEDY, lora_request=all_lora)[0].outputs[0].token_ids \
        == want_all[1]
    assert list(manager.loaded) == [1]
    with pytest.raises(ValueError, match="max_cpu_loras"):
        LLM(str(llama_dir), enable_lora=True, max_loras=2, max_cpu_loras=1)


def test_lora_modules_parse_as_vllm_gives_them():
    modules = parse_lora_modules(["a=/x", '{"name": "b", "path": "/y"}'])
    assert modules == [LoRARequest("a", 1, "/x"), LoRARequest("b", 2, "/y")]
    for bad, match in ((["a"], "name=path"), (["a=/x", "a=/y"], "twice"), (["{"], "JSON")):
        with pytest.raises(ValueError, match=match):
            parse_lora_modules(bad)


def test_the_server_serves_lora_modules_by_model_name(llama_dir, adapters, monkeypatch):
    all_lora, want_all = adapters["all"]
    qv_lora, want_qv = adapters["qv"]
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    srv = ServerProcess(llama_dir, "--served-model-name", "base", "--enable-lora",
                        "--lora-modules", f"mine={all_lora.lora_path}")
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none")
        metrics = httpx.get(f"{srv.url}/metrics").text
        assert 'vllm:lora_requests_info{max_lora="1",running_lora_adapters="",' \
            'waiting_lora_adapters=""}' in metrics
        models = {m.id: m for m in client.models.list().data}
        assert set(models) == {"base", "mine"}
        assert models["mine"].model_extra["parent"] == "base"
        for model, want in (("mine", want_all[0]), ("base", adapters["base"][0])):
            r = client.completions.create(
                model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=0,
                extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
            assert r.model == model
            tokens = r.choices[0].logprobs.tokens
            assert [int(t.removeprefix("token_id:")) for t in tokens] == want
        chat = client.chat.completions.create(
            model="mine", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
        assert chat.model == "mine"
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="yours", prompt="hi", max_tokens=1)
        # Runtime updates (VLLM_ALLOW_RUNTIME_LORA_UPDATING): load, use, unload by name.
        load = {"lora_name": "yours", "lora_path": qv_lora.lora_path}
        r = httpx.post(f"{srv.url}/v1/load_lora_adapter", json=load)
        assert r.status_code == 200 and "added" in r.text
        assert httpx.post(f"{srv.url}/v1/load_lora_adapter", json=load).status_code == 400
        assert "yours" in {m.id for m in client.models.list().data}
        r = client.completions.create(
            model="yours", prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=0,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        assert [int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens] \
            == want_qv[0]
        unload = {"lora_name": "yours"}
        assert httpx.post(f"{srv.url}/v1/unload_lora_adapter", json=unload).status_code == 200
        assert httpx.post(f"{srv.url}/v1/unload_lora_adapter", json=unload).status_code == 404
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="yours", prompt="hi", max_tokens=1)
        bad = httpx.post(f"{srv.url}/v1/load_lora_adapter",
                         json={"lora_name": "x", "lora_path": "/nowhere"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "lora_path"
    finally:
        srv.stop()
    with pytest.raises(RuntimeError, match="server exited"):
        ServerProcess(llama_dir, "--lora-modules", f"mine={all_lora.lora_path}")
