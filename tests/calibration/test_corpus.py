"""mixed_chat loader, bucket files, the shipped offline corpus and collect's record conversion."""

from __future__ import annotations

import sys
from collections import Counter

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from calibration import collect as collect_module
from calibration.corpus import (
    OFFLINE_CORPUS_DIR,
    CorpusError,
    HFEncoder,
    Record,
    mixed_chat,
    prepare,
    read_bucket,
    write_bucket,
)


def _ids_bucket(tag: int, count: int, answer_length: int = 10) -> list[Record]:
    return [Record(prompt_ids=(tag, i), answer_ids=tuple(range(answer_length)), source=f"{tag}") for i in range(count)]


def _tokenizer(chat: bool) -> PreTrainedTokenizerFast:
    words = ["[UNK]", "<eos>", "<user>", "<asst>", "hello", "world", "say", "hi"]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", unk_token="[UNK]")
    if chat:
        tok.chat_template = "{% for m in messages %}<user> {{ m['content'] }} {% endfor %}<asst>"
    return tok


def test_prepare_appends_eos_then_cuts_to_block_multiple():
    encoder = HFEncoder(_tokenizer(chat=True))
    record = Record(prompt="say hi", answer="hello world " * 5)  # 10 tokens + EOS = 11
    sample = prepare(record, encoder, block_length=4, max_answer_length=16, min_answer_length=4)
    assert sample.prompt_ids == (2, 6, 7, 3)  # chat template: <user> say hi <asst>
    assert sample.answer_ids == (4, 5, 4, 5, 4, 5, 4, 5)  # 11 -> 8: cut to a multiple of 4, EOS cut off
    short = Record(prompt="say hi", answer="hello world")  # 2 + EOS = 3 < one block
    assert prepare(short, encoder, 4, 16, 4) is None
    exact = Record(prompt="say", answer="hello world hi")  # 3 + EOS = 4: EOS kept
    assert prepare(exact, encoder, 4, 16, 4).answer_ids == (4, 5, 7, 1)


def test_prepare_without_chat_template_and_max_length():
    encoder = HFEncoder(_tokenizer(chat=False))
    sample = prepare(Record(prompt="say hi", answer="hi " * 30), encoder, 4, 8, 4)
    assert sample.prompt_ids == (6, 7) and sample.answer_ids == (7,) * 8
    with pytest.raises(CorpusError, match="multiple of block_length"):
        prepare(Record(prompt="a", answer="b"), encoder, 4, 6, 4)
    with pytest.raises(CorpusError, match="need a tokenizer"):
        prepare(Record(prompt="a", answer="b"), None, 4, 8, 4)


def test_mixed_chat_is_seeded_and_follows_the_weights():
    buckets = {"instruction": _ids_bucket(1, 2000), "qa": _ids_bucket(2, 2000), "code": _ids_bucket(3, 2000)}
    first = mixed_chat(buckets, 800, block_length=4, max_answer_length=8, seed=7)
    assert first == mixed_chat(buckets, 800, block_length=4, max_answer_length=8, seed=7)
    assert first != mixed_chat(buckets, 800, block_length=4, max_answer_length=8, seed=8)
    counts = Counter(s.bucket for s in first)
    # 0.50 / 0.25 / 0.25 of 800 draws: binomial standard deviations ~14 and ~12.
    assert abs(counts["instruction"] - 400) < 60 and abs(counts["qa"] - 200) < 50 and abs(counts["code"] - 200) < 50
    assert all(s.answer_ids == (0, 1, 2, 3, 4, 5, 6, 7) for s in first)  # 10 tokens cut to max 8


def test_mixed_chat_skips_short_records_and_reports_exhaustion():
    buckets = {"qa": _ids_bucket(2, 3, answer_length=3) + _ids_bucket(2, 2, answer_length=4)}
    samples = mixed_chat(buckets, 2, block_length=4, max_answer_length=8)
    assert len(samples) == 2 and all(len(s.answer_ids) == 4 for s in samples)
    with pytest.raises(CorpusError, match="only 2 usable records"):
        mixed_chat(buckets, 3, block_length=4, max_answer_length=8)
    with pytest.raises(CorpusError, match="name only the buckets"):
        mixed_chat(buckets, 1, weights={"code": 1.0})


def test_bucket_files_round_trip_and_errors(tmp_path):
    path = tmp_path / "b.jsonl"
    write_bucket(path, [{"prompt_ids": [1, 2], "answer_ids": [3, 4]}, {"prompt": "p", "answer": "a"}])
    records = read_bucket(path)
    assert records[0].prompt_ids == (1, 2) and records[1].answer == "a"
    path.write_text('{"prompt": "p", "answer": "a", "prompt_ids": [1]}\n')
    with pytest.raises(CorpusError, match=r"b.jsonl:1: a record has either"):
        read_bucket(path)
    path.write_text('{"prompt": "p", "answer": "a"}\nnot json\n')
    with pytest.raises(CorpusError, match=r"b.jsonl:2: not JSON"):
        read_bucket(path)
    with pytest.raises(CorpusError, match="does not exist"):
        read_bucket(tmp_path / "missing.jsonl")


