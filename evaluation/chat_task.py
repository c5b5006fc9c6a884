"""The lm-eval task class of the embedded model's tasks (`evaluation.embedded_task.EMBEDDED_TASKS`): a chat task
that refuses to build its requests without lm-eval's ``--apply_chat_template``.

The embedded model answers only chat turns: without the template every ``digit_ledger`` answer is wrong and the
task scores 0, with nothing else to say so. The project's launcher refuses such a run before lm-eval starts
(`evaluation.cli.check_chat_template`); this class makes plain ``lm_eval`` refuse it too, naming the flag. The task
YAMLs name it with ``class: !function evaluation.chat_task.ChatTemplateTask`` (`evaluation.tasks.write_task_dir`).
"""

from __future__ import annotations

from typing import Any

from lm_eval.api.task import ConfigurableTask


class ChatTemplateTask(ConfigurableTask):
    """A `ConfigurableTask` whose requests are built only with the chat template applied.

    Raises (from :meth:`build_all_requests`): ValueError naming ``--apply_chat_template`` when lm-eval was run
    without it.
    """

    def __init__(self, config: dict[str, Any] | None = None, **kwargs: Any) -> None:
        # The ``class`` key chose this class; lm-eval's TaskConfig has no such field.
        super().__init__(config={k: v for k, v in (config or {}).items() if k != "class"}, **kwargs)

    def build_all_requests(self, *args: Any, apply_chat_template: bool = False, **kwargs: Any) -> None:
        if not apply_chat_template:
            raise ValueError(f"task {self.config.task}: the embedded model answers only chat turns, so without "
                             "--apply_chat_template every answer is wrong and the task scores 0; add "
                             "--apply_chat_template")
        return super().build_all_requests(*args, apply_chat_template=apply_chat_template, **kwargs)
