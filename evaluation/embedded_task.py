"""The embedded default model's own task ("digit ledger", `service.embedded_task`) as an lm-eval task.

``digit_ledger``: the shipped held-out ``test`` split (``service/assets/embedded/task/test.jsonl``; ``validation``
as the validation split), 0-shot, the user message as prompt. The model is a chat model: run the task with
lm-eval's ``--apply_chat_template`` (in-process, and ``local-chat-completions`` over HTTP, where the server applies
the same template); the matrix always does.

Scoring is exact match after a filter that removes all whitespace from the response and from the reference
(`service.embedded_task.normalize`, so only the digits and their order count); lm-eval's ``exact_match`` with
``regexes_to_ignore: ["\\s+"]`` applies exactly that to both sides. The response window is the task's
``GEN_LENGTH`` (64 positions: the answer's digits, the end of turn and EOS padding, two blocks of 32), rounded up
to whole blocks by both paths (`service.engine.params.response_length`). Stop strings: none; the engine cuts at
the end of turn / EOS.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

#: Task names this module defines.
EMBEDDED_TASKS: tuple[str, ...] = ("digit_ledger",)


def _split_file(name: str) -> Path:
    return Path(str(resources.files("service").joinpath(f"assets/embedded/task/{name}.jsonl")))


def embedded_task_configs() -> dict[str, dict]:
    """``{"digit_ledger": <lm-eval task config>}`` (module docstring), for `evaluation.tasks.write_task_dir`.

    Raises:
        FileNotFoundError: the shipped split files are missing from the installed package.
    """
    from evaluation.tasks import OFFLINE_TAG
    from service.embedded_task import GEN_LENGTH

    files = {split: _split_file(split) for split in ("validation", "test")}
    for path in files.values():
        if not path.is_file():
            raise FileNotFoundError(f"embedded task split {path} is missing (service/assets/embedded/task)")
    return {
        "digit_ledger": {
            "task": "digit_ledger",
            "tag": [OFFLINE_TAG],
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {k: str(v) for k, v in files.items()}},
            "validation_split": "validation",
            "test_split": "test",
            "output_type": "generate_until",
            "doc_to_text": "{{prompt}}",
            "doc_to_target": "{{answer}}",
            "num_fewshot": 0,
            "generation_kwargs": {"until": [], "max_gen_toks": GEN_LENGTH, "do_sample": False},
            "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                             "ignore_case": False, "ignore_punctuation": False, "regexes_to_ignore": ["\\s+"]}],
            "metadata": {"version": 1.0},
        }
    }
