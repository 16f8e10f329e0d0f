"""The README's first command serves the built-in demo model, and its chat endpoint answers task prompts.

`make serve` runs `pagoda serve` with no --model; this starts the same command (on a free port) and asks,
through the official openai client, held-out problems of the families the model card reports at 100%.
"""

from __future__ import annotations

import pytest
from server_fixtures import start_server

from pagoda.demo.tasks import held_out_set, is_correct

pytestmark = pytest.mark.timeout(180)

# Whole conversations through the chat API: earlier exchanges, facts told turns before, and questions outside the
# model's families (held out; 100% of these items' families on 200 items each but multiturn, 94%).
FAMILIES = ("counting", "scope", "recall", "multiturn")
ITEMS_PER_FAMILY = 8


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = start_server(None, tmp_path_factory.mktemp("demo-server"))
    yield server
    server.stop()


def test_default_server_answers_held_out_tasks_through_chat(server):
    held_out = held_out_set(ITEMS_PER_FAMILY)
    with server.client() as client:
        model = client.models.list().data[0].id
        assert model.endswith("pagoda-demo"), model
        for family in FAMILIES:
            for item in held_out[family]:
                reply = client.chat.completions.create(model=model, messages=item.messages(), temperature=0,
                                                       max_tokens=48)
                choice = reply.choices[0]
                assert choice.finish_reason == "stop", (item.prompt, choice)
                assert is_correct(item, choice.message.content), (item.prompt, item.answer, choice.message.content)
