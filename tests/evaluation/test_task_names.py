"""`evaluation.matrix.tasks_named_nowhere`: ``evaluate matrix --tasks`` refuses a name no task file holds after a
scan of lm-eval's task YAML text, not after lm-eval's TaskManager indexes them all (a minute on a small CPU); a
name that is some task, group or tag is never refused by it."""

from __future__ import annotations

from evaluation.embedded_task import embedded_task_configs
from evaluation.matrix import tasks_named_nowhere
from evaluation.tasks import write_task_dir


def test_only_names_in_no_task_file_are_certainly_unknown(tmp_path):
    include = str(write_task_dir(tmp_path / "tasks", extra=embedded_task_configs()))  # as `evaluate matrix` does
    # ours (digit_ledger), an lm-eval task (arc_easy), an lm-eval group (mmlu), and two names nothing defines
    asked = ["nosuchtask", "digit_ledger", "arc_easy", "mmlu", "gsm8k", "no_such_task_either"]
    assert tasks_named_nowhere(asked, include) == ["nosuchtask", "no_such_task_either"]
    assert tasks_named_nowhere(["digit_ledger"], include) == []
    assert tasks_named_nowhere(["arc_easy"], None) == []
