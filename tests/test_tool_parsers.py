"""Tool-call parsers (rvllm.server.tool_parsers): whole texts and streams.

Every hand-written model output is checked twice: with ``extract()`` against the expected
content and calls, and streamed in random fragments of 1 to 10 characters, whose result
must agree with ``extract()``. Content is compared "up to surrounding whitespace": the
stream's content fragments, joined and then stripped with ``str.strip()``, must equal
``extract()``'s content, or ``""`` where that is None. Arguments must agree exactly.
"""

import json
import random
import re

import pytest

from rvllm.server.tool_parsers import (
    TOOL_PARSERS,
    ExtractedToolCalls,
    StreamDelta,
    ToolCall,
    get_tool_parser,
    parse_tool_calls_json,
)

SEEDS = range(40)

# (text, expected content, expected calls as (name, arguments dict)).
HERMES = {
    "single": (
        'Let me check the weather.\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris", "unit": "celsius"}}\n</tool_call>',
        "Let me check the weather.",
        [("get_weather", {"city": "Paris", "unit": "celsius"})],
    ),
    "no_content": (
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        None,
        [("get_time", {})],
    ),
    "several_blocks": (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {"tz": "UTC"}}\n</tool_call>',
        None,
        [
            ("get_weather", {"city": "Paris"}),
            ("get_weather", {"city": "Tokyo"}),
            ("get_time", {"tz": "UTC"}),
        ],
    ),
    "smollm2_list": (
        '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {"tz": "CET"}}]</tool_call>',
        None,
        [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})],
    ),
    "parameters_synonym": (
        '<tool_call>{"name": "search", "parameters": {"q": "rvllm"}}</tool_call>',
        None,
        [("search", {"q": "rvllm"})],
    ),
    "tricky_strings": (
        'Running code.\n<tool_call>\n{"name": "run", "arguments": {"code": '
        '"if (x) { y[0] = \\"}\\"; } // </tool_call> \\\\", "re": "[\\\\]{}]", '
        '"q": "\\\\\\"", "empty": ""}}\n</tool_call>',
        "Running code.",
        [("run", {"code": 'if (x) { y[0] = "}"; } // </tool_call> \\', "re": "[\\]{}]",
                  "q": '\\"', "empty": ""})],
    ),
    "unicode": (
        'Voilà ☀️\n<tool_call>\n{"name": "météo", "arguments": {"ville": "Zürich", '
        '"city": "東京", "emoji": "🌧️", "escaped": "\\u00e9\\ud83d\\ude00"}}\n</tool_call>',
        "Voilà ☀️",
        [("météo", {"ville": "Zürich", "city": "東京", "emoji": "🌧️", "escaped": "é😀"})],
    ),
    "nested_and_spacing": (
        '<tool_call>\n{ "name" : "book",\n  "arguments" : { "who" :[ {"n":"A","age":3},'
        '{"n":"B","tags":[[], {}, [1, 2.5e3, -1, true, false, null]]} ] ,"opt":{"a":{"b":{}}} }'
        ' }\n</tool_call>',
        None,
        [("book", {"who": [{"n": "A", "age": 3},
                           {"n": "B", "tags": [[], {}, [1, 2500.0, -1, True, False, None]]}],
                   "opt": {"a": {"b": {}}}})],
    ),
    "arguments_before_name": (
        '<tool_call>{"arguments": {"x": [1, 2]}, "name": "plot", "id": 7}</tool_call>',
        None,
        [("plot", {"x": [1, 2]})],
    ),
    "no_arguments": (
        '<tool_call>{"name": "list_files"}</tool_call>',
        None,
        [("list_files", {})],
    ),
    "missing_close_tag": (
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n',
        "Sure.",
        [("get_weather", {"city": "Rome"})],
    ),
    "text_between_and_after": (
        'First:\n<tool_call>{"name": "a", "arguments": {}}</tool_call> then '
        '<tool_call>{"name": "b", "arguments": {"k": 1}}</tool_call>\nDone.',
        "First:\n then \nDone.",
        [("a", {}), ("b", {"k": 1})],
    ),
    "no_call": (
        "The capital of France is Paris. Use <b>bold</b> or a <tool> tag {x}.\n",
        "The capital of France is Paris. Use <b>bold</b> or a <tool> tag {x}.",
        [],
    ),
    "not_json": (
        "Hello\n<tool_call>\nget_weather(city='Paris')\n</tool_call>",
        "Hello\n<tool_call>\nget_weather(city='Paris')\n</tool_call>",
        [],
    ),
    "unquoted_key": (
        '<tool_call>{name: "f", "arguments": {}}</tool_call> after',
        '<tool_call>{name: "f", "arguments": {}}</tool_call> after',
        [],
    ),
    "object_without_name": (
        'x <tool_call>{"arguments": {"a": 1}}</tool_call>',
        'x <tool_call>{"arguments": {"a": 1}}</tool_call>',
        [],
    ),
}

