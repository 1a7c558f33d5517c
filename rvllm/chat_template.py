"""Chat templates rendered with jinja2 the way transformers renders them."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

# transformers' marker for continue_final_message: appended to the final message so the cut
# point can be found after rendering.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def render_chat_template(template: str, messages: list[dict], *, add_generation_prompt: bool,
                         continue_final_message: bool, tools: list[dict] | None,
                         variables: dict[str, Any]) -> str:
    """Render ``messages`` with ``template``; ``variables`` become template globals (the
    special tokens and any extra keyword arguments)."""
    # Templates fail or print "None" on None-valued keys but handle missing ones.
    messages = _alias_reasoning([{k: v for k, v in m.items() if v is not None}
                                 for m in messages])
    final_text = None
    if continue_final_message:
        final_text = _tag_final_message(messages, template)
    variables = dict(variables)
    variables.setdefault("documents", None)
    rendered = _compile_template(template).render(
        messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
        **variables)
    return rendered if final_text is None else _cut_after_final(rendered, final_text)


def _alias_reasoning(messages: list[dict]) -> list[dict]:
    # Templates read a message's reasoning under different names; offer it under each.
    for i, message in enumerate(messages):
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None),
                         None)
        if reasoning is not None:
            messages[i] = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return messages


def _tag_final_message(messages: list[dict], template: str) -> str:
    """Mark the end of the last message's text in place; return that text."""
    final = messages[-1]
    content = final.get("content")
    if content is None:
        raise ValueError("continue_final_message is set but the final message has no content")
    if "content" not in template:
        raise ValueError("continue_final_message is set but the chat template never reads "
                         "'content'")
    if isinstance(content, str):
        final["content"] = content + _CONTINUE_TAG
        return content
    blocks = [dict(block) for block in content]
    for block in reversed(blocks):
        if "text" in block:
            text = block["text"]
            block["text"] = text + _CONTINUE_TAG
            final["content"] = blocks
            return text
    raise ValueError("continue_final_message is set but the final message has no text block")


def _cut_after_final(rendered: str, final_text: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final_text.strip() not in rendered or tag not in rendered:
        raise ValueError("continue_final_message is set but the chat template dropped part of "
                         f"the final message {final_text.strip()!r}")
    cut = rendered.rindex(tag)
    if rendered.startswith(_CONTINUE_TAG, cut):
        return rendered[:cut]
    # The template trimmed the message, so the space we added went too.
    return rendered[:cut].rstrip()


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (marks assistant text for training masks):
    rendered as its plain body, since serving never needs the mask."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class _TemplateDict:
    # Templates may build dicts, but must not reach the real class (type tricks, subclasses).
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict:
        return dict.fromkeys(*args)


class _TemplateNamespace(jinja2.utils.Namespace):
    # Underscore attributes on a namespace are a path to CPython internals; refuse them.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        # Namespace hides its own attributes, so reach _check through the class.
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore attributes on a namespace ({name!r})")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters and sorts keys; chat templates expect neither.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


@lru_cache(maxsize=1)
def _template_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    version = tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit())
    if version < (3, 1, 6):  # older versions have known sandbox escapes
        raise ImportError(f"chat templates need jinja2>=3.1.6, found {jinja2.__version__}")
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals |= {"raise_exception": _raise_exception, "strftime_now": _strftime_now,
                    "dict": _TemplateDict(), "namespace": _TemplateNamespace}
    return env


@lru_cache(maxsize=32)
def _compile_template(template: str) -> jinja2.Template:
    return _template_environment().from_string(template)
