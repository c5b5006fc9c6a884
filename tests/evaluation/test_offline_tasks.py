"""The offline task YAMLs load in lm-eval without a hub and score with lm-eval's own filters and metrics."""

import json

import lm_eval
import pytest
import yaml
from lm_eval.api.model import LM
from lm_eval.tasks import TaskManager

from evaluation.tasks import GSM8K_SAMPLE_DIR, LM_EVAL_TASKS, write_task_dir


class _ScriptedLM(LM):
    """Answers from a table keyed by the last question in the prompt (a stand-in for a model)."""

    def __init__(self, answers):
        super().__init__()
        self.answers, self.prompts = answers, []

    def generate_until(self, requests, disable_tqdm=False):
        out = []
        for req in requests:
            context, _ = req.args
            self.prompts.append(context)
            question = context.rsplit("Question: ", 1)[1].split("\nAnswer:")[0]
            out.append(self.answers[question])
        return out

    def loglikelihood(self, requests):
        raise AssertionError("not used")

    def loglikelihood_rolling(self, requests):
        raise AssertionError("not used")


@pytest.fixture(scope="module")
def task_manager(tmp_path_factory):
    return TaskManager(include_path=str(write_task_dir(tmp_path_factory.mktemp("tasks"))), include_defaults=False)


def _rows(name):
    return [json.loads(line) for line in (GSM8K_SAMPLE_DIR / f"{name}.jsonl").read_text().splitlines()]


def test_gsm8k_local_reuses_lm_evals_definition(tmp_path):
    cfg = yaml.safe_load((write_task_dir(tmp_path) / "gsm8k_local.yaml").read_text())
    assert cfg["include"] == str(LM_EVAL_TASKS / "gsm8k" / "gsm8k.yaml")
    assert cfg["dataset_path"] == "json"


@pytest.mark.integration  # lm-eval's evaluate reports its environment: torch's collect_env runs pip as a process
def test_gsm8k_local_scores_with_lm_evals_filters(task_manager, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    test = _rows("test")
    # Right answers for the first 3 problems (in GSM8K's "#### n" form), a wrong one for the 4th.
    answers = {r["question"]: " " + r["answer"] for r in test[:3]}
    answers[test[3]["question"]] = " The answer is 1.\n#### 1"
    model = _ScriptedLM(answers)
    res = lm_eval.simple_evaluate(model=model, tasks=["gsm8k_local"], task_manager=task_manager, limit=4)
    scores = res["results"]["gsm8k_local"]
    assert scores["exact_match,strict-match"] == pytest.approx(0.75)
    assert scores["exact_match,flexible-extract"] == pytest.approx(0.75)
    # 5-shot from the local train split, lm-eval's prompt format.
    train = _rows("train")
    assert model.prompts[0].count("Question: ") == 6
    assert sum(r["question"] in model.prompts[0] for r in train) == 5


def test_humaneval_local_needs_the_unsafe_code_confirmation(task_manager):
    with pytest.raises(ValueError, match="confirm_run_unsafe_code"):
        lm_eval.simple_evaluate(model="dummy", tasks=["humaneval_local"], task_manager=task_manager, limit=1)


def test_humaneval_local_has_all_164_problems_and_lm_evals_prompt(task_manager):
    obj = task_manager.load(["humaneval_local"])["tasks"]["humaneval_local"]
    docs = list(obj.test_docs())
    assert len(docs) == 164
    assert obj.doc_to_text(docs[0]) == docs[0]["prompt"]
    assert obj.config.generation_kwargs["until"] == ["\nclass", "\ndef", "\n#", "\nif", "\nprint"]


def test_the_embedded_tasks_refuse_to_run_without_the_chat_template(tmp_path):
    """Plain lm_eval on the embedded model's tasks without --apply_chat_template used to score 0 with no word: the
    tasks (their class, `evaluation.chat_task`) refuse to build requests without it, naming the flag, and build them
    with it."""
    from lm_eval.tasks import TaskManager

    from evaluation.embedded_task import EMBEDDED_TASKS, embedded_task_configs

    manager = TaskManager(include_path=str(write_task_dir(tmp_path, extra=embedded_task_configs())),
                          include_defaults=False)
    tasks = manager.load(list(EMBEDDED_TASKS))["tasks"]
    for name in EMBEDDED_TASKS:
        task = tasks[name]
        with pytest.raises(ValueError, match=f"task {name}: .* without --apply_chat_template every answer is wrong"):
            task.build_all_requests(limit=1)
        task.build_all_requests(limit=1, apply_chat_template=True,
                                chat_template=lambda turns, add_generation_prompt=True: turns[-1]["content"])
        assert task.instances