# Invalid after the name is complete: extract() gives no calls; a stream has already sent
# the call, so these are checked with extract() only (and that streaming does not crash).
HERMES_LATE_INVALID = {
    "trailing_comma": '<tool_call>\n{"name": "f", "arguments": {"a": 1,}}\n</tool_call>',
    "string_arguments": '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
    "truncated": 'Wait.\n<tool_call>\n{"name": "f", "arguments": {"a": "unfinish',
    "junk_after_json": '<tool_call>{"name": "f", "arguments": {}} oops</tool_call>',
}

LLAMA = {
    "single": (
        '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}',
        None,
        [("get_weather", {"city": "Paris", "days": 3})],
    ),
    "python_tag": (
        '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Oslo"}}',
        None,
        [("get_weather", {"city": "Oslo"})],
    ),
    "several": (
        '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": '
        '{"y": [2, "; }"]}};{"name": "c", "parameters": {}}',
        None,
        [("a", {"x": 1}), ("b", {"y": [2, "; }"]}), ("c", {})],
    ),
    "leading_whitespace_type_key": (
        '\n  {"type": "function", "name": "lookup", "parameters": {"q": "naïve \\"x\\" {"}}\n',
        None,
        [("lookup", {"q": 'naïve "x" {'})],
    ),
    "trailing_semicolon": (
        '{"name": "ping", "parameters": {}};',
        None,
        [("ping", {})],
    ),
    "no_call": (
        "The set {1, 2} has two elements; <|python_tag|> is a token.",
        "The set {1, 2} has two elements; <|python_tag|> is a token.",
        [],
    ),
    "almost_tag": (
        "<|python not a tag",
        "<|python not a tag",
        [],
    ),
    "json_not_a_call": (
        '{"answer": 42, "items": [1, 2]}',
        '{"answer": 42, "items": [1, 2]}',
        [],
    ),
    "invalid_json": (
        '{"name" "f", "parameters": {}}',
        '{"name" "f", "parameters": {}}',
        [],
    ),
    "builtin_tool_syntax": (
        '<|python_tag|>brave_search.call(query="weather")',
        '<|python_tag|>brave_search.call(query="weather")',
        [],
    ),
}

LLAMA_LATE_INVALID = {
    "trailing_text": '{"name": "f", "parameters": {"a": 1}} and more',
    "bad_arguments": '{"name": "f", "parameters": {"a": }}',
}

MISTRAL = {
    "v03_single": (
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        None,
        [("get_weather", {"city": "Paris"})],
    ),
    "v03_several_with_content": (
        'I will look both up.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": '
        '"Paris"}}, {"name": "get_time", "arguments": {"tz": "[TOOL_CALLS] {]"}}]',
        "I will look both up.",
        [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "[TOOL_CALLS] {]"})],
    ),
    "v03_with_id_key": (
        '[TOOL_CALLS][{"name": "f", "arguments": {"n": 1}, "id": "abcdefghi"}]',
        None,
        [("f", {"n": 1})],
    ),
    "new_form": (
        'Sure![TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "nested": {"a": [1, {"b": '
        '"}"}]}}',
        "Sure!",
        [("get_weather", {"city": "Paris", "nested": {"a": [1, {"b": "}"}]}})],
    ),
    "new_form_repeated": (
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]'
        '{"tz": "\\"UTC\\""}',
        None,
        [("get_weather", {"city": "Paris"}), ("get_time", {"tz": '"UTC"'})],
    ),
    "new_form_no_args": (
        "[TOOL_CALLS]list_files[ARGS]{}",
        None,
        [("list_files", {})],
    ),
    "no_call": (
        "Paris is the capital of France. [TOOL] [ARGS] {}",
        "Paris is the capital of France. [TOOL] [ARGS] {}",
        [],
    ),
    "invalid_json": (
        "[TOOL_CALLS][get_weather(city='Paris')]",
        "[TOOL_CALLS][get_weather(city='Paris')]",
        [],
    ),
    "bad_name": (
        'x [TOOL_CALLS]get weather[ARGS]{"a": 1}',
        'x [TOOL_CALLS]get weather[ARGS]{"a": 1}',
        [],
    ),
}

