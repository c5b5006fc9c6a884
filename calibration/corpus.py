"""The calibration corpus: prompt-answer buckets on disk and the paper's ``mixed_chat`` loader.

Paper, "Experimental Setup": "we use the chat-style mixed_chat loader: it samples prompt-answer pairs from the
instruction, QA, and code buckets with weights 0.50, 0.25, and 0.25, respectively, applies the model chat template
to prompts when available, appends EOS to answers when available, and truncates answers to a multiple of the
block length."

Bucket files are JSON Lines, one record per line, in one of two forms:

* text: ``{"prompt": str, "answer": str, "source": str (optional)}``; needs a tokenizer;
* token ids: ``{"prompt_ids": [int, ...], "answer_ids": [int, ...], "source": str (optional)}``; for checkpoints
  without tokenizer files (the golden tiny ones). Ids are used as they are: no template, no EOS added.

Any prompt-answer JSONL in either form can be a bucket (for example the embedded model's training split).
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

#: The paper's bucket weights ("Experimental Setup").
MIXED_CHAT_WEIGHTS: dict[str, float] = {"instruction": 0.50, "qa": 0.25, "code": 0.25}

#: The offline corpus shipped with the project (see ``calibration/data/offline/SOURCES.md``).
OFFLINE_CORPUS_DIR = Path(__file__).parent / "data" / "offline"


class CorpusError(ValueError):
    """A bucket file or loader setting is unusable; the message names the file, line or setting."""


@dataclass(frozen=True)
class Record:
    """One prompt-answer pair as stored in a bucket file (text or token ids, never both)."""

    prompt: str | None = None
    answer: str | None = None
    prompt_ids: tuple[int, ...] | None = None
    answer_ids: tuple[int, ...] | None = None
    source: str = ""

    @property
    def is_tokenized(self) -> bool:
        return self.prompt_ids is not None


@dataclass(frozen=True)
class Sample:
    """A calibration sample: token ids ready for TRACE.

    Attributes:
        prompt_ids: the prompt, chat template applied when the tokenizer has one.
        answer_ids: the answer, EOS appended when known, cut to a multiple of the block length (>= one block).
        bucket: the bucket it was drawn from; source: the record's ``source`` field.
    """

    prompt_ids: tuple[int, ...]
    answer_ids: tuple[int, ...]
    bucket: str
    source: str = ""


class Encoder(Protocol):
    """What the loader needs from a tokenizer (see :class:`HFEncoder`)."""

    def encode_prompt(self, text: str) -> list[int]: ...

    def encode_answer(self, text: str) -> list[int]: ...

    @property
    def eos_id(self) -> int | None: ...


class HFEncoder:
    """Wraps a Hugging Face tokenizer: chat template on prompts when it has one, no special tokens on answers.

    Args:
        tokenizer: a ``transformers`` tokenizer.
        eos_id: the id appended to answers (LLaDA-Instruct's end of turn or the model's EOS); ``None`` takes
            ``tokenizer.eos_token_id``.
    """

    def __init__(self, tokenizer: Any, eos_id: int | None = None) -> None:
        self.tokenizer = tokenizer
        self._eos_id = eos_id if eos_id is not None else tokenizer.eos_token_id

    @property
    def eos_id(self) -> int | None:
        return self._eos_id

    def encode_prompt(self, text: str) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None):
            messages = [{"role": "user", "content": text}]
            from service.engine.prompts import token_ids  # a list in transformers 4, a mapping in 5

            return token_ids(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_answer(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def read_bucket(path: str | Path) -> list[Record]:
    """Read one bucket file (schema in the module docstring).

    Raises:
        CorpusError: missing file, bad JSON, or a record with neither or both forms, or empty fields; the
            message gives the file and line number.
    """
    path = Path(path)
    if not path.is_file():
        raise CorpusError(f"bucket file {path} does not exist")
    records = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as error:
                raise CorpusError(f"{path}:{number}: not JSON ({error})") from error
            records.append(_record(raw, f"{path}:{number}"))
    if not records:
        raise CorpusError(f"bucket file {path} holds no records")
    return records


def write_bucket(path: str | Path, records: Sequence[Mapping[str, Any]]) -> None:
    """Write records as JSON Lines through a temporary file, so a failure never leaves half a bucket."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as handle:
        for record in records:
            handle.write(json.dumps(dict(record), ensure_ascii=False) + "\n")
    tmp.replace(path)


def _record(raw: Any, where: str) -> Record:
    if not isinstance(raw, dict):
        raise CorpusError(f"{where}: a record must be a JSON object")
    text = "prompt" in raw or "answer" in raw
    ids = "prompt_ids" in raw or "answer_ids" in raw
    if text == ids:
        raise CorpusError(f"{where}: a record has either 'prompt'+'answer' (text) or 'prompt_ids'+'answer_ids'")
    source = str(raw.get("source", ""))
    if text:
        prompt, answer = raw.get("prompt"), raw.get("answer")
        if not isinstance(prompt, str) or not isinstance(answer, str) or not answer:
            raise CorpusError(f"{where}: 'prompt' and 'answer' must be strings, the answer non-empty")
        return Record(prompt=prompt, answer=answer, source=source)
    prompt_ids, answer_ids = raw.get("prompt_ids"), raw.get("answer_ids")
    for name, value in (("prompt_ids", prompt_ids), ("answer_ids", answer_ids)):
        if not isinstance(value, list) or not all(isinstance(x, int) and x >= 0 for x in value):
            raise CorpusError(f"{where}: '{name}' must be a list of non-negative ints")
    if not answer_ids:
        raise CorpusError(f"{where}: 'answer_ids' is empty")
    return Record(prompt_ids=tuple(prompt_ids), answer_ids=tuple(answer_ids), source=source)


