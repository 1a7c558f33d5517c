"""Embeddings from a pooling model (``--runner pooling``, ``--convert embed``): each vector
equals the one made from transformers' hidden states (``AutoModel``'s last_hidden_state,
after the final norm) in float32, pooled by the last token, the mean or the first token,
under batching, chunked prefill, prefix-cache hits, preemption and async scheduling; and
``/v1/embeddings`` through the openai client."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import openai
import pytest
import torch
from server_helpers import ServerProcess

from rvllm import LLM, PoolingParams, SamplingParams
from rvllm.config import EngineArgs
from rvllm.pooling_params import PoolerConfig, resolve_runner

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# Short and long (past the step's token budget, so prefilled in chunks), and one token.
PROMPTS = [[1, 5, 9, 33, 7], list(range(3, 60)), [4], [7, 7, 8, 100, 200, 300, 11, 12, 13]]
TOL = 2e-6


def reference(model_dir: Path, prompts: list[list[int]], kind: str, normalize: bool = True
              ) -> list[torch.Tensor]:
    """transformers' pooled vectors, one prompt at a time."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    for ids in prompts:
        with torch.no_grad():
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
        vector = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[kind]
        out.append(torch.nn.functional.normalize(vector, dim=0) if normalize else vector)
    return out


def assert_close(outputs, expected) -> None:
    assert len(outputs) == len(expected)
    for out, want in zip(outputs, expected):
        got = torch.tensor(out.outputs.embedding)
        assert got.shape == want.shape
        assert (got - want).abs().max().item() < TOL


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
@pytest.mark.parametrize("kernels", ["numba", "torch"])
def test_pooled_vectors_equal_transformers_in_chunks_and_batches(llama_dir, kind, kernels):
    llm = LLM(str(llama_dir), runner="pooling", kernel_backend=kernels,
              pooler_config={"pooling_type": kind}, max_num_batched_tokens=16)
    outputs = llm.embed(PROMPTS)
    assert_close(outputs, reference(llama_dir, PROMPTS, kind))
    assert [o.prompt_token_ids for o in outputs] == PROMPTS
    assert all(o.finished and o.outputs.hidden_size == 64 for o in outputs)


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_every_family_pools_its_final_hidden_states(model_dirs, arch):
    llm = LLM(str(model_dirs[arch]), convert="embed")
    assert_close(llm.embed(PROMPTS), reference(model_dirs[arch], PROMPTS, "LAST"))


def test_last_token_pooling_takes_prefix_cache_hits_and_mean_takes_none(llama_dir):
    shared = list(range(10, 50))
    prompts = [shared + [1, 2], shared + [3, 4, 5]]
    for kind, hits in (("LAST", True), ("MEAN", False)):
        llm = LLM(str(llama_dir), runner="pooling", pooler_config={"pooling_type": kind})
        first = llm.embed(prompts[0])
        second = llm.engine.add_request(None, prompts[1], PoolingParams())
        outputs = []
        while llm.engine.has_unfinished_requests():
            outputs += [o for o in llm.engine.step() if o.finished]
        assert (outputs[0].num_cached_tokens > 0) == hits, kind
        assert outputs[0].request_id == second
        from rvllm.outputs import EmbeddingRequestOutput

        assert_close(first + [EmbeddingRequestOutput.from_output(outputs[0])],
                     reference(llama_dir, prompts, kind))


