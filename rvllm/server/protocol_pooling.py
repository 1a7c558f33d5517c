"""Request bodies and answers of a pooling model's endpoints: /v1/embeddings (OpenAI's
fields and vLLM's extras), and vLLM's /score and /rerank. Strict, as ``protocol``'s."""

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

from rvllm.pooling_params import PoolingParams
from rvllm.server.protocol import (
    MAX_MESSAGES,
    MAX_PROMPTS,
    ChatMessage,
    TokenIds,
    UsageInfo,
    _cap_prompt_list,
    _check_count,
    _prompt_list,
    _prompt_schema,
    _Strict,
)


class EmbeddingRequest(_Strict):
    """POST /v1/embeddings (OpenAI's fields, and vLLM's ``truncate_prompt_tokens``,
    ``add_special_tokens`` and ``normalize``). Instead of ``input``, vLLM's chat form:
    ``messages`` rendered with the chat template (``add_generation_prompt``,
    ``continue_final_message``, ``chat_template``, ``chat_template_kwargs``), one vector."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False,
                              json_schema_extra={"oneOf": [{"required": ["input"]},
                                                           {"required": ["messages"]}]})
    model: StrictStr | None = None
    input: StrictStr | list[StrictStr] | TokenIds | list[TokenIds] | None = Field(
        None, json_schema_extra=_prompt_schema)
    messages: list[ChatMessage] | None = Field(None,
                                               json_schema_extra={"maxItems": MAX_MESSAGES})
    add_generation_prompt: StrictBool = False
    continue_final_message: StrictBool = False
    chat_template: StrictStr | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: StrictStr | None = None
    truncate_prompt_tokens: StrictInt | None = None
    add_special_tokens: StrictBool = True
    normalize: StrictBool | None = None

    @field_validator("input")
    @classmethod
    def _cap_inputs(cls, value: Any) -> Any:
        return _cap_prompt_list("input", value)

    @field_validator("messages")
    @classmethod
    def _cap_messages(cls, messages: list[ChatMessage] | None) -> list[ChatMessage] | None:
        return _check_count("messages", messages, MAX_MESSAGES)

    def prompts(self) -> list[str | list[int]]:
        return [] if self.input is None else _prompt_list(self.input)

    def pooling_params(self) -> PoolingParams:
        return PoolingParams(truncate_prompt_tokens=self.truncate_prompt_tokens,
                             dimensions=self.dimensions, normalize=self.normalize)


class ScoreRequest(_Strict):
    """POST /score and /v1/score (vLLM's): ``text_1`` (one text, or a list) scored
    against ``text_2`` (one text, or a list as long)."""

    model: StrictStr | None = None
    text_1: StrictStr | list[StrictStr] = Field(json_schema_extra={"maxItems": MAX_PROMPTS})
    text_2: StrictStr | list[StrictStr] = Field(json_schema_extra={"maxItems": MAX_PROMPTS})
    truncate_prompt_tokens: StrictInt | None = None
    user: StrictStr | None = None

    @field_validator("text_1", "text_2")
    @classmethod
    def _cap_texts(cls, value: Any, info: ValidationInfo) -> Any:
        return _cap_prompt_list(str(info.field_name), value)


class RerankRequest(_Strict):
    """POST /rerank, /v1/rerank and /v2/rerank (Jina's and Cohere's shape, as vLLM has
    it): ``documents`` ranked by their score against ``query``, the best ``top_n``."""

    model: StrictStr | None = None
    query: StrictStr
    documents: list[StrictStr] = Field(json_schema_extra={"maxItems": MAX_PROMPTS})
    top_n: StrictInt | None = None
    truncate_prompt_tokens: StrictInt | None = None
    user: StrictStr | None = None

    @field_validator("documents")
    @classmethod
    def _cap_documents(cls, value: list[str]) -> list[str]:
        return _check_count("documents", value, MAX_PROMPTS, "documents")


class EmbeddingData(BaseModel):
    index: int
    object: Literal["embedding"]
    embedding: list[float] | str = Field(description="the vector, or with encoding_format "
                                                     "base64 its little-endian float32 "
                                                     "bytes in base64")


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo


class ScoreData(BaseModel):
    index: int
    object: Literal["score"]
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"]
    created: int
    model: str
    data: list[ScoreData]
    usage: UsageInfo


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int = Field(description="the document's place in the request's list")
    document: RerankDocument
    relevance_score: float


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult] = Field(description="best first")
