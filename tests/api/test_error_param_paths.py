"""The ``param`` of a 400 for a bad nested field is the field's path in the request body as the client wrote it:
no pydantic union labels (``dict[str,any]``) and no tagged-union tag (``response_format.json_schema.json_schema``)."""

from __future__ import annotations

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from service.api.errors import classify
from service.api.schemas import ChatCompletionRequest

MESSAGES = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": 5}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object", "extra": 1}}, "response_format.extra"),
    ({"structured_outputs": {"json": 5}}, "structured_outputs.json"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"max_tokens": "5"}, "max_tokens"),
])
def test_param_is_the_path_in_the_body(extra, param):
    body = {"model": "embedded", "messages": MESSAGES, **extra}
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(body)
    exc = RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in info.value.errors()], body=body)
    status, answer, _ = classify(exc)
    assert status == 400 and answer["error"]["param"] == param, answer
    assert answer["error"]["message"].startswith(f"{param}: ") or f"'{param}'" in answer["error"]["message"]


def test_a_path_parameter_keeps_its_name():
    """A bad path parameter (``PUT /admin/active/turbo``) is named though the body has no such key."""
    body = {"method": "kivi", "bits": 2}
    error = {"type": "literal_error", "loc": ("path", "cache_mode"), "msg": "Input should be 'none', 'prefix' or 'dual'",
             "input": "turbo"}
    status, answer, _ = classify(RequestValidationError([error], body=body))
    assert status == 400 and answer["error"]["param"] == "cache_mode", answer