MISTRAL_LATE_INVALID = {
    "bad_arguments": '[TOOL_CALLS]f[ARGS]{"a": tru}',
    "truncated": '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}',
}

CASES = [
    (parser, key, *case)
    for parser, cases in (("hermes", HERMES), ("llama3_json", LLAMA), ("mistral", MISTRAL))
    for key, case in cases.items()
]
LATE_INVALID = [
    (parser, key, text)
    for parser, cases in (
        ("hermes", HERMES_LATE_INVALID),
        ("llama3_json", LLAMA_LATE_INVALID),
        ("mistral", MISTRAL_LATE_INVALID),
    )
    for key, text in cases.items()
]
IDS = {
    "hermes": re.compile(r"call_[0-9a-f]{24}"),
    "llama3_json": re.compile(r"call_[0-9a-f]{24}"),
    "mistral": re.compile(r"[A-Za-z0-9]{9}"),
}


def _split(text: str, rng: random.Random) -> list[str]:
    pieces = []
    pos = 0
    while pos < len(text):
        size = rng.randint(1, 10)
        pieces.append(text[pos:pos + size])
        pos += size
    return pieces


def _stream(parser_name: str, pieces: list[str]):
    """Streams the pieces; returns (joined content, per-call [id, name, args], stream)."""
    stream = get_tool_parser(parser_name).start_stream()
    deltas = [stream.feed(piece) for piece in pieces] + [stream.finish()]
    content = "".join(delta.content for delta in deltas)
    calls: list[list] = []
    for delta in deltas:
        assert isinstance(delta, StreamDelta)
        for part in delta.tool_calls:
            if part.index == len(calls):  # a new call: its first delta carries id and name
                assert part.id is not None and part.name is not None
                calls.append([part.id, part.name, part.arguments])
            else:
                assert part.index == len(calls) - 1, "deltas arrive call after call"
                assert part.id is None and part.name is None
                calls[part.index][2] += part.arguments
    return content, calls, stream


@pytest.mark.parametrize(("parser", "key", "text", "content", "expected"), CASES,
                         ids=[f"{case[0]}-{case[1]}" for case in CASES])
def test_extract(parser, key, text, content, expected):
    result = get_tool_parser(parser).extract(text)
    assert isinstance(result, ExtractedToolCalls)
    assert result.content == content
    assert [(call.name, json.loads(call.arguments)) for call in result.tool_calls] == expected
    for call in result.tool_calls:
        assert isinstance(call, ToolCall)
        assert IDS[parser].fullmatch(call.id)
        # The arguments are the model's own text, not a re-serialisation.
        assert call.arguments == "{}" or call.arguments in text
    assert len({call.id for call in result.tool_calls}) == len(result.tool_calls)


@pytest.mark.parametrize(("parser", "key", "text", "content", "expected"), CASES,
                         ids=[f"{case[0]}-{case[1]}" for case in CASES])
def test_stream_matches_extract(parser, key, text, content, expected):
    whole = get_tool_parser(parser).extract(text)
    for seed in SEEDS:
        rng = random.Random(seed)
        streamed, calls, stream = _stream(parser, _split(text, rng))
        assert streamed.strip() == (whole.content or ""), seed
        assert [name for _, name, _ in calls] == [call.name for call in whole.tool_calls]
        assert [args for _, _, args in calls] == [call.arguments for call in whole.tool_calls]
        assert [json.loads(args) for _, _, args in calls] == [args for _, args in expected]
        assert [(call.id, call.name, call.arguments) for call in stream.tool_calls] == [
            tuple(call) for call in calls
        ]
        for call_id, _, _ in calls:
            assert IDS[parser].fullmatch(call_id)


