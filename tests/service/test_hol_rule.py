"""The head-of-line rule (issue 34, `service.runtime.scheduler.first_passes_first`): a request's first pass runs in
an iteration without the running requests' passes, and a running request waits at most one iteration in a row."""

from __future__ import annotations

from dataclasses import dataclass

from service.runtime.scheduler import Hold, first_passes_first


@dataclass(frozen=True)
class _Pass:
    cohort: str
    kind: str = "window"


def _run(passes, hold):
    run, hold = first_passes_first([_Pass(c) for c in passes], hold)
    return [p.cohort for p in run], hold


def test_a_first_pass_runs_without_the_running_requests_passes():
    run, hold = _run(["long"], Hold())
    assert run == ["long"]  # the first iteration: everybody's first pass
    run, hold = _run(["long"], hold)
    assert run == ["long"]
    run, hold = _run(["long", "short"], hold)
    assert run == ["short"] and hold.held == {"long"}
    run, hold = _run(["long"], hold)  # the short one finished in one pass
    assert run == ["long"]


def test_a_running_request_waits_at_most_one_iteration_in_a_row():
    seen_runs = []  # a new request in every iteration: a waits for c, runs beside d (it waited before), ...
    run, hold = _run(["a", "b"], Hold(frozenset({"a", "b"})))
    for new in ("c", "d", "e", "f"):
        run, hold = _run(["a", "b", new], hold)
        assert new in run
        seen_runs.append("a" in run)
    assert seen_runs == [False, True, False, True]


def test_no_first_pass_holds_nothing_and_a_cohort_that_left_is_forgotten():
    hold = Hold(frozenset({"a", "b", "gone"}), frozenset({"gone"}))
    run, hold = _run(["a", "b"], hold)
    assert run == ["a", "b"] and hold == Hold(frozenset({"a", "b"}), frozenset())
