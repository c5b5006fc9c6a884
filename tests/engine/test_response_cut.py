"""The one response rule (`service.engine.response.cut_response`): max_tokens, EOS, stop strings, finish reason."""

import pytest

from service.engine.response import cut_response

EOS = 0
ALPHA = "_abcdefghij"  # id i -> ALPHA[i]; 0 is EOS (no text)


def decode(ids):
    return "".join(ALPHA[i] for i in ids if i != EOS)


@pytest.mark.parametrize(
    ("ids", "kw", "kept", "text", "reason"),
    [
        ([1, 2, 3, EOS, EOS], {}, [1, 2, 3, EOS], "abc", "stop"),
        ([1, 2, 3, EOS, EOS], {"max_tokens": 2}, [1, 2], "ab", "length"),  # cut removed non-EOS tokens
        ([1, 2, 3, EOS, EOS], {"max_tokens": 3}, [1, 2, 3], "abc", "stop"),  # cut removed only the ending EOS
        ([1, 2, 3, EOS, 4], {"ignore_eos": True}, [1, 2, 3, EOS, 4], "abcd", "length"),  # ran to the end
        ([1, 2, 3, EOS, 4], {"ignore_eos": True, "max_tokens": 4}, [1, 2, 3, EOS], "abc", "length"),
        ([1, 2, 3, 4, 5], {"stops": ("cd",)}, [1, 2, 3, 4], "ab", "stop"),  # tokens up to the one completing it
        ([1, 2, 3, 4, 5], {"stops": ("cd",), "max_tokens": 3}, [1, 2, 3], "abc", "length"),  # stop not reached
        ([1, 2, EOS, 3, 4], {"stops": ("cd",)}, [1, 2, EOS], "ab", "stop"),  # EOS first: the stop is never seen
        ([1, 2, 3], {"stops": ("", "zz")}, [1, 2, 3], "abc", "length"),
    ],
)
def test_cut(ids, kw, kept, text, reason):
    cut = cut_response(ids, [EOS], decode=decode, **kw)
    assert (cut.ids, cut.text, cut.finish_reason) == (kept, text, reason)


def test_without_a_decoder_the_ids_are_cut_and_there_is_no_text():
    cut = cut_response([1, 2, EOS, 3], [EOS], max_tokens=8, decode=lambda ids: None)
    assert (cut.ids, cut.text, cut.finish_reason) == ([1, 2, EOS], None, "stop")
