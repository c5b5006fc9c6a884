"""The shared response-length rule (`service.engine.params.response_length`)."""

import pytest

from service.engine.params import DecodeParams, response_length


@pytest.mark.parametrize(
    ("max_new_tokens", "block_length", "expected"),
    [(1, 32, 32), (32, 32, 32), (33, 32, 64), (256, 32, 256), (255, 32, 256), (1024, 32, 1024), (5, 4, 8), (7, 1, 7)],
)
def test_rounds_up_to_whole_blocks(max_new_tokens, block_length, expected):
    assert response_length(max_new_tokens, block_length) == expected
    # The result is always a legal decode window.
    DecodeParams(gen_length=expected, block_length=block_length)


@pytest.mark.parametrize(("max_new_tokens", "block_length"), [(0, 32), (-3, 32), (8, 0), (2.5, 32), (True, 32), (8, "32")])
def test_rejects_non_positive_or_non_integer(max_new_tokens, block_length):
    with pytest.raises(ValueError, match="must be a positive integer"):
        response_length(max_new_tokens, block_length)
