"""The demo model's task corpus: deterministic, held-out problems never trained on, honest checkers."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import pytest

from pagoda.demo.conversations import USER_FACTS
from pagoda.demo.tasks import (
    SCOPE_ANSWER,
    TASKS,
    TOOLS,
    Item,
    generate,
    held_out_set,
    in_test_split,
    is_correct,
    tool_call_text,
    training_stream,
)
from pagoda.demo.vocabulary import CITIES


@pytest.mark.parametrize("task", sorted(TASKS))
def test_generation_is_deterministic(task: str) -> None:
    assert generate(task, "test", 50) == generate(task, "test", 50)
    assert generate(task, "train", 50, seed=3) == generate(task, "train", 50, seed=3)
    assert generate(task, "train", 50, seed=3) != generate(task, "train", 50, seed=4)


def test_training_stream_is_deterministic_and_mixes_all_tasks() -> None:
    first = list(itertools.islice(training_stream(seed=5), 2000))
    assert first == list(itertools.islice(training_stream(seed=5), 2000))
    assert {item.task for item in first} == set(TASKS)
    assert any(item.system for item in first) and any(item.system is None for item in first)


def test_held_out_problems_never_reach_training() -> None:
    held_out = {item.key for items in held_out_set(300).values() for item in items}
    trained = {item.key for item in itertools.islice(training_stream(), 20_000)}
    assert held_out and trained
    assert not held_out & trained
    assert all(in_test_split(key) for key in held_out)


def test_held_out_questions_never_reach_training_histories() -> None:
    # An earlier exchange in a training conversation is a question and its answer too: it must come from the
    # training split, or the model would see a held-out answer in the history. (A held-out acknowledgement is
    # held out as the whole conversation it ends: telling a fact is acknowledged in training histories too.)
    held_out = {(item.prompt, item.answer) for items in held_out_set(300).values() for item in items
                if not item.key.startswith("recall-ack:")}
    exchanges = 0
    for item in itertools.islice(training_stream(), 20_000):
        for question, answer in zip(item.history, item.history[1:]):
            if question["role"] == "user" and answer["role"] == "assistant" and answer["content"]:
                exchanges += 1
                assert (question["content"], answer["content"]) not in held_out
    assert exchanges > 5000


def test_some_single_questions_are_trained_after_earlier_exchanges() -> None:
    items = [item for item in itertools.islice(training_stream(), 5000) if item.task == "addition"]
    with_history = [item for item in items if item.history]
    assert 0.15 < len(with_history) / len(items) < 0.35
    assert all(item.messages()[-1] == {"role": "user", "content": item.prompt} for item in with_history)


def test_test_set_is_large_and_distinct_per_task() -> None:
    for task, items in held_out_set(1000).items():
        assert len(items) == 1000, task
        assert len({item.key for item in items}) == 1000, task
        assert all(item.task == task and item.system is None for item in items)


def test_test_set_does_not_depend_on_its_size() -> None:
    # A quick run (--limit) scores the first items of the full set, not a different set.
    small, large = held_out_set(20), held_out_set(200)
    assert all(large[task][:20] == small[task] for task in TASKS)


@pytest.mark.parametrize("task", sorted(TASKS))
def test_checker_accepts_the_answer_and_rejects_a_wrong_one(task: str) -> None:
    for item in generate(task, "test", 100):
        assert is_correct(item, item.answer)
        assert is_correct(item, f" {item.answer}\n")  # surrounding whitespace is not an error
        assert not is_correct(item, item.answer + "0")
        assert not is_correct(item, "")


def test_answers_are_right() -> None:
    for item in generate("addition", "test", 200):
        a, b = map(int, item.key.split("+"))
        assert int(item.answer) == a + b and f"{a} + {b}" in item.prompt
    for item in generate("subtraction", "test", 200):
        a, b = map(int, item.key.split("-"))
        assert int(item.answer) == a - b >= 0
    for item in generate("sort", "test", 200):
        numbers = [int(x) for x in item.key.removeprefix("sort:").split(", ")]
        assert [int(x) for x in item.answer.split(", ")] == sorted(numbers)
    for item in generate("reverse", "test", 200):
        assert item.answer.split(", ") == item.key.removeprefix("reverse:").split(", ")[::-1]
    for item in generate("counting", "test", 200):
        assert int(item.answer) == len(item.key.removeprefix("count:").split(", "))
    for item in generate("json", "test", 200):
        pairs = dict(pair.split("=") for pair in item.key.removeprefix("json:").split(", "))
        assert {k: str(v) for k, v in json.loads(item.answer).items()} == pairs
    for item in generate("facts", "test", 200):
        facts, target = item.key.removeprefix("facts:").split("|")
        assert target in item.prompt.split("?")[0].split(".")[-1]
        assert any(s.startswith(target) and s.endswith(item.answer) for s in facts.rstrip(".").split(". "))


def _user_turns(item: Item) -> list[str]:
    return [m["content"] for m in item.history if m["role"] == "user"]


def test_multiturn_asks_its_own_question_after_two_to_four_exchanges() -> None:
    own_answers = {(i.prompt, i.answer) for task in TASKS if task not in ("multiturn", "recall")
                   for i in generate(task, "test", 1000)}
    found = 0
    for item in generate("multiturn", "test", 300):
        assert 2 <= len(_user_turns(item)) <= 4 and not item.tools
        roles = [m["role"] for m in item.history]
        assert roles == ["user", "assistant"] * (len(roles) // 2)
        found += (item.prompt, item.answer) in own_answers  # the same question asked alone has this answer
    assert found > 20


def test_recall_answers_from_an_earlier_turn() -> None:
    acknowledged = 0
    for item in generate("recall", "test", 300):
        told = dict(fact.split("=") for fact in item.key.split(":", 1)[1].split("|") if "=" in fact)
        said = _user_turns(item) + [item.prompt]
        for relation, value in told.items():
            assert USER_FACTS[relation][1].format(v=value) in said
        if item.key.startswith("recall-ack:"):
            acknowledged += 1
            assert item.answer in {USER_FACTS[r][2].format(v=v) for r, v in told.items()}
        else:
            asked = item.key.rsplit("|", 1)[1]
            assert item.answer == told[asked] and item.prompt in USER_FACTS[asked][3]
            assert item.prompt not in _user_turns(item)
    assert 20 < acknowledged < 120


def test_scope_questions_get_the_capabilities_answer() -> None:
    items = generate("scope", "test", 300)
    assert all(item.answer == SCOPE_ANSWER for item in items)
    assert not any(" + " in item.prompt or " - " in item.prompt for item in items)


def _call(text: str) -> dict:
    """The one hermes call `text` holds: `<tool_call>`, a JSON object, `</tool_call>`."""
    assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>"), text
    return json.loads(text.removeprefix("<tool_call>").removesuffix("</tool_call>"))


def _offered(item: Item) -> list[str]:
    return [tool["function"]["name"] for tool in item.tools]


def test_tool_answers_are_the_right_call() -> None:
    calls = no_calls = 0
    for item in generate("tool", "test", 500):
        assert item.tools and not item.turns and len(set(_offered(item))) == len(item.tools)
        if not item.answer.startswith("<tool_call>"):  # a question no tool answers: its own family's answer
            kind, problem = item.key.split(":", 1)
            if kind == "json":
                pairs = dict(pair.split("=") for pair in problem.split(", "))
                assert {k: str(v) for k, v in json.loads(item.answer).items()} == pairs
            else:
                items = problem.split(", ")
                assert item.answer == (str(len(items)) if kind == "count" else ", ".join(items[::-1]))
            assert problem in item.prompt
            no_calls += 1
            continue
        calls += 1
        call = _call(item.answer)
        assert item.answer == tool_call_text(call["name"], call["arguments"])  # json.dumps spacing
        assert call["name"] in _offered(item)
        if call["name"] == "get_weather":
            assert call["arguments"]["city"] in CITIES and call["arguments"]["city"] in item.prompt
            assert item.key == f"weather:{call['arguments']['city']}|{','.join(_offered(item))}"
        else:
            a, b = call["arguments"]["a"], call["arguments"]["b"]
            assert item.key == f"{a}{'+' if call['name'] == 'add' else '*'}{b}"  # the arithmetic's own key
            assert str(a) in item.prompt and str(b) in item.prompt
    assert calls > 400 and no_calls > 30
    assert {_call(i.answer)["name"] for i in generate("tool", "test", 100) if i.answer.startswith("<tool")} == {
        "add",
        "multiply",
        "get_weather",
    }


def test_tool_results_are_stated() -> None:
    for item in generate("tool_result", "test", 300):
        user, (assistant, tool) = item.messages()[-3], item.turns
        assert user == {"role": "user", "content": item.prompt}
        [call] = assistant["tool_calls"]
        name, arguments = call["function"]["name"], json.loads(call["function"]["arguments"])
        assert isinstance(call["function"]["arguments"], str)  # OpenAI's shape
        assert name in _offered(item) and tool["role"] == "tool" and tool["tool_call_id"] == call["id"]
        if name == "get_weather":
            result = json.loads(tool["content"])
            assert item.answer == (
                f"It is {result['temperature']} degrees and {result['condition']} in {arguments['city']}."
            )
        else:
            a, b = arguments["a"], arguments["b"]
            assert item.answer == tool["content"] == str(a + b if name == "add" else a * b)


def test_tools_are_openai_function_definitions() -> None:
    assert [tool["function"]["name"] for tool in TOOLS] == ["add", "multiply", "get_weather"]
    for tool in TOOLS:
        assert tool["type"] == "function"
        parameters = tool["function"]["parameters"]
        assert parameters["type"] == "object" and parameters["required"] == list(parameters["properties"])


def test_messages_put_the_system_prompt_first() -> None:
    item = Item("copy", "copy:x", "Copy this text: x", "x")
    assert item.messages() == [{"role": "user", "content": "Copy this text: x"}]
    with_system = replace(item, system="Be brief.")
    assert [m["role"] for m in with_system.messages()] == ["system", "user"]


def test_unknown_split_is_refused() -> None:
    with pytest.raises(ValueError):
        generate("copy", "validation", 1)
