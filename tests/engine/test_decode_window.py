"""`decode_window`: the one rule the server and the in-process lm-eval model size a decode by. A canvas model
(DiffusionGemma, canvas 16 here) decodes ``ceil(max_tokens / canvas)`` canvases whatever the default block length
(32 once rounded max_tokens 1 up to two canvases, 33 to four); a given block length other than the canvas is
refused by name; a masked family keeps ``response_length``'s whole blocks."""

from __future__ import annotations

import pytest

from service.engine.errors import EngineInputError
from service.engine.params import decode_window


@pytest.mark.parametrize(("max_tokens", "given", "window"), [
    (1, None, (16, 16)), (16, None, (16, 16)), (33, None, (48, 16)), (20, 16, (32, 16)),
])
def test_a_canvas_model_decodes_whole_canvases(max_tokens, given, window):
    assert decode_window(max_tokens, given, 16, 32) == window


@pytest.mark.parametrize("given", [32, 512, 4096, 8])
def test_a_given_block_length_other_than_the_canvas_is_refused_by_name(given):
    with pytest.raises(EngineInputError) as caught:
        decode_window(20, given, 16, 32)
    assert caught.value.field == "block_length" and "canvas of 16 tokens" in str(caught.value)


def test_a_masked_family_rounds_to_its_block():
    assert decode_window(33, None, None, 32) == (64, 32)
    assert decode_window(33, 8, None, 32) == (40, 8)
