"""What a pooling model (``--runner pooling`` or ``--convert embed``) answers:
POST /v1/embeddings, texts or token ids in, one vector each out; and, from those vectors,
vLLM's /score (cosine similarities of text pairs) and /rerank (documents ranked against
a query)."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from rvllm.outputs import RequestOutput
from rvllm.pooling_params import PoolingParams, cosine_similarity, score_pairs
from rvllm.server.errors import APIError, bad_request
from rvllm.server.protocol_pooling import EmbeddingRequest, RerankRequest, ScoreRequest
from rvllm.server.serving import PARAM_FIELDS, ServingBase
from rvllm.server.serving_chat import render_chat_prompt


class EmbeddingServing(ServingBase):
    id_prefix = "embd"

    async def create(self, body: bytes, request: Request) -> Response:
        req = EmbeddingRequest.model_validate_json(body)
        self.check_model(req.model)
        if (req.input is None) == (req.messages is None):
            raise APIError("Give exactly one of 'input' and 'messages'.", param="input")
        if req.messages is not None:
            prompts: list[str | list[int]] = [self._chat_prompt(req)]
        else:
            prompts = req.prompts()
        if not prompts:
            raise APIError("input must not be empty.", param="input")
        try:
            params = req.pooling_params()
        except ValueError as e:
            raise bad_request(e, PARAM_FIELDS) from e
        if not req.add_special_tokens and req.messages is None:
            prompts = [self._tokens(p, req.truncate_prompt_tokens) for p in prompts]
        request_id = self.new_id()
        finals = await self._embed(request_id, prompts, params, request)
        return JSONResponse(self._response(req, request_id, finals))

    async def score(self, body: bytes, request: Request) -> Response:
        req = ScoreRequest.model_validate_json(body)
        self.check_model(req.model)
        first = [req.text_1] if isinstance(req.text_1, str) else req.text_1
        second = [req.text_2] if isinstance(req.text_2, str) else req.text_2
        try:
            pairs = score_pairs(len(first), len(second))
        except ValueError as e:
            raise APIError(str(e), param="text_2" if first else "text_1") from e
        request_id = self.new_id("score")
        vectors, tokens = await self._vectors(request_id, first + second,
                                              req.truncate_prompt_tokens, request)
        data = [{"index": k, "object": "score",
                 "score": cosine_similarity(vectors[i], vectors[len(first) + j])}
                for k, (i, j) in enumerate(pairs)]
        return JSONResponse({"id": request_id, "object": "list", "created": self.created(),
                             "model": self.model_name, "data": data,
                             "usage": self.usage(tokens, 0, 0)})

    async def rerank(self, body: bytes, request: Request) -> Response:
        req = RerankRequest.model_validate_json(body)
        self.check_model(req.model)
        if not req.documents:
            raise APIError("documents must hold at least one document.", param="documents")
        if req.top_n is not None and req.top_n < 0:
            raise APIError(f"top_n must be at least 0, got {req.top_n}.", param="top_n")
        request_id = self.new_id("rerank")
        vectors, tokens = await self._vectors(request_id, [req.query, *req.documents],
                                              req.truncate_prompt_tokens, request)
        results = [{"index": i, "document": {"text": doc},
                    "relevance_score": cosine_similarity(vectors[0], vectors[i + 1])}
                   for i, doc in enumerate(req.documents)]
        results.sort(key=lambda r: r["relevance_score"], reverse=True)
        if req.top_n:  # 0 or unset: every document
            results = results[:req.top_n]
        return JSONResponse({"id": request_id, "model": self.model_name,
                             "usage": {"total_tokens": tokens}, "results": results})

    async def _vectors(self, request_id: str, texts: list[str], truncate: int | None,
                       request: Request) -> tuple[list[list[float]], int]:
        """Each text's embedding (as the server pools them) and the tokens they took."""
        try:
            params = PoolingParams(truncate_prompt_tokens=truncate)
        except ValueError as e:
            raise bad_request(e, PARAM_FIELDS) from e
        finals = await self._embed(request_id, list(texts), params, request)
        return ([f.pooled for f in finals],  # type: ignore[misc]
                sum(len(f.prompt_token_ids) for f in finals))

    async def _embed(self, request_id: str, prompts: list[str | list[int]],
                     params: PoolingParams, request: Request) -> list[RequestOutput]:
        """Every prompt's finished output, each with its vector."""
        try:
            streams = await self.add_requests(request_id, prompts, params, final_only=True)
        except APIError as e:
            if e.param == "prompt":  # the engine's name for the texts given
                e.param = "input"
            raise
        try:
            finals = await self.collect(streams, request)
        finally:
            self.abort_unfinished(streams)
        if any(f.pooled is None for f in finals):
            raise APIError("The request was aborted.", 503)
        return finals

    def _chat_prompt(self, req: EmbeddingRequest) -> list[int]:
        """The messages rendered with the chat template (which holds its own special
        tokens), as the chat endpoint renders them."""
        if not req.messages:
            raise APIError("messages must not be empty.", param="messages")
        if req.continue_final_message and req.add_generation_prompt:
            raise APIError("add_generation_prompt and continue_final_message cannot both "
                           "be true.", param="continue_final_message")
        return render_chat_prompt(self.engine.tokenizer, req.messages,
                                  req.add_generation_prompt, req.continue_final_message, None,
                                  req.chat_template, req.chat_template_kwargs,
                                  None if req.truncate_prompt_tokens is not None
                                  else self.engine.max_model_len)

    def _tokens(self, prompt: str | list[int], truncate: int | None) -> list[int]:
        """A text's token ids without the tokenizer's special tokens (BOS); tokenized
        only as far as the context allows, unless it is to be truncated."""
        if not isinstance(prompt, str):
            return prompt
        if truncate is not None:
            return self.engine.tokenizer.encode(prompt, add_special_tokens=False)
        return self.encode_text(prompt, add_special_tokens=False, field="input")

    def _response(self, req: EmbeddingRequest, request_id: str,
                  finals: list[RequestOutput]) -> dict[str, Any]:
        data = [{"index": i, "object": "embedding",
                 "embedding": encode_embedding(final.pooled,  # type: ignore[arg-type]
                                               req.encoding_format)}
                for i, final in enumerate(finals)]
        prompt_tokens = sum(len(f.prompt_token_ids) for f in finals)
        return {"id": request_id, "object": "list", "created": self.created(),
                "model": self.model_name, "data": data,
                "usage": self.usage(prompt_tokens, 0, sum(f.num_cached_tokens
                                                          for f in finals))}


def encode_embedding(vector: list[float], encoding_format: str) -> list[float] | str:
    """``float``: the list as is; ``base64``: its little-endian float32 bytes in base64
    (what the openai client asks for by default, and decodes)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector
