"""`service.runtime.scheduler.plan_admission`, the scheduler's admission as a pure function of costs and times: first come
first served, backfill behind a blocked head for a bounded time, then memory reserved for the head (issue 22
item 5). Times are the function's arguments, not a clock."""

from __future__ import annotations

from service.runtime.scheduler import Cost, fits, plan_admission

BUDGET = 100
SMALL, MEDIUM, LARGE = Cost(10, 5), Cost(40, 5), Cost(90, 10)


def test_first_come_first_served_while_requests_fit():
    chosen, head = plan_admission([(SMALL, None), (MEDIUM, None), (SMALL, None)], [], BUDGET, now=0.0)
    assert chosen == [0, 1, 2] and head is None
    assert plan_admission([(LARGE, None)], [], 50, now=0.0) == ([0], None)  # alone, a request always runs


def test_a_blocked_head_lets_smaller_requests_that_fit_pass_until_the_bound():
    waiting = [(LARGE, 0.0), (SMALL, None), (LARGE, None), (SMALL, None)]
    chosen, head = plan_admission(waiting, [MEDIUM], BUDGET, now=1.0, backfill_s=2.0)
    assert head == 0 and chosen == [1, 3]  # the second large one is no smaller than the head: it waits
    # the bound has passed: memory is reserved for the head, nobody passes it
    assert plan_admission(waiting, [MEDIUM], BUDGET, now=2.0, backfill_s=2.0) == ([], 0)
    # without backfill: strictly first come, first served
    assert plan_admission(waiting, [MEDIUM], BUDGET, now=1.0, backfill_s=None) == ([], 0)
    # once the running request leaves, the head starts
    assert plan_admission(waiting, [], BUDGET, now=3.0, backfill_s=2.0)[0][0] == 0


def test_the_forward_reserve_and_the_row_cap_count():
    assert fits([MEDIUM], MEDIUM, BUDGET) and not fits([MEDIUM], MEDIUM, BUDGET, reserve=25)
    chosen, head = plan_admission([(SMALL, None)] * 5, [SMALL], BUDGET, now=0.0, max_rows=3)
    assert chosen == [0, 1] and head is None
