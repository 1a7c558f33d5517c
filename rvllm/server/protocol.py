"""Request bodies of the OpenAI API (and vLLM's extra sampling fields), validated strictly.

Types are strict (``"5"`` is not a number), unknown fields are refused the way
OpenAI refuses them, and range checks are SamplingParams' own, so the limits
live in one place.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from rvllm.sampling_params import SamplingParams, StructuredOutputsParams

TokenIds = list[StrictInt]


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
    n: StrictInt = 1
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: StrictStr | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    # vLLM's extra sampling fields
    top_k: StrictInt | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = 0
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    prompt_logprobs: StrictInt | None = None
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

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None) -> SamplingParams:
        """SamplingParams for this request; ValueError names the field out of range."""
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
            repetition_penalty=_or(self.repetition_penalty, 1.0),
            temperature=_or(self.temperature, 1.0),
            top_p=_or(self.top_p, 1.0),
            top_k=_or(self.top_k, 0),
            min_p=_or(self.min_p, 0.0),
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
            structured_outputs=self.structured_outputs_params(),
        )

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

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(SamplingRequest):
    prompt: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    max_tokens: StrictInt | None = 16
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids)."""
        p = self.prompt
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
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool | None = None
    # vLLM's chat extras
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template: StrictStr | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(_Strict):
    """POST /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    return_token_strs: StrictBool = False


class DetokenizeRequest(_Strict):
    model: StrictStr | None = None
    tokens: TokenIds


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value
