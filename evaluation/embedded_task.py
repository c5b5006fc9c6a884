"""The embedded default model's task family ("digit ledger"): a seeded generator, the splits and the scoring.

Every question gives a list of ``LIST_LENGTH`` digits and names an operation; the answer is a list of the same
length, written as digits separated by single spaces:

- ``copy``: ``a[j] = x[j]``: copy the list (attend to one prompt position at a fixed offset).
- ``next``: ``a[j] = (x[j] + 1) % 10``: copy through a per-item mapping.
- ``sum``:  ``a[j] = (a[j-1] + x[j]) % 10`` with ``a[-1] = 0``: the running total mod 10. It needs the previous
  answer digit, so a model reveals it left to right, one position per step; later steps of a block reuse
  the cached prefix (the prompt and the earlier blocks), which is what makes cache reuse and its
  quantization matter.

Why this family (see issue 3 for the runs it replaces): key-value recall plateaued and word problems did not
start to learn within an hour on one CPU core, while attention by a fixed relative offset (RoPE) is learned
fast. The digit list is always the last thing in the user message and always ``LIST_LENGTH`` long, so the
distance from prompt digit ``x[j]`` to answer digit ``a[j]`` is the same in every question (the chat template's
tail after the message is constant); the instruction text before the list varies freely. With 48 digits the
answer (48 digit tokens, end of turn, EOS padding) spans two blocks of 32 tokens.

Scoring (``score``): exact match after removing all whitespace from the model's text (cut at the end of turn
by the engine) and from the reference, i.e. the same digits in the same order. In lm-eval terms: metric
``exact_match`` with ``regexes_to_ignore: ["\\s+"]``.

Splits: ``train`` is regenerated from its seed (unbounded: the training stream and the calibration corpus);
``validation`` and ``test`` come from their own seeds, are fixed and held out (with 10^48 possible lists, a
question shared with the training stream has probability ~0), and are shipped as JSONL in
``service/assets/embedded/task/`` together with a small ``train_sample`` for the calibration job
(``python -m evaluation.embedded_task`` rewrites them).

Decoding settings the model is trained for: ``GEN_LENGTH`` response positions in blocks of ``BLOCK_LENGTH``.

As an lm-eval task (:func:`embedded_task_configs`): ``digit_ledger``: the shipped held-out ``test`` split (``service/assets/embedded/task/test.jsonl``; ``validation``
as the validation split), 0-shot, the user message as prompt. The model is a chat model: run the task with
lm-eval's ``--apply_chat_template`` (in-process, and ``local-chat-completions`` over HTTP, where the server applies
the same template); the matrix always does.

Scoring is exact match after a filter that removes all whitespace from the response and from the reference
(:func:`normalize`, so only the digits and their order count); lm-eval's ``exact_match`` with
``regexes_to_ignore: ["\\s+"]`` applies exactly that to both sides. The response window is the task's
``GEN_LENGTH`` (64 positions: the answer's digits, the end of turn and EOS padding, two blocks of 32), rounded up
to whole blocks by both paths (`service.engine.params.response_length`). Stop strings: none; the engine cuts at
the end of turn / EOS.

The server never imports this module (it serves any model); the scripts that train, export and validate the
embedded model, the examples and evaluation do.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path

LIST_LENGTH = 48
GEN_LENGTH = 64
BLOCK_LENGTH = 32
OPS = ("copy", "next", "sum")
SPLIT_SEEDS = {"train": 1000, "validation": 2000, "test": 3000}
SPLIT_SIZES = {"validation": 96, "test": 192, "train_sample": 256}

# Several phrasings per operation, all ending in ":" right before the list, so that the model reads the
# operation from the words rather than from one fixed prompt string.
_INSTRUCTIONS = {
    "copy": ("copy:", "copy the digits:", "repeat these digits:"),
    "next": ("next:", "add one to each digit, mod 10:", "write each digit plus one:"),
    "sum": ("sum:", "running sum mod 10:", "running total of the digits, mod 10:"),
}
_WHITESPACE = re.compile(r"\s+")


@dataclass(frozen=True)
class Question:
    """One prompt-answer pair.

    Attributes:
        id: ``"{split}-{index}"``.
        op: one of ``OPS``.
        digits: the ``LIST_LENGTH`` prompt digits.
        prompt: the user message (apply the chat template to it).
        answer: the reference answer text: digits separated by single spaces.
    """

    id: str
    op: str
    digits: tuple[int, ...]
    prompt: str
    answer: str


def apply_op(op: str, digits: Sequence[int]) -> list[int]:
    """The answer digits of operation ``op`` on ``digits`` (see the module docstring).

    Raises:
        ValueError: ``op`` is not one of ``OPS``.
    """
    if op == "copy":
        return list(digits)
    if op == "next":
        return [(d + 1) % 10 for d in digits]
    if op == "sum":
        out, total = [], 0
        for d in digits:
            total = (total + d) % 10
            out.append(total)
        return out
    raise ValueError(f"unknown op {op!r}; legal: {', '.join(OPS)}")


def make_question(rng: random.Random, qid: str, op_weights: Sequence[float] | None = None,
                  digit_weights: Sequence[float] | None = None) -> Question:
    """Draw one question from ``rng``: the op by ``op_weights`` over ``OPS`` and the digits by ``digit_weights``
    over 0..9 (both default uniform; the held-out splits are uniform, the training curriculum is not)."""
    op = rng.choices(OPS, weights=op_weights)[0]
    if digit_weights is None:
        digits = tuple(rng.randrange(10) for _ in range(LIST_LENGTH))
    else:
        digits = tuple(rng.choices(range(10), weights=digit_weights, k=LIST_LENGTH))
    instruction = rng.choice(_INSTRUCTIONS[op])
    prompt = f"{instruction} {' '.join(map(str, digits))}"
    answer = " ".join(map(str, apply_op(op, digits)))
    return Question(qid, op, digits, prompt, answer)


def generate(split: str, count: int | None = None, seed: int | None = None,
             op_weights: Sequence[float] | None = None) -> Iterator[Question]:
    """Questions of ``split`` in a fixed order: the same ``(split, seed, op_weights)`` gives the same stream.

    Args:
        split: ``train``, ``validation`` or ``test`` (picks the default seed).
        count: how many; ``None`` = unbounded (only sensible for ``train``).
        seed: overrides the split's seed.
        op_weights: relative weights of ``OPS`` (the training curriculum); default uniform.

    Raises:
        ValueError: unknown split.
    """
    if split not in SPLIT_SEEDS:
        raise ValueError(f"unknown split {split!r}; legal: {', '.join(SPLIT_SEEDS)}")
    rng = random.Random(SPLIT_SEEDS[split] if seed is None else seed)
    index = 0
    while count is None or index < count:
        yield make_question(rng, f"{split}-{index}", op_weights)
        index += 1


def response_text(answer: str) -> str:
    """The text the model is trained to produce for ``answer``: a leading space, so that every answer digit is the
    same ``" d"`` token as in the prompt (without it the first digit is a different token, ``"d"``, and the
    running sum had to learn the step after it separately). Scoring ignores whitespace, so both forms match."""
    return " " + answer


def normalize(text: str) -> str:
    """The scoring filter: drop all whitespace (so only the digits and their order count)."""
    return _WHITESPACE.sub("", text)


def score(prediction: str, answer: str) -> bool:
    """Exact match of a model's response text against the reference answer, after ``normalize``."""
    return normalize(prediction) == normalize(answer)


