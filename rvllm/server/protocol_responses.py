"""Request body and answer of OpenAI's Responses API (/v1/responses), the text parts of
it rvllm serves. Strict, as ``protocol``'s."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    field_validator,
)

from rvllm.sampling_params import SamplingParams, StructuredOutputsParams
from rvllm.server.protocol import (
    MAX_MESSAGES,
    MAX_TOOLS,
    ChatMessage,
    _check_count,
    _or,
    _Strict,
)


class ResponseInputText(_Strict):
    """A text part of a Responses input message."""

    type: Literal["input_text", "output_text", "text"]
    text: StrictStr
    annotations: list[Any] | None = None  # on output_text parts sent back; not read


class ResponseInputMessage(_Strict):
    """A message of a Responses request's ``input`` list."""

    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[ResponseInputText]
    id: StrictStr | None = None  # on output messages sent back; not read
    status: StrictStr | None = None


class ResponseFunctionCall(_Strict):
    """A function call of the model's, sent back in ``input``."""

    type: Literal["function_call"]
    call_id: StrictStr
    name: StrictStr
    arguments: StrictStr
    id: StrictStr | None = None
    status: StrictStr | None = None


class ResponseFunctionCallOutput(_Strict):
    """What a function call returned, in ``input``."""

    type: Literal["function_call_output"]
    call_id: StrictStr
    output: StrictStr
    id: StrictStr | None = None
    status: StrictStr | None = None


class ResponseFunctionTool(_Strict):
    """A function tool, in the Responses API's flat form."""

    type: Literal["function"]
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ResponseNamedTool(_Strict):
    """``tool_choice`` naming one function."""

    type: Literal["function"]
    name: StrictStr


class ResponseTextFormat(_Strict):
    """``text.format``: free text, any JSON object, or a named JSON schema."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False,
                              populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: StrictStr | None = None
    description: StrictStr | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None


class ResponseText(_Strict):
    format: ResponseTextFormat = Field(default_factory=ResponseTextFormat)


class ResponsesRequest(_Strict):
    """POST /v1/responses (OpenAI's Responses API): the text parts of it rvllm serves.
    ``input`` is a text (one user message) or a list of messages; ``instructions`` a
    system message before them."""

    model: StrictStr | None = None
    input: StrictStr | list[ResponseInputMessage | ResponseFunctionCall
                            | ResponseFunctionCallOutput] = Field(
        json_schema_extra={"maxItems": MAX_MESSAGES})
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: StrictBool = False
    text: ResponseText | None = None
    tools: list[ResponseFunctionTool] | None = Field(None,
                                                     json_schema_extra={"maxItems": MAX_TOOLS})
    tool_choice: Literal["none", "auto", "required"] | ResponseNamedTool | None = None
    previous_response_id: StrictStr | None = None
    background: StrictBool | None = None
    # Accepted and not acted on: rvllm keeps no responses, and reasons as the model does.
    store: StrictBool | None = None
    metadata: dict[str, Any] | None = None
    user: StrictStr | None = None
    parallel_tool_calls: StrictBool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: dict[str, Any] | None = None
    service_tier: StrictStr | None = None
    # vLLM's extras
    top_k: StrictInt | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: StrictInt | None = None
    priority: StrictInt = 0

    @field_validator("input")
    @classmethod
    def _cap_input(cls, value: Any) -> Any:
        return _check_count("input", value, MAX_MESSAGES, "items") if isinstance(
            value, list) else value

    def messages(self) -> list[ChatMessage]:
        """The conversation: ``instructions`` as a system message, then ``input``: its
        messages, its function calls as an assistant message's ``tool_calls`` (calls in a
        row together), and their outputs as tool messages."""
        out = []
        if self.instructions is not None:
            out.append(ChatMessage(role="system", content=self.instructions))
        items = ([ResponseInputMessage(role="user", content=self.input)]
                 if isinstance(self.input, str) else self.input)
        for item in items:
            if isinstance(item, ResponseFunctionCall):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = out[-1] if out else None
                if last is not None and last.role == "assistant" and last.tool_calls:
                    last.tool_calls.append(call)
                else:
                    out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
            elif isinstance(item, ResponseFunctionCallOutput):
                out.append(ChatMessage(role="tool", content=item.output,
                                       tool_call_id=item.call_id))
            else:
                text = (item.content if isinstance(item.content, str)
                        else "".join(part.text for part in item.content))
                out.append(ChatMessage(role=item.role, content=text))
        return out

    def chat_request(self) -> dict[str, Any]:
        """The chat completion request that asks the same: for tool calls, which the
        chat endpoint reads out of the model's text."""
        choice = self.tool_choice
        if isinstance(choice, ResponseNamedTool):
            choice = {"type": "function", "function": {"name": choice.name}}
        fields = {"model": self.model, "max_tokens": self.max_output_tokens,
                  "temperature": self.temperature, "top_p": self.top_p,
                  "top_k": self.top_k, "min_p": self.min_p,
                  "repetition_penalty": self.repetition_penalty, "seed": self.seed,
                  "priority": self.priority, "tool_choice": choice,
                  "parallel_tool_calls": self.parallel_tool_calls}
        body = {k: v for k, v in fields.items() if v is not None}
        body["messages"] = [m.model_dump(exclude_none=True) for m in self.messages()]
        body["tools"] = [{"type": "function", "function": t.model_dump(
            exclude_none=True, exclude={"type", "strict"})} for t in self.tools or []]
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type != "text":
            body["response_format"] = (
                {"type": "json_object"} if fmt.type == "json_object" else
                {"type": "json_schema", "json_schema": {
                    "name": fmt.name or "output", "schema": fmt.json_schema}})
        return body

    def sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        """SamplingParams for this request; ValueError names the field at fault."""
        defaults = defaults or {}
        max_tokens = self.max_output_tokens
        cap = defaults.get("max_tokens")
        if cap is not None:
            max_tokens = cap if max_tokens is None else min(max_tokens, cap)
        return SamplingParams(
            temperature=_or(self.temperature, defaults.get("temperature", 1.0)),
            top_p=_or(self.top_p, defaults.get("top_p", 1.0)),
            top_k=_or(self.top_k, defaults.get("top_k", 0)),
            min_p=_or(self.min_p, defaults.get("min_p", 0.0)),
            repetition_penalty=_or(self.repetition_penalty,
                                   defaults.get("repetition_penalty", 1.0)),
            seed=self.seed, max_tokens=max_tokens, priority=self.priority,
            structured_outputs=self._constraint())

    def _constraint(self) -> StructuredOutputsParams | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.json_schema is None:
            raise ValueError("text.format of type json_schema needs its schema.")
        return StructuredOutputsParams(json=fmt.json_schema)


class ResponseOutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]


class ResponseOutputMessage(BaseModel):
    type: Literal["message"]
    id: str
    role: Literal["assistant"]
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[ResponseOutputText]


class ResponseUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int


class ResponsesResponse(BaseModel):
    """A Responses API response (the fields rvllm fills; the request's settings are
    echoed beside them)."""

    id: str
    object: Literal["response"]
    created_at: int
    model: str
    status: Literal["in_progress", "completed", "incomplete"]
    incomplete_details: dict[str, str] | None
    output: list[ResponseOutputMessage]
    usage: ResponseUsage | None
