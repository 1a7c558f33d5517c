"""What a request's prompt may be: text, token ids, or a dict holding either
(``{"prompt": ...}`` or ``{"prompt_token_ids": [...]}``), as in vLLM."""

from __future__ import annotations

from typing import Any

PromptType = str | list[int] | dict[str, Any]
