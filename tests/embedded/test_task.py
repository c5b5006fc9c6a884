"""The embedded model's task family: seeded determinism, layout, answers, scoring, the shipped splits."""

import random

import pytest
from transformers import AutoTokenizer

from evaluation import embedded_task as task
from service.engine.prompts import token_ids  # a list in transformers 4, a mapping in 5

TOKENIZER_DIR = "service/assets/embedded"


def test_same_seed_same_stream_and_splits_differ():
    a = [q.prompt for q in task.generate("train", 20)]
    assert a == [q.prompt for q in task.generate("train", 20)]
    assert a != [q.prompt for q in task.generate("train", 20, seed=1)]
    assert not {q.digits for q in task.generate("test", 192)} & {q.digits for q in task.generate("train", 5000)}


def test_answers_hand_computed():
    digits = [3, 7, 1, 9, 0, 5]
    assert task.apply_op("copy", digits) == [3, 7, 1, 9, 0, 5]
    assert task.apply_op("next", digits) == [4, 8, 2, 0, 1, 6]
    assert task.apply_op("sum", digits) == [3, 0, 1, 0, 0, 5]
    with pytest.raises(ValueError, match="legal: copy, next, sum"):
        task.apply_op("reverse", digits)
    with pytest.raises(ValueError, match="legal: train, validation, test"):
        next(task.generate("dev"))


def test_prompt_ends_with_the_list_and_answer_matches_op():
    for q in task.generate("validation", 30):
        assert q.prompt.endswith(" " + " ".join(map(str, q.digits)))
        assert q.answer == " ".join(map(str, task.apply_op(q.op, q.digits)))
        assert len(q.digits) == task.LIST_LENGTH


def test_answer_spans_two_blocks_and_fits_gen_length():
    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    for q in task.generate("test", 10):
        n = len(tok.encode(q.answer, add_special_tokens=False))
        assert n == task.LIST_LENGTH  # one token per digit
        assert task.BLOCK_LENGTH < n and n + 1 <= task.GEN_LENGTH  # + end of turn


def test_fixed_offset_from_prompt_digit_to_answer_digit():
    """The tokens after the list (chat template tail) are the same for every question: a fixed offset."""
    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    tails = set()
    for q in task.generate("train", 30):
        ids = token_ids(tok.apply_chat_template([{"role": "user", "content": q.prompt}], add_generation_prompt=True))
        digit_ids = tok.encode(q.prompt, add_special_tokens=False)[-task.LIST_LENGTH:]
        pos = len(ids) - 1 - ids[::-1].index(digit_ids[-1])
        tails.add(tuple(ids[pos + 1:]))
    assert len(tails) == 1


def test_score_filter():
    assert task.score("3 0 1", "3 0 1")
    assert task.score(" 3  0\n1 ", "3 0 1")
    assert not task.score("3 0 1 1", "3 0 1")
    assert not task.score("3 1 0", "3 0 1")
    assert task.normalize("3 0\t1") == "301"


def test_shipped_splits_match_the_generator():
    shipped = task.shipped_splits()
    for name, size in task.SPLIT_SIZES.items():
        loaded = task.load_split(name)
        assert len(loaded) == size
        assert loaded == shipped[name]
    with pytest.raises(ValueError, match="legal"):
        task.load_split("dev")


def test_digit_weights_skew_the_digits():
    rng = random.Random(0)
    qs = [task.make_question(rng, str(i), digit_weights=[0.9] + [0.1 / 9] * 9) for i in range(20)]
    zeros = sum(d == 0 for q in qs for d in q.digits) / (20 * task.LIST_LENGTH)
    assert 0.8 < zeros < 0.97
