"""Tool-call parsing (api/tool_calls) on fixed model texts of each family, finished and
streamed, and the tool_choice rules, without a service. The texts are what the families'
chat templates teach their models to write (vLLM's parsers read the same)."""

from __future__ import annotations

import json

import pytest

from api.tool_calls import parsers
from api.tool_calls.choice import ToolPlan, plan
from api.tool_calls.deltas import OutputDeltas
from api.tool_calls.schemas import NamedToolChoice, Tool

WEATHER = {"city": "Paris", "unit": "celsius", "note": "a \"quoted\" } brace, [ and \\ backslash", "dir": "C:\\"}
WEATHER_TEXT = json.dumps(WEATHER)

# (parser, model text, content, [(name, arguments)])
FAMILIES = [
    ("hermes", f'Let me look.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER_TEXT}}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     "Let me look.\n", [("get_weather", WEATHER_TEXT), ("get_time", "{}")]),
    ("hermes", "No tool needed: 4 < 5.", "No tool needed: 4 < 5.", []),
    ("llama3_json", f'{{"name": "get_weather", "parameters": {WEATHER_TEXT}}}', None, [("get_weather", WEATHER_TEXT)]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {"y": [2]}}',
     None, [("a", '{"x": 1}'), ("b", '{"y": [2]}')]),
    ("llama3_json", "It is {sunny} today.", "It is {sunny} today.", []),
    ("mistral", f'Checking.[TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER_TEXT}}}, '
                '{"name": "get_time", "arguments": {"zone": "UTC"}}]',
     "Checking.", [("get_weather", WEATHER_TEXT), ("get_time", '{"zone": "UTC"}')]),
    ("mistral", f'[TOOL_CALLS]get_weather[ARGS]{WEATHER_TEXT}[TOOL_CALLS]get_time{{"zone": "CET"}}',
     None, [("get_weather", WEATHER_TEXT), ("get_time", '{"zone": "CET"}')]),
]


def auto(parser: str) -> ToolPlan:
    return plan([Tool.model_validate({"type": "function", "function": {"name": "f"}})], "auto", parser)


def streamed(tool_plan: ToolPlan, text: str, step: int) -> tuple[str | None, list[dict], str | None]:
    """The text fed `step` characters at a time, its deltas put together as an OpenAI client does."""
    output = OutputDeltas(tool_plan, "job-1:0")
    content, calls = None, []
    pieces = [text[i:i + step] for i in range(0, len(text), step)]
    for number, piece in enumerate(pieces, 1):
        delta = output.delta(piece, final=number == len(pieces))
        if "content" in delta:
            content = (content or "") + delta["content"]
        for call in delta.get("tool_calls", []):
            if call["index"] == len(calls):
                assert call["id"] and call["type"] == "function" and call["function"]["name"]
                calls.append({"id": call["id"], "name": call["function"]["name"], "arguments": ""})
            assert set(call) <= {"index", "id", "type", "function"}
            calls[call["index"]]["arguments"] += call["function"].get("arguments", "")
    return content, calls, output.finish_reason("stop")


@pytest.mark.parametrize("parser, text, content, calls", FAMILIES)
def test_each_family_finished_and_streamed_in_any_pieces(parser, text, content, calls):
    tool_plan = auto(parser)
    message, finish_reason = tool_plan.message(text, "stop", "job-1:0")
    assert message["content"] == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])] == calls
    assert finish_reason == ("tool_calls" if calls else "stop")
    for step in (1, 3, 7, len(text)):
        streamed_content, streamed_calls, streamed_finish = streamed(tool_plan, text, step)
        assert (streamed_content, [(c["name"], c["arguments"]) for c in streamed_calls]) == (content, calls), step
        assert streamed_finish == finish_reason
        # A stream and a whole answer of one output name its calls alike.
        assert [c["id"] for c in streamed_calls] == [c["id"] for c in message.get("tool_calls", [])]


def test_a_marker_split_across_pieces_never_leaks_into_content():
    tool_plan = auto("hermes")
    output = OutputDeltas(tool_plan, "job-1:0")
    assert output.delta("Sure<tool_", final=False) == {"content": "Sure"}
    assert output.delta("cal", final=False) == {}
    (call,) = output.delta('l>{"name": "f", "arguments": {"a"', final=False)["tool_calls"]
    assert call["function"] == {"name": "f", "arguments": '{"a"'} and call["id"].startswith("chatcmpl-tool-")
    assert output.delta(": 1}}</tool_call>", final=True) == {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}
    # Text that only looked like a marker's start is content once it cannot be one.
    assert OutputDeltas(tool_plan, "job-1:0").delta("a <tool", final=True) == {"content": "a <tool"}


