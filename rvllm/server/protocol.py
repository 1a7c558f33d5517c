"""Request bodies of the OpenAI API (and vLLM's extra sampling fields), validated strictly.

Types are strict (``"5"`` is not a number), unknown fields are refused the way
OpenAI refuses them, and range checks are SamplingParams' own, so the limits
live in one place. What this module adds are caps on the sizes of lists and
strings (``MAX_*`` below), checked while the body is parsed: past one, the
request is a 400 naming the field.

The response models at the end describe what the endpoints answer, for
``/openapi.json`` (the handlers build their answers as dicts). A pooling model's
endpoints have theirs in ``protocol_pooling``, the Responses API in
``protocol_responses``; ``openapi`` gathers them all into the document.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
)
from pydantic.json_schema import JsonDict

from rvllm.beam_search import BeamSearchParams
from rvllm.sampling_params import SamplingParams, StructuredOutputsParams

TokenIds = list[StrictInt]

# Caps on what one request may ask for (docs/serving.md, Errors).
MAX_N = 128  # n: choices per prompt
MAX_BEST_OF = 128  # best_of
MAX_LOGIT_BIAS = 1024  # logit_bias entries
MAX_STOP_STRINGS = 64  # stop strings
MAX_STOP_STRING_CHARS = 1024  # characters in one stop string
MAX_STOP_TOKEN_IDS = 1024  # stop_token_ids
MAX_ALLOWED_TOKEN_IDS = 262144  # allowed_token_ids (more than any vocabulary)
MAX_MESSAGES = 4096  # chat messages (also /tokenize's)
MAX_TOOLS = 128  # tools
MAX_PROMPTS = 1024  # prompts in one /v1/completions request


def _check_count(field: str, value: Any, limit: int, what: str = "entries") -> Any:
    """``value`` (a list or dict, or None) unless it holds more than ``limit`` items:
    then a ValueError the 400 quotes as is (errors.validation_error)."""
    if value is not None and len(value) > limit:
        raise ValueError(f"{field} may have at most {limit} {what}, got {len(value)}.")
    return value


def _check_stop(value: str | list[str] | None) -> str | list[str] | None:
    stops = [value] if isinstance(value, str) else value or []
    _check_count("stop", stops, MAX_STOP_STRINGS, "strings")
    longest = max((len(s) for s in stops), default=0)
    if longest > MAX_STOP_STRING_CHARS:
        raise ValueError(f"stop strings may have at most {MAX_STOP_STRING_CHARS} characters, "
                         f"got one of {longest}.")
    return value


def _stop_schema(schema: JsonDict) -> None:
    """The stop caps in the JSON schema: each string, and the list's length."""
    for branch in schema.get("anyOf", [schema]):
        if branch.get("type") == "string":
            branch["maxLength"] = MAX_STOP_STRING_CHARS
        elif branch.get("type") == "array":
            branch["maxItems"] = MAX_STOP_STRINGS
            branch["items"]["maxLength"] = MAX_STOP_STRING_CHARS  # type: ignore[index]


