"""``digit_ledger_choice``: a multiple-choice (``loglikelihood``) variant of the embedded model's task.

Each held-out question of ``digit_ledger`` (`evaluation.embedded_task`, the shipped ``test`` split) becomes "which
of four answers is right": the answer of the question's own operation, the answers of the two other operations
on the same digits, and the right answer with one digit changed, in an order fixed by the question's id. lm-eval
scores each answer by the model's log-likelihood of it after the prompt (in-process: the Monte-Carlo ELBO of
`evaluation.likelihood`; over HTTP: the server's echo + logprobs completions, the same estimate) and counts the
question right when the right answer scores highest (``acc``). Like ``digit_ledger`` it is a chat task: run it with
``--apply_chat_template``. Answers are written as the model writes them (`evaluation.embedded_task.response_text`).
"""

from __future__ import annotations

import random

from evaluation.embedded_task import OPS, apply_op, response_text, task_data

#: The task's name.
TASK = "digit_ledger_choice"


def choices_of(doc: dict) -> tuple[list[str], int]:
    """The four answers of a ``digit_ledger`` record (``id``, ``op``, ``digits``) and the index of the right one.

    Distractors: the other operations' answers on the same digits, and the right answer with the digit at a
    position drawn from the id changed by 5 (mod 10); all four differ (the changed digit makes the last one
    differ from the right one; an operation's answer that equals another's is replaced by a second changed digit).
    """
    rng = random.Random(doc["id"])
    right = apply_op(doc["op"], doc["digits"])
    answers = [right] + [apply_op(op, doc["digits"]) for op in OPS if op != doc["op"]]
    for _ in range(2):
        changed = list(right)
        at = rng.randrange(len(changed))
        changed[at] = (changed[at] + 5) % 10
        answers.append(changed)
    unique: list[list[int]] = []
    for answer in answers:
        if answer not in unique and len(unique) < 4:
            unique.append(answer)
    order = list(range(4))
    rng.shuffle(order)
    texts = [response_text(" ".join(map(str, unique[k]))) for k in order]
    return texts, order.index(0)


def process_docs(dataset):
    """lm-eval's ``process_docs``: add ``choices`` and ``label`` to every question."""

    def add(doc: dict) -> dict:
        texts, label = choices_of(doc)
        return {**doc, "choices": texts, "label": label}

    return dataset.map(add)


def choice_task_config() -> dict:
    """The lm-eval config of ``digit_ledger_choice`` (registered by `evaluation.embedded_task.embedded_task_configs`).

    Raises:
        FileNotFoundError: the shipped split files are missing from the installed package.
    """
    from evaluation.tasks import _Function

    return {
        "task": TASK,
        **task_data(),
        "process_docs": _Function(f"{__name__}.process_docs"),
        "output_type": "multiple_choice",
        "doc_to_text": "{{prompt}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{label}}",
        "target_delimiter": "",
        "num_fewshot": 0,
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
        "metadata": {"version": 1.0},
    }