@pytest.mark.parametrize("parser, text", [
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": }</tool_call>'),  # not JSON
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1'),  # cut off (finish_reason length)
    ("llama3_json", '{"parameters": {"a": 1}}'),  # no name
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": [1, 2]}]'),  # arguments not an object
    # Nested past Python's stack (json.loads raised RecursionError: a 500).
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": ' + "[" * 5000 + "]" * 5000 + "}}</tool_call>"),
])
def test_malformed_calls_leave_the_whole_text_as_content_as_vllm(parser, text):
    message, finish_reason = auto(parser).message(text, "length", "job-1:0")
    assert message == {"role": "assistant", "content": text} and finish_reason == "length"


def test_an_assistant_turns_arguments_nested_too_deep_are_refused_naming_them():
    """A request's earlier tool call with arguments nested 3,000 deep: json.loads raised a
    RecursionError (a 500, the connection dropped); now a 4xx naming the field."""
    from pydantic import ValidationError

    from api.tool_calls.schemas import ToolCall

    with pytest.raises(ValidationError, match="function.arguments") as caught:
        ToolCall.model_validate({"id": "c1", "type": "function",
                                 "function": {"name": "f", "arguments": "[" * 3000 + "]" * 3000}})
    assert "nests deeper than 64 levels" in str(caught.value)


def test_forced_shapes_named_and_required():
    named = parsers.named("get_time")
    assert named('{"zone": "UTC"}', True).calls[0].arguments == '{"zone": "UTC"}'
    text = '[{"name": "a", "parameters": {"x": "]"}}, {"name": "b", "parameters": {}}]'
    assert [(c.name, c.arguments) for c in parsers.required(text, True).calls] == [("a", '{"x": "]"}'), ("b", "{}")]
    # Partway: the first call's arguments so far, the second not named yet.
    partial = parsers.required(text[:text.index('"b"')], False).calls
    assert [(c.name, c.arguments) for c in partial] == [("a", '{"x": "]"}'), (None, "")]


def tools(*specs: dict) -> list[Tool]:
    return [Tool.model_validate({"type": "function", "function": spec}) for spec in specs]


def test_required_schema_is_vllms_array_of_calls_with_defs_gathered():
    place = {"type": "object", "properties": {"at": {"$ref": "#/$defs/Place"}},
             "$defs": {"Place": {"type": "string", "enum": ["home", "work"]}}}
    forced = plan(tools({"name": "go", "parameters": place}, {"name": "stop"}), "required", None)
    schema = forced.sampling_overrides["structured_outputs"].json_schema
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["$defs"] == place["$defs"]
    go, stop = schema["items"]["anyOf"]
    assert go["properties"]["name"] == {"type": "string", "enum": ["go"]} and "$defs" not in go["properties"]["parameters"]
    assert stop["properties"]["parameters"] == {"type": "object", "properties": {}}  # no parameters: an empty object
    assert go["required"] == ["name", "parameters"]
    clash = {**place, "$defs": {"Place": {"type": "integer"}}}
    with pytest.raises(ValueError, match=r"^tools: .*\$defs\.Place"):
        plan(tools({"name": "go", "parameters": place}, {"name": "run", "parameters": clash}), "required", None)


def test_named_choice_is_forced_by_the_functions_parameters():
    params = {"type": "object", "properties": {"zone": {"type": "string"}}}
    forced = plan(tools({"name": "a"}, {"name": "b", "parameters": params}),
                  NamedToolChoice.model_validate({"type": "function", "function": {"name": "b"}}), None)
    assert forced.sampling_overrides["structured_outputs"].json_schema == params and forced.finish_reason("stop", True) == "stop"


