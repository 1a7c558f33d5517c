"""POST /v1/embeddings: texts or token ids in, one vector each out, from an engine started
as a pooling model (``--runner pooling`` or ``--convert embed``)."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from rvllm.outputs import RequestOutput
from rvllm.server.errors import APIError, bad_request
from rvllm.server.protocol import EmbeddingRequest
from rvllm.server.serving import PARAM_FIELDS, ServingBase


class EmbeddingServing(ServingBase):
    id_prefix = "embd"

    async def create(self, body: bytes, request: Request) -> Response:
        req = EmbeddingRequest.model_validate_json(body)
        self.check_model(req.model)
        prompts = req.prompts()
        if not prompts:
            raise APIError("input must not be empty.", param="input")
        try:
            params = req.pooling_params()
        except ValueError as e:
            raise bad_request(e, PARAM_FIELDS) from e
        if not req.add_special_tokens:
            prompts = [self._tokens(p, req.truncate_prompt_tokens) for p in prompts]
        request_id = self.new_id()
        try:
            streams = await self.add_requests(request_id, prompts, params, final_only=True)
        except APIError as e:
            if e.param == "prompt":  # the engine's name for what this API calls input
                e.param = "input"
            raise
        try:
            finals = await self.collect(streams, request)
        finally:
            self.abort_unfinished(streams)
        return JSONResponse(self._response(req, request_id, finals))

    def _tokens(self, prompt: str | list[int], truncate: int | None) -> list[int]:
        """A text's token ids without the tokenizer's special tokens (BOS); tokenized
        only as far as the context allows, unless it is to be truncated."""
        if not isinstance(prompt, str):
            return prompt
        tokenizer = self.engine.tokenizer
        if truncate is not None:
            return tokenizer.encode(prompt, add_special_tokens=False)
        ids = tokenizer.encode_bounded(prompt, self.engine.max_model_len,
                                       add_special_tokens=False)
        if ids is None:
            raise APIError(f"This model's maximum context length is "
                           f"{self.engine.max_model_len} tokens, and the input ({len(prompt)} "
                           "characters) is longer than that.", param="input",
                           code="context_length_exceeded")
        return ids

    def _response(self, req: EmbeddingRequest, request_id: str,
                  finals: list[RequestOutput]) -> dict[str, Any]:
        data = []
        for i, final in enumerate(finals):
            if final.pooled is None:
                raise APIError("The request was aborted.", 503)
            data.append({"index": i, "object": "embedding",
                         "embedding": encode_embedding(final.pooled, req.encoding_format)})
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