@pytest.mark.parametrize("kind", ["MEAN", "LAST", "CLS"])
def test_a_preempted_pooling_request_pools_each_position_once(llama_dir, kind):
    """A pooling engine's requests only prefill, so its own scheduler seldom preempts
    them: the test preempts one (as ``Scheduler._fit_running`` does) after its first
    chunk, and the recomputed chunk adds nothing twice."""
    from rvllm.engine.scheduler import SchedulerOutput

    prompt = list(range(1, 60))
    llm = LLM(str(llama_dir), runner="pooling", pooler_config={"pooling_type": kind},
              max_num_batched_tokens=16)
    engine = llm.engine
    engine.add_request("r", prompt, PoolingParams())
    engine.step()
    engine.step()
    [seq] = engine.scheduler.running
    assert seq.num_computed_tokens == 32
    engine.scheduler.running.remove(seq)
    engine.scheduler._preempt(seq, SchedulerOutput())
    assert seq.num_computed_tokens == 0 and engine.scheduler.num_preemptions == 1
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    from rvllm.outputs import EmbeddingRequestOutput

    assert_close([EmbeddingRequestOutput.from_output(outputs[0])],
                 reference(llama_dir, [prompt], kind))


def test_a_chunk_that_repeats_pooled_positions_adds_only_the_new_ones(llama_dir):
    """With a step in flight, a chunk recomputed after a preemption may have been planned
    before the chunk before it was taken: its rows overlap what is pooled already."""
    from rvllm.executor.model_runner import SeqStepOutput

    llm = LLM(str(llama_dir), runner="pooling", pooler_config={"pooling_type": "MEAN"})
    engine = llm.engine
    engine.add_request("r", list(range(1, 40)), PoolingParams())
    seq = engine.requests["r"].seqs[0]
    rows = torch.arange(39 * 64, dtype=torch.float32).view(39, 64)
    for first, count in ((0, 20), (16, 16), (0, 16)):
        engine._take_pooled(seq, SeqStepOutput(seq, count, pool_rows=rows[first:first + count],
                                               pool_count=count, pool_first=first))
    assert seq.pool_count == 32 and torch.equal(seq.pool_sum, rows[:32].sum(0))
    engine.abort_request("r")


def test_async_scheduling_pools_the_same(llama_dir):
    llm = LLM(str(llama_dir), runner="pooling", async_scheduling=True,
              pooler_config={"pooling_type": "MEAN"}, max_num_batched_tokens=16)
    assert_close(llm.embed(PROMPTS), reference(llama_dir, PROMPTS, "MEAN"))


def test_normalize_truncation_and_matryoshka_dimensions(llama_dir, tmp_path):
    llm = LLM(str(llama_dir), runner="pooling")
    raw = llm.embed(PROMPTS[:2], PoolingParams(normalize=False))
    assert_close(raw, reference(llama_dir, PROMPTS[:2], "LAST", normalize=False))
    cut = llm.embed(PROMPTS[1], truncate_prompt_tokens=7)
    assert cut[0].prompt_token_ids == PROMPTS[1][-7:]
    assert_close(cut, reference(llama_dir, [PROMPTS[1][-7:]], "LAST"))
    with pytest.raises(ValueError, match="Matryoshka"):
        llm.embed(PROMPTS[0], PoolingParams(dimensions=16))
    # A Matryoshka model: the vector cut to its first k values, then normalized.
    path = tmp_path / "matryoshka"
    shutil.copytree(llama_dir, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32]}))
    llm = LLM(str(path), runner="pooling")
    [out] = llm.embed(PROMPTS[0], PoolingParams(dimensions=16))
    want = reference(llama_dir, PROMPTS[:1], "LAST", normalize=False)[0][:16]
    got = torch.tensor(out.outputs.embedding)
    assert (got - torch.nn.functional.normalize(want, dim=0)).abs().max() < TOL
    with pytest.raises(ValueError, match="dimensions 8 is not one"):
        llm.embed(PROMPTS[0], PoolingParams(dimensions=8))


def test_a_runner_refuses_the_other_kind_of_request(llama_dir):
    pooling = LLM(str(llama_dir), runner="pooling")
    with pytest.raises(ValueError, match="embeddings, not text"):
        pooling.generate("hello", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="context length is 256"):
        pooling.embed([5] * 257)
    generating = LLM(str(llama_dir))
    with pytest.raises(ValueError, match="--runner pooling"):
        generating.embed("hello")