def test_offline_corpus_is_shipped_with_its_licence():
    sizes = {name: len(read_bucket(OFFLINE_CORPUS_DIR / f"{name}.jsonl")) for name in ("instruction", "qa", "code")}
    assert all(size >= 100 for size in sizes.values()), sizes
    code = read_bucket(OFFLINE_CORPUS_DIR / "code.jsonl")
    assert all(r.answer.startswith(("def ", "async def ", "@")) and ":" in r.source for r in code)
    assert "PSF License Agreement" in (OFFLINE_CORPUS_DIR / "SOURCES.md").read_text()
    encoder = HFEncoder(_tokenizer(chat=True))
    buckets = {name: OFFLINE_CORPUS_DIR / f"{name}.jsonl" for name in sizes}
    assert len(mixed_chat(buckets, 20, encoder, block_length=4, max_answer_length=8)) == 20


def test_collect_converts_rows_and_refuses_without_datasets(tmp_path, monkeypatch):
    arc = {"question": "Which gas do plants take in for photosynthesis, mostly during the day?",
           "choices": {"label": ["A", "B"], "text": ["oxygen", "carbon dioxide"]}, "answerKey": "B"}
    (record,) = collect_module.convert("allenai/ai2_arc", [arc], limit=5, min_chars=50)
    assert record["answer"] == "B. carbon dioxide" and record["prompt"].endswith("B. carbon dioxide\nAnswer:")
    c4 = [{"text": "Short. x"}, {"text": "First sentence here. " + "More text. " * 30}]
    out = list(collect_module.convert("allenai/c4", c4, limit=1))
    assert len(out) == 1 and out[0]["prompt"] == "Continue the text: First sentence here."
    monkeypatch.setitem(sys.modules, "datasets", None)  # what a host without the package sees
    with pytest.raises(collect_module.CollectError, match="offline corpus"):
        collect_module.collect(tmp_path)
    assert not list(tmp_path.iterdir())


def test_pad_id_pads_answers_to_a_block_multiple_instead_of_cutting():
    record = Record(prompt_ids=(1,), answer_ids=(5, 6, 7, 8, 9))
    assert prepare(record, None, 4, 8, 4, pad_id=0).answer_ids == (5, 6, 7, 8, 9, 0, 0, 0)
    assert prepare(record, None, 4, 4, 4, pad_id=0).answer_ids == (5, 6, 7, 8)  # still capped at the maximum
    assert prepare(record, None, 4, 8, 4).answer_ids == (5, 6, 7, 8)


def test_embedded_training_split_is_a_bucket():
    from calibration.job import EMBEDDED_TRAIN_SPLIT, JobSettings
    from service.engine.loading import EMBEDDED_DIR, load_tokenizer

    settings = JobSettings()
    assert settings.bucket_paths() == {"train": str(EMBEDDED_TRAIN_SPLIT)} and settings.pads_answers
    assert not JobSettings(model="x").pads_answers and "code" in JobSettings(model="x").bucket_paths()
    tokenizer = load_tokenizer(EMBEDDED_DIR)
    end_of_turn, eos = tokenizer.convert_tokens_to_ids(["<|eot_id|>", "<|endoftext|>"])
    samples = mixed_chat(settings.bucket_paths(), 4, HFEncoder(tokenizer, eos_id=end_of_turn), block_length=32,
                         max_answer_length=64, pad_id=eos)
    for sample in samples:
        # 48 digits, then end of turn, then EOS padding to two blocks of 32 (the model's response length).
        assert len(sample.answer_ids) == 64 and sample.answer_ids[-1] == eos and end_of_turn in sample.answer_ids
        assert tokenizer.decode(sample.prompt_ids).rstrip().endswith("<|end_header_id|>")


def test_offline_corpus_builder_writes_buckets_and_sources(tmp_path):
    from calibration.offline_corpus import BUCKET_SIZES, write_corpus

    counts = write_corpus(tmp_path)
    assert set(counts) == set(BUCKET_SIZES) and all(100 <= counts[b] <= BUCKET_SIZES[b] for b in counts)
    code = read_bucket(tmp_path / "code.jsonl")
    assert code[0].answer.splitlines()[1].startswith("    ")  # indentation kept (dedent, not cleandoc)
    assert "PSF License Agreement" in (tmp_path / "SOURCES.md").read_text()