@pytest.mark.parametrize(("parser", "key", "text"), LATE_INVALID,
                         ids=[f"{case[0]}-{case[1]}" for case in LATE_INVALID])
def test_late_invalid(parser, key, text):
    result = get_tool_parser(parser).extract(text)
    assert result.tool_calls == []
    assert result.content == text.strip()
    for seed in range(5):
        _stream(parser, _split(text, random.Random(seed)))  # best effort, must not fail


@pytest.mark.parametrize("text", [
    "Hello, world!\n\n  How are you?  \n",
    "  leading spaces and a < sign and [brackets] and {braces}\n",
    "",
])
@pytest.mark.parametrize("parser", ["hermes", "mistral", "llama3_json"])
def test_plain_text_streams_unchanged(parser, text):
    for seed in range(10):
        streamed, calls, _ = _stream(parser, _split(text, random.Random(seed)))
        assert streamed == text
        assert calls == []


def test_hermes_stream_timing():
    stream = get_tool_parser("hermes").start_stream()
    assert stream.feed("Checking <tool_").content == "Checking"  # marker start held back
    delta = stream.feed('call>\n{"name": "get_wea')
    assert delta == StreamDelta()
    delta = stream.feed('ther"')  # the name is complete: first delta at once
    assert [(d.index, d.name, d.arguments) for d in delta.tool_calls] == [(0, "get_weather", "")]
    assert delta.tool_calls[0].id == stream.tool_calls[0].id
    delta = stream.feed(', "arguments": {"city": "Pa')
    assert [(d.index, d.id, d.name, d.arguments) for d in delta.tool_calls] == [
        (0, None, None, '{"city": "Pa')
    ]
    delta = stream.feed('ris"}}\n</tool_call>\nAnd')
    assert delta.tool_calls[0].arguments == 'ris"}'  # nothing past the closing brace
    # Whitespace held after "Checking" goes out once text follows, as in extract()'s content.
    assert delta.content == " \nAnd"
    assert stream.finish() == StreamDelta()
    assert stream.tool_calls[0].arguments == '{"city": "Paris"}'


def test_hermes_stream_invalid_block_becomes_content():
    text = "Hi <tool_call>\nnot json\n</tool_call> bye"
    streamed, calls, _ = _stream("hermes", list(text))
    assert streamed == text
    assert calls == []


def test_mistral_call_id_form():
    text = '[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris"}'
    result = get_tool_parser("mistral").extract(text)
    assert [(c.id, c.name, c.arguments) for c in result.tool_calls] == [
        ("a1B2c3D4e", "get_weather", '{"city": "Paris"}')
    ]
    for seed in range(10):
        _, calls, _ = _stream("mistral", _split(text, random.Random(seed)))
        assert calls == [["a1B2c3D4e", "get_weather", '{"city": "Paris"}']]


def test_fresh_state_per_stream():
    parser = get_tool_parser("hermes")
    first, second = parser.start_stream(), parser.start_stream()
    first.feed('<tool_call>{"name": "a", "arguments": {}}</tool_call>')
    assert second.feed("plain").content == "plain"
    assert [call.name for call in first.tool_calls] == ["a"]
    assert second.tool_calls == []


def test_get_tool_parser():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral"}
    for name, cls in TOOL_PARSERS.items():
        parser = get_tool_parser(name)
        assert isinstance(parser, cls) and parser.name == name
    with pytest.raises(ValueError, match="hermes.*llama3_json.*mistral"):
        get_tool_parser("nope")


def test_parse_tool_calls_json():
    text = ('[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
            '{"name": "get_time", "arguments": {"tz": "]}"}}]')
    calls = parse_tool_calls_json(text)
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "]}"}')
    ]
    assert all(IDS["hermes"].fullmatch(c.id) for c in calls)
    assert parse_tool_calls_json("  []  ") == []
    for bad in [
        "",
        "not json",
        '{"name": "f", "parameters": {}}',
        '[{"name": "f", "parameters": {}}',
        '[{"name": 3, "parameters": {}}]',
        '[{"name": "f", "parameters": [1]}]',
        '[{"parameters": {}}]',
        '["f"]',
        '[{"name": "f", "parameters": {}}] trailing',
    ]:
        assert parse_tool_calls_json(bad) is None, bad