def _prompt_schema(schema: JsonDict) -> None:
    """The prompt cap in the JSON schema: lists of prompts (of texts, or of token-id
    lists), not a single prompt's token ids."""
    for branch in schema.get("anyOf", []):
        items = branch.get("items") if branch.get("type") == "array" else None
        if isinstance(items, dict) and items.get("type") in ("string", "array"):
            branch["maxItems"] = MAX_PROMPTS


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class JSONSchemaFormat(_Strict):
    """``response_format.json_schema``: OpenAI's named schema."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False,
                              populate_by_name=True)
    name: StrictStr | None = None
    description: StrictStr | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Strict):
    """OpenAI's ``response_format``: free text, any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsRequest(_Strict):
    """vLLM's ``structured_outputs`` object: exactly one of json, regex, choice, grammar
    and json_object, with JSON's whitespace options."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False,
                              populate_by_name=True)
    json_schema: dict[str, Any] | StrictStr | None = Field(None, alias="json")
    regex: StrictStr | None = None
    choice: list[StrictStr] | None = None
    grammar: StrictStr | None = None
    json_object: StrictBool | None = None
    disable_any_whitespace: StrictBool = False
    disable_additional_properties: StrictBool = False
    whitespace_pattern: StrictStr | None = None


class SamplingRequest(_Strict):
    """The fields /v1/completions and /v1/chat/completions share."""

    model: StrictStr | None = None
    max_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: StrictInt = Field(1, json_schema_extra={"maximum": MAX_N})
    stop: StrictStr | list[StrictStr] | None = Field(None, json_schema_extra=_stop_schema)
    seed: StrictInt | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = Field(
        None, json_schema_extra={"maxProperties": MAX_LOGIT_BIAS})
    user: StrictStr | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # vLLM's extra sampling fields
    top_k: StrictInt | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: TokenIds | None = Field(
        None, json_schema_extra={"maxItems": MAX_STOP_TOKEN_IDS})
    allowed_token_ids: TokenIds | None = Field(
        None, json_schema_extra={"maxItems": MAX_ALLOWED_TOKEN_IDS})
    truncate_prompt_tokens: StrictInt | None = None
    priority: StrictInt = 0  # under --scheduling-policy priority: lower runs first
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = 0
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    prompt_logprobs: StrictInt | None = None
    # logprobs name tokens "token_id:<id>" (None: the server's --return-tokens-as-token-ids)
    return_tokens_as_token_ids: StrictBool | None = None
    # Beam search (vLLM's): n beams, ranked by cumulative logprob / length ** length_penalty
    use_beam_search: StrictBool = False
    length_penalty: float = 1.0
    # Constrained output: OpenAI's response_format, vLLM's structured_outputs, and
    # vLLM's older guided_* fields (aliases of structured_outputs' kinds).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    guided_whitespace_pattern: StrictStr | None = None
    # OpenAI fields that change nothing here, accepted so clients that send them work
    metadata: dict[str, Any] | None = None
    store: StrictBool | None = None
    service_tier: StrictStr | None = None

    @field_validator("n")
    @classmethod
    def _cap_n(cls, n: int) -> int:
        if n > MAX_N:
            raise ValueError(f"n must be at most {MAX_N}, got {n}.")
        return n

    @field_validator("stop")
    @classmethod
    def _cap_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        return _check_stop(stop)

    @field_validator("logit_bias")
    @classmethod
    def _cap_logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        return _check_count("logit_bias", bias, MAX_LOGIT_BIAS)

    @field_validator("stop_token_ids")
    @classmethod
    def _cap_stop_token_ids(cls, ids: list[int] | None) -> list[int] | None:
        return _check_count("stop_token_ids", ids, MAX_STOP_TOKEN_IDS)

    @field_validator("allowed_token_ids")
    @classmethod
    def _cap_allowed_token_ids(cls, ids: list[int] | None) -> list[int] | None:
        return _check_count("allowed_token_ids", ids, MAX_ALLOWED_TOKEN_IDS)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None,
                        defaults: dict[str, Any] | None = None) -> SamplingParams:
        """SamplingParams for this request; ValueError names the field out of range.
        ``defaults`` (the model's generation config) stand in for the sampling fields
        the request leaves unset, and their ``max_tokens`` caps the request's."""
        defaults = defaults or {}
        cap = defaults.get("max_tokens")
        if cap is not None:
            max_tokens = cap if max_tokens is None else min(max_tokens, cap)
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true.")
        bias = None
        if self.logit_bias is not None:
            try:
                bias = {int(k): v for k, v in self.logit_bias.items()}
            except ValueError:
                raise ValueError(
                    "logit_bias keys must be token ids (integers as strings)."
                ) from None
        return SamplingParams(
            n=self.n,
            presence_penalty=_or(self.presence_penalty, 0.0),
            frequency_penalty=_or(self.frequency_penalty, 0.0),
            repetition_penalty=_or(self.repetition_penalty,
                                   defaults.get("repetition_penalty", 1.0)),
            temperature=_or(self.temperature, defaults.get("temperature", 1.0)),
            top_p=_or(self.top_p, defaults.get("top_p", 1.0)),
            top_k=_or(self.top_k, defaults.get("top_k", 0)),
            min_p=_or(self.min_p, defaults.get("min_p", 0.0)),
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=bias,
            allowed_token_ids=self.allowed_token_ids,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            priority=self.priority,
            structured_outputs=self.structured_outputs_params(),
        )

    def beam_search_params(self, max_tokens: int | None) -> BeamSearchParams:
        """With ``use_beam_search``: ``n`` beams of at most ``max_tokens`` (None: the rest
        of the context); ValueError naming a field beam search does not take
        (``BEAM_SEARCH_REFUSES``)."""
        refused = sorted(self.model_fields_set & BEAM_SEARCH_REFUSES)
        if refused:
            raise ValueError(f"{refused[0]} is not supported with use_beam_search.")
        if self.stream:
            raise ValueError("stream is not supported with use_beam_search: the beams are "
                             "known only at the end.")
        return BeamSearchParams(beam_width=self.n, max_tokens=max_tokens,
                                ignore_eos=self.ignore_eos,
                                temperature=_or(self.temperature, 0.0),
                                length_penalty=self.length_penalty,
                                include_stop_str_in_output=self.include_stop_str_in_output)

    def constraint_field(self) -> str:
        """The field the request's constraint came from, for errors' ``param``."""
        if self.response_format is not None and self.response_format.type != "text":
            return "response_format"
        for kind in ("json", "regex", "choice", "grammar"):
            if getattr(self, f"guided_{kind}") is not None:
                return f"guided_{kind}"
        return "structured_outputs"

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The request's one constraint, from whichever field gave it; ValueError (naming
        the field) for two at once or an incomplete one."""
        given: list[tuple[str, dict[str, Any]]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise ValueError("response_format of type json_schema needs json_schema."
                                 "schema, the JSON schema itself.")
            given.append(("response_format", {"json": fmt.json_schema.json_schema}))
        if self.structured_outputs is not None:
            so = self.structured_outputs.model_dump(exclude_none=True, by_alias=True)
            given.append(("structured_outputs", so))
        guided = {"json": self.guided_json, "regex": self.guided_regex,
                  "choice": self.guided_choice, "grammar": self.guided_grammar}
        for kind, value in guided.items():
            if value is not None:
                given.append((f"guided_{kind}", {kind: value}))
        if not given:
            if self.guided_whitespace_pattern is not None:
                raise ValueError("guided_whitespace_pattern needs guided_json.")
            return None
        if len(given) > 1:
            names = ", ".join(name for name, _ in given)
            raise ValueError(f"{given[1][0]} cannot be combined with {given[0][0]}: give one "
                             f"constraint per request (got {names}).")
        field, fields = given[0]
        if self.guided_whitespace_pattern is not None:
            fields["whitespace_pattern"] = self.guided_whitespace_pattern
        try:
            return StructuredOutputsParams(**fields)
        except ValueError as e:
            message = str(e).removeprefix("structured_outputs")
            raise ValueError(f"{field}{message}" if message != str(e) else f"{field}: {e}"
                             ) from None

    def tokens_as_ids(self, server_default: bool) -> bool:
        """Whether logprobs name tokens by id: the request's choice, else the server's."""
        return _or(self.return_tokens_as_token_ids, server_default)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


# Fields that change what is sampled or returned per token, which beam search (ranking
# candidates by the model's logprobs, returning whole beams) does not take.
BEAM_SEARCH_REFUSES = frozenset({
    "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
    "logit_bias", "allowed_token_ids", "stop", "stop_token_ids", "min_tokens", "logprobs",
    "top_logprobs", "prompt_logprobs", "response_format", "structured_outputs",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "tools", "best_of",
})


class CompletionRequest(SamplingRequest):
    prompt: StrictStr | list[StrictStr] | TokenIds | list[TokenIds] = Field(
        json_schema_extra=_prompt_schema)
    max_tokens: StrictInt | None = 16
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    suffix: StrictStr | None = None
    best_of: StrictInt | None = Field(None, json_schema_extra={"maximum": MAX_BEST_OF})

    @field_validator("prompt")
    @classmethod
    def _cap_prompts(cls, prompt: Any) -> Any:
        return _cap_prompt_list("prompt", prompt)

    @field_validator("best_of")
    @classmethod
    def _cap_best_of(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        if best_of is None:
            return None
        if best_of > MAX_BEST_OF:
            raise ValueError(f"best_of must be at most {MAX_BEST_OF}, got {best_of}.")
        n = info.data.get("n")
        if isinstance(n, int) and best_of < n:
            raise ValueError(f"best_of must be at least n ({n}), got {best_of}.")
        return best_of

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids)."""
        return _prompt_list(self.prompt)