def test_pooler_config_comes_from_sentence_transformers_then_the_flag(tmp_path):
    assert PoolerConfig.resolve(str(tmp_path), None) == PoolerConfig("LAST", True)
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, "pooling_mode_mean_tokens": True}))
    assert PoolerConfig.resolve(str(tmp_path), None) == PoolerConfig("MEAN", False)
    assert PoolerConfig.resolve(str(tmp_path), '{"pooling_type": "cls", "normalize": true}'
                                ) == PoolerConfig("CLS", True)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="pooling_mode_max_tokens is not supported"):
        PoolerConfig.resolve(str(tmp_path), None)


@pytest.mark.parametrize("kwargs, match", [
    ({"runner": "pooling", "pooler_config": '{"pooling": "MEAN"}'}, "no key 'pooling'"),
    ({"runner": "pooling", "pooler_config": "{"}, "not valid JSON"),
    ({"runner": "score"}, "runner must be one of"),
    ({"runner": "generate", "convert": "embed"}, "does not go with"),
    ({"runner": "pooling", "convert": "none"}, "leave convert as auto"),
])
def test_bad_runner_arguments_are_refused_by_name(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(**kwargs)
    assert resolve_runner("auto", "embed") == "pooling"
    assert resolve_runner("auto", "auto") == "generate"


def test_pooling_refuses_speculation_and_a_bad_pooling_type(llama_dir):
    with pytest.raises(ValueError, match="nothing to speculate on"):
        LLM(str(llama_dir), runner="pooling",
            speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="pooling_type must be one of"):
        LLM(str(llama_dir), runner="pooling", pooler_config={"pooling_type": "ALL"})


def test_score_is_the_cosine_of_the_embeddings_one_to_many_or_pairwise(llama_dir):
    llm = LLM(str(llama_dir), runner="pooling", pooler_config={"pooling_type": "MEAN"})
    texts = ["The quick brown fox", "def add(a, b):", "hello world"]
    vectors = [torch.tensor(o.outputs.embedding) for o in llm.embed(texts)]

    def cos(a: torch.Tensor, b: torch.Tensor) -> float:
        return torch.nn.functional.cosine_similarity(a, b, dim=0).item()

    one_to_many = llm.score(texts[0], texts[1:])
    assert [o.outputs.score for o in one_to_many] == pytest.approx(
        [cos(vectors[0], vectors[1]), cos(vectors[0], vectors[2])], abs=1e-6)
    pairwise = llm.score(texts[:2], texts[1:])
    assert [o.outputs.score for o in pairwise] == pytest.approx(
        [cos(vectors[0], vectors[1]), cos(vectors[1], vectors[2])], abs=1e-6)
    assert llm.score("same", "same")[0].outputs.score == pytest.approx(1.0)
    with pytest.raises(ValueError, match="same length"):
        llm.score(texts[:2], texts)


@pytest.fixture(scope="module")
def server(llama_dir):
    srv = ServerProcess(llama_dir, "--runner", "pooling", "--served-model-name", "emb",
                        "--pooler-config", '{"pooling_type": "MEAN"}')
    yield srv
    srv.stop()


def test_openai_client_gets_embeddings_in_base64_and_floats(server, llama_dir):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    ids = [PROMPTS[0], PROMPTS[1]]
    # The client asks for base64 unless told otherwise, and decodes it.
    result = client.embeddings.create(model="emb", input=ids)
    floats = client.embeddings.create(model="emb", input=ids, encoding_format="float")
    want = reference(llama_dir, ids, "MEAN")
    for response in (result, floats):
        assert [d.index for d in response.data] == [0, 1]
        for d, w in zip(response.data, want):
            assert (torch.tensor(d.embedding) - w).abs().max() < TOL
        assert response.usage.prompt_tokens == response.usage.total_tokens == sum(map(len, ids))
        assert response.model == "emb"
    text = client.embeddings.create(model="emb", input="The quick brown fox",
                                    encoding_format="float")
    assert len(text.data[0].embedding) == 64
    with pytest.raises(openai.BadRequestError, match="embeddings, not text"):
        client.completions.create(model="emb", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="Matryoshka"):
        client.embeddings.create(model="emb", input="hi", dimensions=8)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="hi")