@pytest.mark.parametrize("tool_specs, choice, parser, field", [
    ([], "required", None, "tool_choice"),
    ([{"name": "f"}], "auto", None, "tool_choice"),
    ([{"name": "f"}], None, None, "tool_choice"),  # tools alone mean "auto"
    ([{"name": "f"}], {"type": "function", "function": {"name": "g"}}, "hermes", "tool_choice.function.name"),
    ([{"name": "f"}, {"name": "g", "parameters": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}],
     "required", None, "tools[1].function.parameters"),
])
def test_what_cannot_be_served_names_its_field(tool_specs, choice, parser, field):
    if isinstance(choice, dict):
        choice = NamedToolChoice.model_validate(choice)
    with pytest.raises(ValueError) as caught:
        plan(tools(*tool_specs), choice, parser)
    assert str(caught.value).startswith(field + ": ")


@pytest.mark.parametrize("parser", ["hermes", "mistral"])
def test_a_calls_id_follows_its_output_and_place_alone(parser):
    """Every answer from one job (a retry with its Idempotency-Key, a stream) names its calls
    alike: ids came from uuid4 and differed between replays of one job. Another output, call
    or job gets another id."""
    tool_plan = auto(parser)
    ids = {(key, index): tool_plan.call_id(key, index) for key in ("job-1:0", "job-1:1", "job-2:0") for index in (0, 1)}
    assert len(set(ids.values())) == len(ids)
    assert auto(parser).call_id("job-1:0", 1) == ids["job-1:0", 1]
    assert all(i.startswith("chatcmpl-tool-") and len(i) == 46 for i in ids.values()) if parser == "hermes" else \
        all(len(i) == 9 and i.isalnum() for i in ids.values())


def test_no_plan_without_tools_or_with_none_and_each_familys_vllm_settings():
    assert plan(None, None, "hermes") is None and plan(tools({"name": "f"}), "none", None) is None
    tool_id = auto("mistral").call_id("job-1:0", 0)
    assert len(tool_id) == 9 and tool_id.isalnum()  # Mistral's templates refuse other ids
    # vLLM's hermes and mistral parsers read the text with special tokens kept; its llama3_json parser does not.
    assert auto("hermes").sampling_overrides == auto("mistral").sampling_overrides == {"skip_special_tokens": False}
    assert auto("llama3_json").sampling_overrides == {}


# A Mistral-like template: the tools and each call (arguments as an object, as vLLM gives
# templates) are written out, and a call id that is not 9 characters is refused, as Mistral's are.
TOOL_TEMPLATE = (
    "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for message in messages %}{% if message.tool_calls %}{% for call in message.tool_calls %}"
    "{% if call.id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
    "{% endif %}[TOOL_CALLS]{{ call.function.name }}{{ call.function.arguments | tojson }}{% endfor %}"
    "{% elif message.role == 'tool' %}[TOOL_RESULTS]{{ message.tool_call_id }}:{{ message.content }}[/TOOL_RESULTS]"
    "{% else %}{{ message.role }}: {{ message.content }}\n{% endif %}{% endfor %}"
)


def test_tools_and_an_agent_loops_turns_reach_the_chat_template(tiny_model_dir, tmp_path):
    import shutil

    from api.openai_schemas import ChatMessage
    from api.prompts import PromptChecker
    from pagedq.settings import Settings

    model = shutil.copytree(tiny_model_dir(), tmp_path / "model")
    (model / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    checker = PromptChecker(Settings(model=str(model)))
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}

    def rendered(call_id: str) -> str:
        turns = [{"role": "user", "content": "time?"},
                 {"role": "assistant", "content": None, "tool_calls": [
                     {"id": call_id, "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}]},
                 {"role": "tool", "tool_call_id": call_id, "content": "12:00"}]
        messages = [ChatMessage.model_validate(turn).template_dict() for turn in turns]
        return checker.tokenizer.decode(checker.chat_token_ids(messages, False, tools=[tool]))

    text = rendered("abcDEF123")
    assert '[AVAILABLE_TOOLS][{"type": "function", "function": {"name": "get_time"' in text
    assert '[TOOL_CALLS]get_time{"zone": "UTC"}' in text and "[TOOL_RESULTS]abcDEF123:12:00" in text
    with pytest.raises(ValueError, match="^messages: the model's chat template refused them: Tool call IDs"):
        rendered("chatcmpl-tool-1")


def test_auto_tool_choice_without_a_parser_is_refused_at_startup_as_in_vllm(capsys):
    from pagedq.cli import main

    assert main(["api", "--enable-auto-tool-choice", "--model", "unused"]) == 1
    assert "enable_auto_tool_choice: needs tool_call_parser" in capsys.readouterr().err
