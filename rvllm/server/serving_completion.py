"""POST /v1/completions: prompts (text or token ids) in, text out, streamed or whole."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from rvllm.engine.async_engine import EngineDeadError, RequestStream
from rvllm.lora.request import LoRARequest
from rvllm.outputs import CompletionOutput, Logprob, RequestOutput
from rvllm.server.errors import APIError, bad_request, error_event
from rvllm.server.protocol import CompletionRequest
from rvllm.server.serving import (
    BEAM_SEARCH_FIELDS,
    DONE,
    PARAM_FIELDS,
    ServingBase,
    clamp_logprob,
    merge_streams,
    sse,
)

LogprobEntries = list[dict[int, Logprob] | None]


class CompletionServing(ServingBase):
    id_prefix = "cmpl"

    async def create(self, body: bytes, request: Request) -> Response:
        req = CompletionRequest.model_validate_json(body)
        lora = self.check_model(req.model)
        if req.suffix is not None:
            raise APIError("suffix is not supported: rvllm does not do fill-in-the-middle.",
                           param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError("best_of is not supported (only best_of == n).", param="best_of")
        prompts = req.prompts()
        if not prompts:
            raise APIError("prompt must not be empty.", param="prompt")
        if req.use_beam_search:
            return await self._beam_search(req, prompts, request, lora)
        prompt_logprobs = req.prompt_logprobs
        if req.echo and req.logprobs is not None:
            # Echoed prompt tokens carry logprobs too: what lm-evaluation-harness scores.
            prompt_logprobs = max(prompt_logprobs or 0, req.logprobs)
        try:
            params = req.sampling_params(req.max_tokens, req.logprobs, prompt_logprobs,
                                         self.default_sampling)
        except ValueError as e:
            raise bad_request(e, PARAM_FIELDS) from e
        params.lora_request = lora
        request_id = self.new_id()
        streams = await self.add_requests(request_id, prompts, params, final_only=not req.stream,
                                          constraint_field=req.constraint_field())
        if req.stream:
            return self.sse_response(self._stream(req, request_id, streams), streams)
        try:
            finals = await self.collect(streams, request)
        finally:
            self.abort_unfinished(streams)
        return JSONResponse(self._response(req, request_id, finals))

    async def _beam_search(self, req: CompletionRequest, prompts: list[str | list[int]],
                           request: Request, lora: LoRARequest | None) -> Response:
        try:
            params = req.beam_search_params(req.max_tokens)
        except ValueError as e:
            raise bad_request(e, BEAM_SEARCH_FIELDS) from e
        request_id = self.new_id()
        finals = await self.beam_search(request_id, prompts, params, request, lora)
        return JSONResponse(self._response(req, request_id, finals))

    # ---------------------------------------------------------------- whole

    def _response(self, req: CompletionRequest, request_id: str,
                  finals: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        completion_tokens = 0
        for i, final in enumerate(finals):
            prompt_text = self._prompt_text(final) if req.echo else ""
            for c in final.outputs:
                completion_tokens += len(c.token_ids)
                choice: dict[str, Any] = {
                    "index": i * req.n + c.index,
                    "text": prompt_text + c.text,
                    "logprobs": self._logprobs(req, final, c, 0, len(c.token_ids), 0),
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs_json(final.prompt_logprobs)
                choices.append(choice)
        prompt_tokens = sum(len(f.prompt_token_ids) for f in finals)
        cached_tokens = sum(f.num_cached_tokens for f in finals)
        return {"id": request_id, "object": "text_completion", "created": self.created(),
                "model": self.response_model(req.model), "choices": choices,
                "usage": self.usage(prompt_tokens, completion_tokens, cached_tokens)}

    def _prompt_text(self, final: RequestOutput) -> str:
        if final.prompt is not None:
            return final.prompt
        return self.engine.tokenizer.decode(final.prompt_token_ids, skip_special_tokens=False)

    def _logprobs(self, req: CompletionRequest, final: RequestOutput, c: CompletionOutput,
                  start: int, end: int, offset: int) -> dict[str, Any] | None:
        """OpenAI's legacy logprobs of output tokens [start, end), text offsets from
        ``offset``; with echo (start 0) the prompt tokens come first."""
        if req.logprobs is None:
            return None
        ids: list[int] = []
        entries: LogprobEntries = []
        if req.echo and start == 0 and final.prompt_logprobs is not None:
            ids += final.prompt_token_ids
            entries += final.prompt_logprobs
        ids += c.token_ids[start:end]
        entries += (c.logprobs or [])[start:end]
        return self._legacy_logprobs(ids, entries, req.logprobs, offset,
                                     req.tokens_as_ids(self.tokens_as_ids))

    def _legacy_logprobs(self, ids: list[int], entries: LogprobEntries, k: int,
                         offset: int, as_ids: bool) -> dict[str, Any]:
        """With ``as_ids`` each token is "token_id:<id>" (and text offsets advance by
        those names, as vLLM's do)."""
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        text_offset: list[int] = []
        for token_id, entry in zip(ids, entries):
            if entry is None:  # the first prompt token: nothing predicts it
                token = self.token_name(token_id, None, as_ids)
                token_logprobs.append(None)
                top_logprobs.append(None)
            else:
                chosen = entry[token_id]
                token = self.token_name(token_id, chosen.decoded_token or "", as_ids)
                token_logprobs.append(clamp_logprob(chosen.logprob))
                top: dict[str, float] = {}
                for tid, lp in entry.items():
                    if tid == token_id or (lp.rank is not None and lp.rank <= k):
                        # Keyed by text, so tokens that decode alike collide: keep the best.
                        text = self.token_name(tid, lp.decoded_token or "", as_ids)
                        value = clamp_logprob(lp.logprob)
                        top[text] = max(value, top.get(text, value))
                top_logprobs.append(top)
            tokens.append(token)
            text_offset.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": token_logprobs,
                "top_logprobs": top_logprobs, "text_offset": text_offset}

    # ------------------------------------------------------------- streamed

    async def _stream(self, req: CompletionRequest, request_id: str,
                      streams: list[RequestStream]) -> AsyncIterator[str]:
        n = req.n
        num_choices = len(streams) * n
        sent_text = [0] * num_choices  # characters of each choice's text already sent
        sent_tokens = [0] * num_choices
        offsets = [0] * num_choices
        started = [False] * num_choices
        prompt_tokens = [0] * len(streams)
        completion_tokens = [0] * len(streams)
        cached_tokens = [0] * len(streams)
        created = self.created()
        try:
            async for i, out in merge_streams(streams):
                prompt_tokens[i] = len(out.prompt_token_ids)
                cached_tokens[i] = out.num_cached_tokens
                completion_tokens[i] = sum(len(c.token_ids) for c in out.outputs)
                chunks = []
                for c in out.outputs:
                    idx = i * n + c.index
                    first = not started[idx]
                    text = c.text[sent_text[idx]:]
                    new_tokens = len(c.token_ids) - sent_tokens[idx]
                    # A token that ends mid-character adds no text yet: nothing to send.
                    wanted = text or c.finish_reason or (first and req.echo)
                    if not (wanted or (new_tokens and req.logprobs is not None)):
                        continue
                    echo = self._prompt_text(out) if first and req.echo else ""
                    logprobs = self._logprobs(req, out, c, sent_tokens[idx], len(c.token_ids),
                                              offsets[idx]) if (new_tokens or echo) else None
                    if logprobs is not None:
                        offsets[idx] += sum(len(t) for t in logprobs["tokens"])
                    started[idx] = True
                    sent_text[idx] = len(c.text)
                    sent_tokens[idx] = len(c.token_ids)
                    chunk: dict[str, Any] = {
                        "id": request_id, "object": "text_completion", "created": created,
                        "model": self.response_model(req.model),
                        "choices": [{"index": idx, "text": echo + text, "logprobs": logprobs,
                                     "finish_reason": c.finish_reason,
                                     "stop_reason": c.stop_reason}],
                    }
                    if req.include_usage:
                        chunk["usage"] = (self.usage(prompt_tokens[i], completion_tokens[i],
                                                     cached_tokens[i])
                                          if req.continuous_usage else None)
                    chunks.append(sse(chunk))
                if chunks:
                    yield "".join(chunks)
            if req.include_usage:
                yield sse({"id": request_id, "object": "text_completion", "created": created,
                           "model": self.response_model(req.model), "choices": [],
                           "usage": self.usage(sum(prompt_tokens), sum(completion_tokens),
                                               sum(cached_tokens))})
        except EngineDeadError as e:
            yield error_event(APIError(str(e), 503))
        finally:
            self.abort_unfinished(streams)
        yield DONE


def prompt_logprobs_json(entries: LogprobEntries | None) -> list[dict[str, Any] | None] | None:
    """vLLM's ``prompt_logprobs``: per prompt position, token id -> logprob, rank, text."""
    if entries is None:
        return None
    return [
        None if e is None else {
            str(tid): {"logprob": clamp_logprob(lp.logprob), "rank": lp.rank,
                       "decoded_token": lp.decoded_token}
            for tid, lp in e.items()
        }
        for e in entries
    ]