def test_add_special_tokens_false_leaves_out_the_bos(server):
    import httpx

    from rvllm.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(server_model_dir(server), None)
    text = "The quick brown fox"
    with_bos = httpx.post(f"{server.url}/v1/embeddings", json={"input": text}).json()
    without = httpx.post(f"{server.url}/v1/embeddings",
                         json={"input": text, "add_special_tokens": False}).json()
    bare = tokenizer.encode(text, add_special_tokens=False)
    assert without["usage"]["prompt_tokens"] == len(bare)
    ids = httpx.post(f"{server.url}/v1/embeddings", json={"input": bare}).json()
    assert ids["data"][0]["embedding"] == without["data"][0]["embedding"]
    assert with_bos["usage"]["prompt_tokens"] == len(tokenizer.encode(text))


def server_model_dir(server: ServerProcess) -> str:
    import httpx

    return httpx.get(f"{server.url}/v1/models").json()["data"][0]["root"]


def test_score_and_rerank_over_http(server):
    import httpx

    texts = ["The quick brown fox", "def add(a, b):", "hello world", "return a + b"]
    floats = httpx.post(f"{server.url}/v1/embeddings",
                        json={"input": texts, "encoding_format": "float"}).json()
    vectors = [torch.tensor(d["embedding"]) for d in floats["data"]]

    def cos(i: int, j: int) -> float:
        return torch.nn.functional.cosine_similarity(vectors[i], vectors[j], dim=0).item()

    for path in ("/score", "/v1/score"):
        scored = httpx.post(f"{server.url}{path}",
                            json={"text_1": texts[0], "text_2": texts[1:]}).json()
        assert [d["score"] for d in scored["data"]] == pytest.approx(
            [cos(0, 1), cos(0, 2), cos(0, 3)], abs=1e-6)
        assert [d["index"] for d in scored["data"]] == [0, 1, 2]
    bad = httpx.post(f"{server.url}/score", json={"text_1": texts[:2], "text_2": texts})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_2"
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        ranked = httpx.post(f"{server.url}{path}", json={
            "query": texts[1], "documents": [texts[0], texts[2], texts[3]], "top_n": 2}).json()
        want = sorted([(cos(1, 0), 0), (cos(1, 2), 1), (cos(1, 3), 2)], reverse=True)[:2]
        assert [r["index"] for r in ranked["results"]] == [i for _, i in want]
        assert [r["relevance_score"] for r in ranked["results"]] == pytest.approx(
            [s for s, _ in want], abs=1e-6)
        assert ranked["results"][0]["document"]["text"] == [texts[0], texts[2], texts[3]][
            want[0][1]]
        assert ranked["usage"]["total_tokens"] > 0
    empty = httpx.post(f"{server.url}/rerank", json={"query": "x", "documents": []})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "documents"


def test_chat_messages_embed_as_their_rendered_prompt(server):
    import httpx

    messages = [{"role": "user", "content": "The quick brown fox"}]
    ids = httpx.post(f"{server.url}/tokenize", json={
        "messages": messages, "add_generation_prompt": False}).json()["tokens"]
    by_chat = httpx.post(f"{server.url}/v1/embeddings", json={"messages": messages}).json()
    by_ids = httpx.post(f"{server.url}/v1/embeddings", json={"input": ids}).json()
    assert by_chat["data"][0]["embedding"] == by_ids["data"][0]["embedding"]
    assert by_chat["usage"]["prompt_tokens"] == len(ids)
    both = httpx.post(f"{server.url}/v1/embeddings", json={"messages": messages, "input": "x"})
    assert both.status_code == 400 and both.json()["error"]["param"] == "input"
    empty = httpx.post(f"{server.url}/v1/embeddings", json={"messages": []})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "messages"
