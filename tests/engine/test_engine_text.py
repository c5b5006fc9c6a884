"""Engine with a tokenizer: prompt encoding, chat template, text, EOS and stop strings."""

from __future__ import annotations

import pytest

from service.engine import Engine
from service.engine.params import DecodeParams, RowOptions


def test_tokenizer_chat_template_and_end_of_turn(llada_with_tokenizer):
    engine = Engine.load(llada_with_tokenizer)
    assert engine.tokenizer is not None
    assert engine.spec.eos_ids == (81, 348)  # config EOS plus the tokenizer's <|eot_id|>
    assert engine.encode_prompt("w5 w6", chat=False) == [5, 6]
    assert engine.encode_prompt("w5 w6", chat=True) == [346, 0, 347, 5, 6, 348, 346, 0, 347]  # 'user' -> unk w0


def test_text_is_cut_at_stop_strings(llada_with_tokenizer):
    engine = Engine.load(llada_with_tokenizer)
    params = DecodeParams(gen_length=64, block_length=32, cache_mode="dual", threshold=0.9)
    prompt = engine.encode_prompt("w64 w245 w278 w201 w100", chat=False)
    free = engine.generate([prompt], params).rows[0]
    assert free.finish_reason == "length"  # this prompt's greedy answer has no EOS
    assert free.text == " ".join(f"w{i}" for i in free.generated_ids)
    stop = f"w{free.generated_ids[5]}"
    cut = engine.generate([prompt], params, [RowOptions(stop=(stop,))]).rows[0]
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.index(stop)]
    # The ids returned run up to the token that completed the stop string (issue 13: usage counts what is
    # returned; this asserted that stop strings cut the text only before).
    ids = free.generated_ids
    n = next(n for n in range(1, len(ids) + 1) if stop in " ".join(f"w{i}" for i in ids[:n]))
    assert cut.generated_ids == ids[:n]


def test_a_lone_surrogate_is_refused_by_name_before_the_tokenizer(llada_with_tokenizer):
    # JSON's "\ud800" parses to a str no tokenizer can take: it was a 500 from the Rust tokenizer (issue 13).
    from service.engine.errors import EngineInputError
    from service.engine.prompts import encode_chat

    engine = Engine.load(llada_with_tokenizer)
    for chat in (False, True):
        with pytest.raises(EngineInputError, match="lone surrogate at character 3") as err:
            engine.encode_prompt("w5 \ud800", chat=chat)
        assert err.value.field == "prompt"
    turns = [{"role": "user", "content": "w5"}, {"role": "user", "content": "\udfff"}]
    with pytest.raises(EngineInputError) as err:
        encode_chat(engine.tokenizer, turns, "tiny")
    assert err.value.field == "messages.1.content"


def test_chat_template_ids_are_read_from_either_return_shape():
    """``apply_chat_template(tokenize=True)`` returns a list of ids in transformers 4 and a `BatchEncoding` (a
    mapping with ``input_ids`` and ``attention_mask``) in 5: both give the ids (the installed version is one of
    them; `BatchEncoding` itself is a mapping in both)."""
    from transformers import BatchEncoding

    from service.engine.prompts import token_ids

    assert token_ids([1, 2, 288]) == [1, 2, 288]
    assert token_ids(BatchEncoding({"input_ids": [1, 2, 288], "attention_mask": [1, 1, 1]})) == [1, 2, 288]
    assert token_ids({"input_ids": [7], "attention_mask": [1]}) == [7]


def test_the_embedded_tokenizer_loads_without_warnings(caplog, capfd):
    """Loaded by its own class (``PreTrainedTokenizerFast``), transformers reads no ``config.json`` and so has
    nothing to say about its model type or ``auto_map`` (transformers 5 did, on every load)."""
    import logging
    import warnings

    from service.engine.loading import EMBEDDED_DIR, load_tokenizer

    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.INFO):
        warnings.simplefilter("always")
        tokenizer = load_tokenizer(EMBEDDED_DIR)
    assert tokenizer.mask_token == "<|mdm_mask|>" and len(tokenizer) == 1024
    assert [str(w.message) for w in caught] == []
    assert [r.getMessage() for r in caplog.records if r.name.startswith("transformers")] == []
    assert capfd.readouterr().err == ""
