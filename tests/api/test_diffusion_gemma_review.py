"""A fresh user's review of the served DiffusionGemma (tiny checkpoint, canvas 16), each finding a 400 naming the
field the client sent, or a decode window of ``ceil(max_tokens / canvas_length)`` canvases whatever the server's
block length: the real server (`start_llada2_server`, as tests/api/test_diffusion_gemma_served.py starts it)."""

from __future__ import annotations

import httpx
import pytest

from tests.support.llada2 import start_llada2_server
from tests.support.paths import REPO

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TINY = REPO / "tests" / "data" / "diffusion_gemma" / "dgemma-tiny"
STEPS = {"max_denoising_steps": 2}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_llada2_server(TINY, tmp_path_factory.mktemp("dgemma-review"))
    yield srv
    srv.stop()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


@pytest.mark.parametrize(("max_tokens", "extra", "canvases"), [
    (1, {}, 1), (16, {}, 1), (17, {}, 2), (33, {}, 3), (1, {"block_length": 16}, 1),
])
def test_the_canvases_are_max_tokens_over_the_canvas_whatever_the_block_length(server, max_tokens, extra, canvases):
    """The server's default block length (32) rounded max_tokens 1 up to two canvases of 16 and 33 to four: now
    ``ceil(max_tokens / 16)``, as the CLI's --gen-length and the reference's max_new_tokens count them (each canvas
    runs its steps: one entry of steps_per_block per canvas)."""
    body = {"prompt": "Hello", "max_tokens": max_tokens, "seed": 1, "ignore_eos": False, **STEPS, **extra}
    response = post(server, "/generate", body)
    assert response.status_code == 200, response.text
    out = response.json()["rows"][0]
    # A canvas holding the EOS ends the text early: at most this many canvases, exactly this many without one.
    assert 1 <= len(out["steps_per_block"]) <= canvases
    if out["finish_reason"] == "length":
        assert len(out["steps_per_block"]) == canvases


@pytest.mark.parametrize(("block_length", "max_tokens"), [(512, 1), (4096, 20), (32, 16), (8, 16)])
def test_a_block_length_other_than_the_canvas_is_refused_by_name(server, block_length, max_tokens):
    body = {"prompt": "Hello", "max_tokens": max_tokens, "block_length": block_length, **STEPS}
    response = post(server, "/generate", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "block_length" and "canvas of 16 tokens" in error["message"], error


@pytest.mark.parametrize(("extra", "field"), [
    ({"t_max": 1e308}, "t_max"), ({"t_min": 1e-300, "t_max": 1e-299}, "t_min"),
    ({"t_min": 1e308, "t_max": 1.7e308}, "t_max"), ({"t_min": 0, "t_max": 1e-5}, "t_max"),
])
def test_temperatures_float32_cannot_hold_are_a_400_naming_the_field(server, extra, field):
    """They were a 200 with sixteen id-0 tokens (NaN probabilities): the message states the legal range."""
    body = {"model": "dgemma-tiny", "prompt": "Hello", "max_tokens": 16, "seed": 1, **extra}
    response = post(server, "/v1/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and ("10000" in error["message"] or "1e-06" in error["message"]), error


def test_a_prompt_id_outside_the_vocabulary_is_not_called_a_mask_token(server):
    """DiffusionGemma has no mask token: 512 (its vocab size, the spec's mask id) is outside the vocabulary."""
    response = post(server, "/generate", {"prompt": [512], "max_tokens": 16, **STEPS})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "prompt" and "outside the vocabulary [0, 512)" in error["message"], error
    assert "mask" not in error["message"]


@pytest.mark.parametrize(("extra", "field"), [
    ({"tools": TOOLS}, "tools"), ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
])
def test_tool_calls_are_refused_first_naming_the_field_sent(server, extra, field):
    """Auto tools were refused naming response_format, which the client never sent, and required ones with a short
    max_tokens asked for more tokens, to be refused for the family once given them."""
    body = {"model": "dgemma-tiny", "messages": [{"role": "user", "content": "weather?"}], "max_tokens": 16, **extra}
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and "not served for diffusion_gemma" in error["message"], error


def test_tool_choice_none_lists_the_tools_and_is_served(server):
    body = {"model": "dgemma-tiny", "messages": [{"role": "user", "content": "weather?"}], "max_tokens": 16,
            "tools": TOOLS, "tool_choice": "none", **STEPS}
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text


def test_the_context_check_counts_the_canvas_rounded_window(server):
    """A 4,080-token prompt and max_tokens 16 fill the context of 4,096 with one canvas: served (the block length
    of 32 rounded the window to 32 positions, over the context, and the 400 blamed max_tokens); 17 is two
    canvases, over it, a 400."""
    body = {"prompt": [1] * 4080, "max_tokens": 16, "seed": 1, "max_denoising_steps": 1}
    response = post(server, "/generate", body)
    assert response.status_code == 200, response.text
    response = post(server, "/generate", {**body, "max_tokens": 17})
    assert response.status_code == 400, response.text
    assert "4112" in response.json()["error"]["message"]


def test_many_denoising_steps_on_a_short_response_are_a_400_naming_them(server):
    """max_tokens 16 (one canvas of 16) with 1,000,000 passes was priced at 1,000,000 x 19 token-forwards, under
    the default ceiling of 33,554,432, and ran for minutes: each pass is now charged at least
    ``FORWARD_FLOOR_TOKENS``; 8 passes stay served."""
    body = {"model": "dgemma-tiny", "prompt": "The cat", "max_tokens": 16, "max_denoising_steps": 1_000_000}
    response = post(server, "/v1/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "max_denoising_steps" and "33,554,432" in error["message"], error
    response = post(server, "/v1/completions", {**body, "max_denoising_steps": 8, "seed": 1})
    assert response.status_code == 200, response.text
