"""A reviewer's findings on refused requests: each is a 400 in OpenAI's error body that names the field and says
what is wrong, in the words of the JSON the client sent (the real app and routes around the fake engine)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from service.api.schemas import PROMPT_RULE
from service.config import Settings
from tests.support.apps import fake_app


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    settings = Settings(store_url=str(tmp_path_factory.mktemp("store")), block_length=4, default_max_tokens=4)
    with TestClient(fake_app(settings)) as c:
        yield c


def refusal(response) -> dict:
    """The error object of a 400 (asserting OpenAI's shape)."""
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    return error


@pytest.mark.parametrize(("prompt", "says"), [
    ([-1], "token id -1 (item 0) is out of range: ids are >= 0"),
    ([5, 7, -3], "token id -3 (item 2) is out of range"),
    ([[4], [1, -2]], "token id -2 (item 1 of item 1) is out of range"),
    ([], "an empty prompt (an empty list)"),
    ([[]], "an empty prompt at item 0 (an empty list)"),
    ("", "an empty prompt (an empty string)"),
    (["w1", ""], "an empty prompt at item 1 (an empty string)"),
    ([1, "w1"], "a list mixing int, str"),
])
def test_a_bad_prompt_says_what_is_wrong(client, prompt, says):
    """Was "prompt: Input should be a valid string" (the union's first branch) for ids and empty lists alike."""
    error = refusal(client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4}))
    assert error["param"] == "prompt" and error["message"].startswith(f"prompt: {says}"), error
    assert PROMPT_RULE in error["message"] and "valid string" not in error["message"]


@pytest.mark.parametrize(("tools", "param", "says"), [
    ([{"type": "function"}], "tools.0.function", "Field required"),
    ("x", "tools", "valid list"),
    ([{"type": "function", "function": {"name": "get weather"}}], "tools.0.function.name", "should match pattern"),
    ({"a": 1, "b": None}, "tools", "valid list"),
])
def test_a_refused_tools_value_names_its_path(client, tools, param, says):
    """Tools are served (issue 35): a malformed one is refused at the path of the wrong value, never in Python's
    repr (``[{'type': 'function'}]``)."""
    body = {"messages": [{"role": "user", "content": "w1"}], "tools": tools, "max_tokens": 4}
    error = refusal(client.post("/v1/chat/completions", json=body))
    assert error["param"] == param and says in error["message"], error
    assert "{'" not in error["message"]


@pytest.mark.parametrize("role", ["user", "system", "developer"])
@pytest.mark.parametrize("message", [{"content": None}, {}])
def test_null_content_is_refused_but_for_an_assistant(client, role, message):
    """OpenAI requires content in every message but an assistant's; a null user content was decoded as ""."""
    messages = [{"role": "user", "content": "w1"}, {"role": role, **message}]
    error = refusal(client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4}))
    assert error["param"] == "messages.1.content" and error["message"].startswith("messages.1.content: content is "
                                                                                  "required"), error
    messages = [{"role": "user", "content": "w1"}, {"role": "assistant", **message}, {"role": "user", "content": "w2"}]
    assert client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4}).status_code == 200
