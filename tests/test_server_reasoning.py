"""Reasoning split over HTTP with the official client (`--reasoning-parser`): the thinking in `reasoning` and
`reasoning_content`, the answer in `content`, streamed and not; `chat_template_kwargs` reaching the template;
tool calls read from the answer only.

The servers run tiny seeded Qwen3 checkpoints whose chat templates think as Qwen3's and DeepSeek-R1's do. A
random model writes no `<think>` of its own, so a regex constraint makes it write a known output, and what is
tested is the server's reading of it, whatever the model has learnt.
"""

from __future__ import annotations

import json

import pytest
from server_fixtures import assert_openai_error, start_server

from pagoda.testing.checkpoints import make_checkpoint

pytestmark = pytest.mark.timeout(180)

# Qwen3's switch: enable_thinking false writes an empty thinking into the prompt, so the model answers at once.
QWEN3_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)
# DeepSeek-R1's: the template opens the thinking, so the output starts inside it.
R1_TEMPLATE = QWEN3_TEMPLATE.split("{% if add_generation_prompt %}")[0] + (
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}"
)
MAX_TOKENS = 200  # a forced output may take a token per character
QUESTION = [{"role": "user", "content": "What is 2 and 2?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}
HERMES_CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Oslo"\}\}\n</tool_call>'


def thinking_checkpoint(out_dir, template: str):
    model_dir = make_checkpoint(out_dir, "qwen3")
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["chat_template"] = template
    config_path.write_text(json.dumps(config), encoding="utf-8")
    return model_dir


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = tmp_path_factory.mktemp("server-reasoning")
    model_dir = thinking_checkpoint(directory / "model", QWEN3_TEMPLATE)
    server = start_server(model_dir, directory, "--reasoning-parser", "qwen3", "--enable-auto-tool-choice",
                          "--tool-call-parser", "hermes")
    yield server
    server.stop()


def forced(regex: str, **kwargs) -> dict:
    """A request's options: the output forced to match `regex`, any other extra_body fields kept."""
    extra_body = {"structured_outputs": {"regex": regex}, **kwargs.pop("extra_body", {})}
    return {"messages": QUESTION, "max_tokens": MAX_TOKENS, "temperature": 1.0, "seed": 0, **kwargs,
            "extra_body": extra_body}


def ask(client, model, regex: str, **kwargs):
    return client.chat.completions.create(model=model, **forced(regex, **kwargs))


def streamed_parts(client, model, regex: str, **kwargs) -> tuple[list[str], list[str], list]:
    """The streamed reasoning pieces, content pieces, and the chunks' order of kinds."""
    stream = client.chat.completions.create(model=model, stream=True, **forced(regex, **kwargs))
    reasoning, content, kinds = [], [], []
    for chunk in stream:
        for choice in chunk.choices:
            extra_fields = choice.delta.model_extra or {}
            if extra_fields.get("reasoning"):
                assert extra_fields["reasoning_content"] == extra_fields["reasoning"]
                reasoning.append(extra_fields["reasoning"])
                kinds.append("reasoning")
            if choice.delta.content:
                content.append(choice.delta.content)
                kinds.append("content")
    return reasoning, content, kinds


def test_the_thinking_goes_to_reasoning_and_the_rest_to_content(client, model):
    message = ask(client, model, "<think>abc</think>answer").choices[0].message
    extra = message.model_extra or {}
    assert (extra.get("reasoning"), extra.get("reasoning_content"), message.content) == ("abc", "abc", "answer")


def test_streamed_deltas_carry_the_reasoning_then_the_content_without_tags(client, model):
    regex = "<think>\nI add two and two\\.\n</think>\n\nIt is four\\."
    reasoning, content, kinds = streamed_parts(client, model, regex)
    assert "".join(reasoning) == "I add two and two." and "".join(content) == "It is four."
    assert len(reasoning) > 1 and len(content) > 1, (reasoning, content)  # really streamed, piece by piece
    assert kinds == sorted(kinds, key=["reasoning", "content"].index), kinds
    assert not any("<" in piece or ">" in piece for piece in reasoning + content), (reasoning, content)


def test_enable_thinking_false_reaches_the_template_and_the_answer_is_all_content(server, client, model):
    thinking = ask(client, model, "It is four\\.")
    answering = ask(client, model, "It is four\\.", extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert answering.usage.prompt_tokens > thinking.usage.prompt_tokens  # the empty thinking in the prompt
    rendered = server.post("/tokenize", {"messages": QUESTION,
                                         "chat_template_kwargs": {"enable_thinking": False}}).json()["tokens"]
    assert len(rendered) == answering.usage.prompt_tokens
    assert server.post("/detokenize", {"tokens": rendered}).json()["prompt"].endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    message = answering.choices[0].message
    assert message.content == "It is four." and (message.model_extra or {}).get("reasoning") is None
    reasoning, content, _ = streamed_parts(client, model, "It is four\\.",
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert reasoning == [] and "".join(content) == "It is four."


def test_a_tool_call_after_the_thinking_is_parsed(client, model):
    choice = ask(client, model, "<think>I need the weather\\.</think>\n" + HERMES_CALL, tools=[WEATHER]).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert (choice.message.model_extra or {}).get("reasoning") == "I need the weather."
    assert [(call.function.name, json.loads(call.function.arguments)) for call in choice.message.tool_calls] == [
        ("get_weather", {"city": "Oslo"})]
    assert not choice.message.content


def test_a_streamed_tool_call_after_the_thinking_assembles(client, model):
    regex = "<think>I need the weather\\.</think>\n" + HERMES_CALL
    with client.chat.completions.stream(model=model, **forced(regex, tools=[WEATHER])) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert [(call.function.name, json.loads(call.function.arguments)) for call in final.message.tool_calls] == [
        ("get_weather", {"city": "Oslo"})]


def test_a_tool_call_written_while_thinking_is_reasoning_not_a_call(client, model):
    regex = "<think>" + HERMES_CALL + "</think>Done\\."
    choice = ask(client, model, regex, tools=[WEATHER]).choices[0]
    assert not choice.message.tool_calls and choice.finish_reason == "stop"
    assert choice.message.content == "Done."
    assert (choice.message.model_extra or {})["reasoning"].startswith("<tool_call>")


def test_the_renderers_own_arguments_are_not_template_kwargs(server, model):
    for path, body in [("/v1/chat/completions", {"model": model, "messages": QUESTION}),
                       ("/tokenize", {"messages": QUESTION})]:
        response = server.post(path, {**body, "chat_template_kwargs": {"add_generation_prompt": False}})
        assert_openai_error(response, 400, param="chat_template_kwargs", contains=["add_generation_prompt"])


def test_include_reasoning_false_leaves_the_reasoning_out(client, model):
    message = ask(client, model, "<think>abc</think>answer", extra_body={"include_reasoning": False}).choices[0].message
    assert message.content == "answer" and "reasoning" not in (message.model_extra or {})


@pytest.fixture(scope="module")
def r1_client(tmp_path_factory):
    directory = tmp_path_factory.mktemp("server-reasoning-r1")
    model_dir = thinking_checkpoint(directory / "model", R1_TEMPLATE)
    server = start_server(model_dir, directory, "--reasoning-parser", "deepseek_r1")
    try:
        with server.client() as client:
            yield client
    finally:
        server.stop()


def test_deepseek_r1_output_starts_inside_the_thinking(r1_client):
    model = r1_client.models.list().data[0].id
    message = ask(r1_client, model, "abc\n</think>\n\nanswer").choices[0].message
    assert ((message.model_extra or {}).get("reasoning"), message.content) == ("abc", "answer")
    reasoning, content, _ = streamed_parts(r1_client, model, "abc\n</think>\n\nanswer")
    assert ("".join(reasoning), "".join(content)) == ("abc", "answer")


def test_a_forced_call_is_not_read_as_thinking(r1_client):
    """A grammar writes a forced call from the first token: there is no thinking before it."""
    model = r1_client.models.list().data[0].id
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = r1_client.chat.completions.create(model=model, messages=QUESTION, tools=[WEATHER], tool_choice=named,
                                               max_tokens=MAX_TOKENS, seed=0).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert json.loads(choice.message.tool_calls[0].function.arguments)["city"] in ("Oslo", "Rome")
