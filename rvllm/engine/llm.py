"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from tqdm import tqdm

from rvllm.beam_search import (
    BeamSearch,
    BeamSearchOutput,
    BeamSearchParams,
    advance_all,
    pending_beams,
)
from rvllm.config import EngineArgs
from rvllm.engine.llm_engine import LLMEngine
from rvllm.inputs import PromptType
from rvllm.lora.request import LoRARequest
from rvllm.outputs import (
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from rvllm.pooling_params import PoolingParams, cosine_similarity, score_pairs
from rvllm.sampling_params import SamplingParams
from rvllm.tokenizer import Tokenizer

Conversation = list[dict[str, Any]]


class LLM:
    """Generate from many prompts at once, continuously batched.

    ``LLM(model=DIR)`` takes a Hugging Face directory or a GGUF file; with no model
    it loads the built-in default (SmolLM2-135M-Instruct). Keyword arguments are
    the engine arguments (``dtype``, ``max_model_len``, ``num_gpu_blocks``, ...).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineArgs(model=model, **kwargs))

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLM:
        llm = cls.__new__(cls)
        llm.engine = LLMEngine(args)
        return llm

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling parameters ``generate`` and ``chat`` use when given none: the
        model's generation config (``--generation-config``) over SamplingParams'."""
        return SamplingParams(**self.engine.sampling_defaults)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of ``prompts``. A string, a token-id list or a dict is
        one prompt; a list of them is many. ``priority``: one per prompt, lower first
        (under ``scheduling_policy="priority"``). ``lora_request``: the LoRA adapter of
        every prompt, or one per prompt (under ``enable_lora=True``)."""
        prompts = _prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} SamplingParams for {len(prompts)} prompts."
                )
        if priority is not None:
            if len(priority) != len(prompts):
                raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts.")
            params_list = [replace(p, priority=rank) for p, rank in zip(params_list, priority)]
        if lora_request is not None:
            loras = ([lora_request] * len(prompts) if isinstance(lora_request, LoRARequest)
                     else list(lora_request))
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(loras)} LoRA requests for {len(prompts)} prompts.")
            params_list = [replace(p, lora_request=lora) for p, lora in zip(params_list, loras)]
        return self._run(self._add(prompts, params_list), use_tqdm)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = False,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (``outputs.embedding``), in the order of ``prompts``,
        from an engine started as a pooling model (``runner="pooling"`` or
        ``convert="embed"``)."""
        prompts = _prompt_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params_list = [pooling_params or PoolingParams()] * len(prompts)
        else:
            params_list = list(pooling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} PoolingParams for {len(prompts)} prompts.")
        if truncate_prompt_tokens is not None:
            params_list = [replace(p, truncate_prompt_tokens=truncate_prompt_tokens)
                           for p in params_list]
        outputs = self._run(self._add(prompts, params_list), use_tqdm)
        return [EmbeddingRequestOutput.from_output(o) for o in outputs]

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str], *,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = False
              ) -> list[ScoringRequestOutput]:
        """The cosine similarity of embeddings (a pooling model's): ``text_1`` (one text)
        against each of ``text_2``, or the two lists pair by pair, as vLLM scores with an
        embedding model."""
        first = [text_1] if isinstance(text_1, str) else list(text_1)
        second = [text_2] if isinstance(text_2, str) else list(text_2)
        pairs = score_pairs(len(first), len(second))
        embedded = self.embed(first + second, truncate_prompt_tokens=truncate_prompt_tokens,
                              use_tqdm=use_tqdm)
        results = []
        for i, j in pairs:
            a, b = embedded[i], embedded[len(first) + j]
            results.append(ScoringRequestOutput(
                f"{a.request_id}-{b.request_id}", a.prompt_token_ids + b.prompt_token_ids,
                ScoringOutput(cosine_similarity(a.outputs.embedding, b.outputs.embedding))))
        return results

    def beam_search(self, prompts: PromptType | Sequence[PromptType],
                    params: BeamSearchParams, use_tqdm: bool = False,
                    lora_request: LoRARequest | None = None) -> list[BeamSearchOutput]:
        """Beam search over each prompt (``rvllm.beam_search``): ``params.beam_width``
        sequences per prompt, best first, their ``tokens`` starting with the prompt's;
        with ``lora_request``'s adapter."""
        engine = self.engine
        searches = []
        for prompt in _prompt_list(prompts):
            _, ids = engine.tokenize_prompt(prompt, engine.max_model_len)
            searches.append(BeamSearch(ids, params, engine.eos_token_ids,
                                       engine.max_model_len, lora_request))
        bar = tqdm(total=max(s.max_tokens for s in searches), desc="Beam search",
                   disable=not use_tqdm)
        while pending := pending_beams(searches):
            advance_all(pending, self._run(self._add(
                [beam.tokens for _, beam in pending],
                [search.step_params() for search, _ in pending]), False))
            bar.update(1)
        bar.close()
        return [BeamSearchOutput(s.results(engine.tokenizer)) for s in searches]

    def _add(self, prompts: list[PromptType],
             params_list: Sequence[SamplingParams | PoolingParams]) -> list[str]:
        """Queue every prompt; if one is refused, none stays queued."""
        ids: list[str] = []
        try:
            for prompt, params in zip(prompts, params_list):
                ids.append(self.engine.add_request(None, prompt, params))
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return ids

    def chat(
        self,
        messages: Conversation | list[Conversation],
        sampling_params: SamplingParams | None = None,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or several) and generate."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        tokenizer = self.engine.tokenizer
        prompts = []
        for conv in conversations:
            text = tokenizer.apply_chat_template(
                conv,  # type: ignore[arg-type]
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message,
                chat_template=chat_template,
            )
            # The template already holds the special tokens (BOS and the like).
            prompts.append(tokenizer.encode(text, add_special_tokens=False))
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    finished[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [finished[i] for i in ids]


def _prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """A string, a token-id list or a dict is one prompt; a list of them is many."""
    if isinstance(prompts, (str, dict)) or (
        isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
    ):
        return [prompts]  # type: ignore[list-item]
    return list(prompts)  # type: ignore[arg-type]
