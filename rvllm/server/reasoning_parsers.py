"""Reasoning parsers (``--reasoning-parser``): split a reasoning model's generated text into
its reasoning, the ``<think>...</think>`` part, and the content after it, as vLLM's
``reasoning`` (and older ``reasoning_content``) field and ``content``.

Where the reasoning starts depends on the prompt: a chat template may open the ``<think>``
block itself (DeepSeek-R1's, the Qwen3 thinking models'), so that the output starts inside
it, or close an empty one (Qwen3 with ``enable_thinking: false``), so that the output is
all content. A parser looks at the end of the rendered prompt for the last marker:

``deepseek_r1``
    The output is reasoning up to ``</think>``, unless the prompt closed the block; a
    leading ``<think>`` in the output is dropped. Without ``</think>`` (a length cut) it
    is all reasoning.
``qwen3``
    The output is reasoning up to ``</think>`` if the prompt left a ``<think>`` open or
    the output opens with ``<think>``; otherwise it is all content.

Everything after ``</think>`` is content (tool calls are then read out of it); a
constrained request's grammar starts there too (``may_think``,
``StructuredOutputsParams.starts_after``) unless the prompt closed the block. Text is kept
as the model wrote it; an empty part is None. A stream (:meth:`ReasoningParser.start_stream`)
sends each part as it comes, holding back only what could still be a marker, and what it
sends adds up to :meth:`ReasoningParser.extract`'s result for the same text.
"""

from __future__ import annotations

from rvllm.server.tool_parsers.stream import partial_marker_len

THINK_START = "<think>"
THINK_END = "</think>"

# Where a stream stands: before the output has shown whether it opens a block, inside the
# reasoning, or in the content.
_UNDECIDED, _REASONING, _CONTENT = range(3)


class ReasoningStream:
    """One choice's text, chunk by chunk, into (reasoning, content) pieces; then
    :meth:`finish`."""

    def __init__(self, state: int) -> None:
        self._state = state
        self._at_start = True  # nothing of the output taken yet
        self._held = ""

    def feed(self, delta: str) -> tuple[str, str]:
        """The next chunk of generated text; returns the (reasoning, content) it makes
        ready to send."""
        return self._run(self._held + delta, final=False)

    def finish(self) -> tuple[str, str]:
        """The end of the generation: whatever was held back."""
        held, self._held = self._held, ""
        return self._run(held, final=True)

    def _run(self, text: str, final: bool) -> tuple[str, str]:
        self._held = ""
        if self._at_start and self._state != _CONTENT:
            opened = text.lstrip()
            if opened.startswith(THINK_START):
                text = opened[len(THINK_START):]
                self._state = _REASONING
            elif THINK_START.startswith(opened) and not final:
                self._held = text  # whitespace, or the start of "<think>": wait
                return "", ""
            elif self._state == _UNDECIDED:
                self._state = _CONTENT
            self._at_start = False
        if self._state == _CONTENT:
            return "", text
        end = text.find(THINK_END)
        if end >= 0:
            self._state = _CONTENT
            return text[:end], text[end + len(THINK_END):]
        keep = 0 if final else partial_marker_len(text, 0, THINK_END)
        self._held = text[len(text) - keep:]
        return text[:len(text) - keep], ""


class ReasoningParser:
    """One family's reasoning format; ``prompt_tail`` is the end of the rendered prompt
    (the chat template's generation prompt)."""

    name = ""

    def start_stream(self, prompt_tail: str) -> ReasoningStream:
        """Fresh streaming state, one per choice."""
        return ReasoningStream(self._first_state(_prompt_block(prompt_tail)))

    def may_think(self, prompt_tail: str) -> bool:
        """Whether the output may open (or continue) a block: the prompt has not closed
        one. A constrained request's grammar then starts after the output's </think>."""
        return _prompt_block(prompt_tail) != THINK_END

    def extract(self, text: str, prompt_tail: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole generated text; an empty part is None."""
        stream = self.start_stream(prompt_tail)
        reasoning, content = stream.feed(text)
        more_reasoning, more_content = stream.finish()
        return (reasoning + more_reasoning) or None, (content + more_content) or None

    def _first_state(self, block: str | None) -> int:
        raise NotImplementedError


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"

    def _first_state(self, block: str | None) -> int:
        return _UNDECIDED if block == THINK_END else _REASONING


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"

    def _first_state(self, block: str | None) -> int:
        return _REASONING if block == THINK_START else _UNDECIDED


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """A parser by its name (a key of :data:`REASONING_PARSERS`)."""
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        known = ", ".join(sorted(REASONING_PARSERS))
        raise ValueError(f"unknown reasoning parser {name!r}; known parsers: {known}") from None


def _prompt_block(prompt_tail: str) -> str | None:
    """The last of the two markers in the prompt's tail: THINK_START where it leaves a
    block open, THINK_END where it closed one, None where it has neither."""
    start, end = prompt_tail.rfind(THINK_START), prompt_tail.rfind(THINK_END)
    if start < 0 and end < 0:
        return None
    return THINK_START if start > end else THINK_END