def prepare(
    record: Record,
    encoder: Encoder | None,
    block_length: int,
    max_answer_length: int,
    min_answer_length: int,
    bucket: str = "",
    pad_id: int | None = None,
) -> Sample | None:
    """Turn one record into a sample, or ``None`` when the minimum-length filter drops it.

    Text records: prompt through ``encoder.encode_prompt`` (chat template), answer through ``encode_answer``
    with EOS appended when the encoder knows one. Then (both forms) the answer is cut to at most
    ``max_answer_length`` tokens and down to a multiple of ``block_length`` (the paper); with ``pad_id`` it is
    instead padded with that id up to the next multiple (LLaDA's SFT convention of EOS-padding answers to the
    response length, for a model trained that way). A result shorter than ``min_answer_length`` tokens (and in
    any case an empty one) is dropped.

    Raises:
        CorpusError: a text record without an encoder, or lengths that are not multiples of the block length.
    """
    if block_length <= 0 or max_answer_length % block_length or max_answer_length <= 0:
        raise CorpusError(
            f"max_answer_length ({max_answer_length}) must be a positive multiple of block_length ({block_length})"
        )
    if record.is_tokenized:
        prompt, answer = list(record.prompt_ids), list(record.answer_ids)
    else:
        if encoder is None:
            raise CorpusError("text records need a tokenizer; use token-id records for checkpoints without one")
        prompt = encoder.encode_prompt(record.prompt)
        answer = encoder.encode_answer(record.answer)
        if encoder.eos_id is not None:
            answer.append(encoder.eos_id)
    if pad_id is not None:
        answer += [pad_id] * (-len(answer) % block_length)
    answer = answer[:max_answer_length]
    answer = answer[: len(answer) - len(answer) % block_length]
    if not prompt or not answer or len(answer) < min_answer_length:
        return None
    return Sample(tuple(prompt), tuple(answer), bucket, record.source)


def mixed_chat(
    buckets: Mapping[str, str | Path | Sequence[Record]],
    num_samples: int,
    encoder: Encoder | None = None,
    *,
    block_length: int = 32,
    max_answer_length: int = 64,
    min_answer_length: int | None = None,
    weights: Mapping[str, float] | None = None,
    seed: int = 0,
    pad_id: int | None = None,
) -> list[Sample]:
    """The paper's ``mixed_chat`` loader: ``num_samples`` samples drawn from weighted buckets, seeded.

    Each draw picks a bucket with probability proportional to its weight (``MIXED_CHAT_WEIGHTS`` by default,
    restricted to the buckets given; a bucket not in the weights gets weight 1 if it is the only one), then the
    next record of that bucket in a seeded shuffle, skipping records the length filter drops (:func:`prepare`).
    A bucket that runs out is taken out of the draw. Same inputs and seed give the same samples.

    Args:
        buckets: bucket name -> JSONL path or already-read records.
        num_samples: how many samples to return.
        encoder: tokenizer wrapper for text records (``None`` for token-id corpora).
        block_length: answers are cut to a multiple of it.
        max_answer_length: longest answer kept, a multiple of ``block_length`` (the generation length).
        min_answer_length: shortest answer kept after cutting; default one block.
        weights: bucket name -> weight.
        seed: seed of the bucket draws and shuffles.
        pad_id: pad answers up to a block multiple with this id instead of cutting them (:func:`prepare`).

    Raises:
        CorpusError: unknown/negative weights, or fewer usable records than ``num_samples``.
    """
    if num_samples <= 0:
        raise CorpusError(f"num_samples must be positive, got {num_samples}")
    if not buckets:
        raise CorpusError("no buckets given")
    min_answer_length = block_length if min_answer_length is None else min_answer_length
    weights = dict(weights) if weights is not None else {
        name: MIXED_CHAT_WEIGHTS.get(name, 1.0 if len(buckets) == 1 else 0.0) for name in buckets
    }
    unknown = sorted(set(weights) - set(buckets))
    if unknown or any(w < 0 for w in weights.values()) or not any(weights.get(b, 0) > 0 for b in buckets):
        raise CorpusError(
            f"weights {weights} must be non-negative, name only the buckets {sorted(buckets)}, "
            f"and give at least one a positive weight"
        )
    rng = random.Random(seed)
    queues = {}
    for name in sorted(buckets):
        if weights.get(name, 0.0) <= 0:
            continue
        source = buckets[name]
        records = list(source) if isinstance(source, Sequence) and not isinstance(source, str) else read_bucket(source)
        order = list(range(len(records)))
        rng.shuffle(order)
        queues[name] = [records[i] for i in order]
    samples: list[Sample] = []
    while len(samples) < num_samples:
        live = [name for name in sorted(queues) if queues[name]]
        if not live:
            raise CorpusError(
                f"the buckets hold only {len(samples)} usable records (answers of >= {min_answer_length} tokens "
                f"after cutting), fewer than the {num_samples} asked for"
            )
        name = rng.choices(live, weights=[weights[n] for n in live])[0]
        sample = prepare(queues[name].pop(0), encoder, block_length, max_answer_length, min_answer_length, name,
                         pad_id)
        if sample is not None:
            samples.append(sample)
    return samples