def _cap_prompt_list(field: str, prompt: Any) -> Any:
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        _check_count(field, prompt, MAX_PROMPTS, "prompts")
    return prompt


def _prompt_list(p: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """One prompt (a text or token ids) or a list of them, as a list of prompts."""
    if isinstance(p, str):
        return [p]
    if p and isinstance(p[0], int):
        return [p]  # type: ignore[list-item]
    return list(p)  # type: ignore[arg-type]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    type: StrictStr
    text: StrictStr | None = None


class ChatMessage(BaseModel):
    # Extra keys (reasoning, ...) go to the chat template untouched.
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: StrictStr | None = None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ChatTool(BaseModel):
    """One entry of ``tools``: a function the model may call."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: StrictStr


class NamedToolChoice(_Strict):
    """``tool_choice`` naming the one function the model must call."""

    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(json_schema_extra={"maxItems": MAX_MESSAGES})
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    tools: list[ChatTool] | None = Field(None, json_schema_extra={"maxItems": MAX_TOOLS})
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    # vLLM's chat extras
    echo: StrictBool = False  # the reply opens with the last message, when the assistant's
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template: StrictStr | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("messages")
    @classmethod
    def _cap_messages(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        return _check_count("messages", messages, MAX_MESSAGES)

    @field_validator("tools")
    @classmethod
    def _cap_tools(cls, tools: list[ChatTool] | None) -> list[ChatTool] | None:
        return _check_count("tools", tools, MAX_TOOLS)


class TokenizeRequest(_Strict):
    """POST /tokenize: a prompt, or chat messages rendered with the chat template."""

    # Exactly one of prompt and messages (checked by the route).
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False,
                              json_schema_extra={"oneOf": [{"required": ["prompt"]},
                                                           {"required": ["messages"]}]})
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = Field(None,
                                               json_schema_extra={"maxItems": MAX_MESSAGES})
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    return_token_strs: StrictBool = False

    @field_validator("messages")
    @classmethod
    def _cap_messages(cls, messages: list[ChatMessage] | None) -> list[ChatMessage] | None:
        return _check_count("messages", messages, MAX_MESSAGES)


class DetokenizeRequest(_Strict):
    model: StrictStr | None = None
    tokens: TokenIds


class LoadLoRAAdapterRequest(_Strict):
    """POST /v1/load_lora_adapter (vLLM's, with runtime LoRA updating allowed)."""

    lora_name: StrictStr
    lora_path: StrictStr


class UnloadLoRAAdapterRequest(_Strict):
    """POST /v1/unload_lora_adapter."""

    lora_name: StrictStr
    lora_int_id: StrictInt | None = None


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


# ------------------------------------------------------------------ responses
# What the endpoints answer, for /openapi.json. The handlers build dicts of this shape.

FinishReason = Literal["stop", "length", "abort", "error"]


class ErrorInfo(BaseModel):
    message: str
    type: str = Field(description="invalid_request_error, authentication_error or "
                                  "server_error")
    param: str | None = Field(description="the request field at fault, where one is")
    code: str | int | None = Field(description="a code such as model_not_found or "
                                               "context_length_exceeded, else the status")


class ErrorResponse(BaseModel):
    """OpenAI's error shape, for every 4xx and 5xx."""

    error: ErrorInfo


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # With --enable-prompt-tokens-details: the prompt tokens the prefix cache had.
    prompt_tokens_details: PromptTokensDetails | None = None


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None
    decoded_token: str | None


# vLLM's prompt_logprobs: per prompt position (null for the first), token id -> logprob.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy logprobs: per token its text, logprob, top alternatives and
    offset in the choice's text."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None = Field(
        description="the stop string or stop token id that ended the choice")
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None


class CompletionStreamResponse(BaseModel):
    """One event of a streamed completion (``data: {...}``); the stream ends with
    ``data: [DONE]``. With ``stream_options.include_usage`` a last event with no choices
    carries the usage."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="the arguments as a JSON string, as the model "
                                       "wrote them")


class ChatToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatCompletionMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ChatToolCall] = Field(default_factory=list)
    # With --reasoning-parser: the model's reasoning, under vLLM's name and its older one.
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprobWithTop(ChatTokenLogprob):
    top_logprobs: list[ChatTokenLogprob]


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprobWithTop] | None


ChatFinishReason = Literal["stop", "length", "tool_calls", "abort", "error"]


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatCompletionMessage
    logprobs: ChatChoiceLogprobs | None
    finish_reason: ChatFinishReason | None
    stop_reason: int | str | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A piece of a streamed tool call: the first carries its id, type and name, later
    ones pieces of its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None
    finish_reason: ChatFinishReason | None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    """One event of a streamed chat completion (``data: {...}``); the first of each
    choice carries the assistant role, and the stream ends with ``data: [DONE]``."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str | None
    parent: str | None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = Field(description="with return_token_strs: each "
                                                     "token's text")


class DetokenizeResponse(BaseModel):
    prompt: str
