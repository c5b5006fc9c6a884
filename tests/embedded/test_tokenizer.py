"""The embedded model's tokenizer: exact round trip, single-token specials and digits, LLaDA's chat template."""

from transformers import AutoTokenizer

from service.engine.prompts import token_ids  # a list in transformers 4, a mapping in 5

TOKENIZER_DIR = "service/assets/embedded"
HUMANEVAL_LIKE = (
    'from typing import List\n\n\ndef has_close_elements(numbers: List[float], threshold: float) -> bool:\n'
    '    """ Check if in given list of numbers, are any two numbers closer to each other than\n'
    '    given threshold.\n    >>> has_close_elements([1.0, 2.0, 3.0], 0.5)\n    False\n    """\n'
)


def tok():
    return AutoTokenizer.from_pretrained(TOKENIZER_DIR)


def test_round_trip_of_arbitrary_text():
    t = tok()
    for text in [HUMANEVAL_LIKE, "\nclass", "\ndef", "\tx\r\n  y  ", "héllo wörld 中文 🙂", "", "  ", "<|eot"]:
        assert t.decode(t.encode(text, add_special_tokens=False)) == text


def test_specials_are_single_ids_in_llada_roles():
    t = tok()
    names = ["<|endoftext|>", "<|startoftext|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
             "<|mdm_mask|>"]
    ids = [t.encode(n, add_special_tokens=False) for n in names]
    assert all(len(i) == 1 for i in ids) and len({i[0] for i in ids}) == len(names)
    assert t.eos_token == "<|endoftext|>" and t.pad_token == "<|endoftext|>"
    assert t.bos_token == "<|startoftext|>" and t.mask_token == "<|mdm_mask|>"
    assert t.decode(t.encode("1 <|eot_id|>", add_special_tokens=False), skip_special_tokens=True) == "1 "


def test_digits_and_op_words_are_single_tokens():
    t = tok()
    for d in range(10):
        assert len(t.encode(f" {d}", add_special_tokens=False)) == 1
        assert len(t.encode(f"{d}", add_special_tokens=False)) == 1
    for w in ["copy", "next", "sum", "user", "assistant"]:
        assert len(t.encode(w, add_special_tokens=False)) == 1


def test_chat_template_is_llada_format():
    t = tok()
    msgs = [{"role": "system", "content": " be brief "}, {"role": "user", "content": "sum: 1 2"}]
    text = t.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|startoftext|><|start_header_id|>system<|end_header_id|>\n\nbe brief<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nsum: 1 2<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    ids = token_ids(t.apply_chat_template(msgs[1:], add_generation_prompt=True))
    assert ids[0] == t.bos_token_id and ids.count(t.bos_token_id) == 1