def to_record(q: Question) -> dict:
    """A JSON-ready dict of ``q`` (digits as a list)."""
    rec = asdict(q)
    rec["digits"] = list(q.digits)
    return rec


def write_jsonl(questions: Sequence[Question], path: Path) -> None:
    """Write ``questions`` as JSONL (one ``to_record`` per line)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for q in questions:
            f.write(json.dumps(to_record(q)) + "\n")


def load_split(name: str) -> list[Question]:
    """The shipped split ``name`` (``validation``, ``test`` or ``train_sample``) from the package assets.

    Raises:
        ValueError: unknown name. FileNotFoundError: the assets were not generated.
    """
    if name not in SPLIT_SIZES:
        raise ValueError(f"unknown shipped split {name!r}; legal: {', '.join(SPLIT_SIZES)}")
    text = resources.files("service").joinpath(f"assets/embedded/task/{name}.jsonl").read_text()
    out = []
    for line in text.splitlines():
        rec = json.loads(line)
        out.append(Question(rec["id"], rec["op"], tuple(rec["digits"]), rec["prompt"], rec["answer"]))
    return out


def shipped_splits() -> dict[str, list[Question]]:
    """The splits shipped with the package, generated from their seeds (what ``write_shipped`` writes)."""
    return {
        "validation": list(generate("validation", SPLIT_SIZES["validation"])),
        "test": list(generate("test", SPLIT_SIZES["test"])),
        "train_sample": list(generate("train", SPLIT_SIZES["train_sample"])),
    }


def write_shipped(directory: Path) -> None:
    """(Re)write the shipped splits under ``directory`` (``service/assets/embedded/task``)."""
    for name, questions in shipped_splits().items():
        write_jsonl(questions, directory / f"{name}.jsonl")


#: Task names this module defines (and its multiple-choice variant, `evaluation.embedded_choice`).
EMBEDDED_TASKS: tuple[str, ...] = ("digit_ledger", "digit_ledger_choice")
#: The lm-eval task class of those tasks (`evaluation.chat_task`: refuses to run without the chat template); a
#: dotted path, so that this module does not import lm-eval.
CHAT_TASK_CLASS = "evaluation.chat_task.ChatTemplateTask"


def _split_file(name: str) -> Path:
    return Path(str(resources.files("service").joinpath(f"assets/embedded/task/{name}.jsonl")))


def task_data() -> dict:
    """The data fields of an lm-eval config over the shipped held-out splits (``validation``, ``test``).

    Raises:
        FileNotFoundError: the shipped split files are missing from the installed package.
    """
    from evaluation.tasks import OFFLINE_TAG

    files = {split: _split_file(split) for split in ("validation", "test")}
    for path in files.values():
        if not path.is_file():
            raise FileNotFoundError(f"embedded task split {path} is missing (service/assets/embedded/task)")
    return {"tag": [OFFLINE_TAG], "dataset_path": "json",
            "dataset_kwargs": {"data_files": {k: str(v) for k, v in files.items()}},
            "validation_split": "validation", "test_split": "test"}


def embedded_task_configs() -> dict[str, dict]:
    """``{"digit_ledger": <lm-eval task config>, "digit_ledger_choice": ...}`` (module docstring; the second is
    `evaluation.embedded_choice`), for `evaluation.tasks.write_task_dir`.

    Raises:
        FileNotFoundError: the shipped split files are missing from the installed package.
    """
    from evaluation.embedded_choice import choice_task_config

    return {
        "digit_ledger": {
            "task": "digit_ledger",
            "class": CHAT_TASK_CLASS,
            **task_data(),
            "output_type": "generate_until",
            "doc_to_text": "{{prompt}}",
            "doc_to_target": "{{answer}}",
            "num_fewshot": 0,
            "generation_kwargs": {"until": [], "max_gen_toks": GEN_LENGTH, "do_sample": False},
            "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                             "ignore_case": False, "ignore_punctuation": False, "regexes_to_ignore": ["\\s+"]}],
            "metadata": {"version": 1.0},
        },
        "digit_ledger_choice": {**choice_task_config(), "class": CHAT_TASK_CLASS},
    }

if __name__ == "__main__":
    write_shipped(Path(str(resources.files("service").joinpath("assets/embedded/task"))))
