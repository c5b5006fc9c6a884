"""TRACE: schedules, the min-cost flow against brute force, rollout, the score matrix and the refinement loop."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from calibration.trace import (
    Schedule,
    ScheduleError,
    Trajectory,
    initial_assignment,
    rollout,
    score_matrix,
    solve_assignment,
    trace,
)

MASK = 9


def _brute_force(scores: np.ndarray, schedule: Schedule) -> float:
    best = -np.inf
    for assignment in itertools.product(*(schedule.window(i) for i in range(schedule.answer_length))):
        counts = np.bincount(assignment, minlength=schedule.num_steps)
        if tuple(counts) == schedule.budgets:
            best = max(best, scores[np.arange(len(assignment)), assignment].sum())
    return best


def test_budgets_follow_the_block_schedule():
    assert Schedule.from_blocks(8, 4, 2).budgets == (2, 2, 2, 2)
    schedule = Schedule.from_blocks(8, 4, 3)
    assert schedule.budgets == (2, 1, 1, 2, 1, 1) and sum(schedule.budgets) == 8
    assert list(schedule.window(5)) == [3, 4, 5]
    assert initial_assignment(schedule) == (0, 0, 1, 2, 3, 3, 4, 5)


@pytest.mark.parametrize("answer_length, block_length, steps, budgets, message", [
    (6, 4, 2, None, "multiple of block_length"),
    (8, 4, 0, None, "must be positive"),
    (8, 4, 2, (2, 2, 3, 1, 0), "one budget per step"),
    (8, 4, 2, (3, 2, 2, 1), "block 0: budgets \\[3, 2\\]"),
    (8, 4, 2, (5, -1, 2, 2), "non-negative"),
])
def test_infeasible_schedules_are_refused(answer_length, block_length, steps, budgets, message):
    with pytest.raises(ScheduleError, match=message):
        if budgets is None:
            Schedule.from_blocks(answer_length, block_length, steps)
        else:
            Schedule(answer_length, block_length, steps, budgets)


@pytest.mark.parametrize("schedule", [
    Schedule.from_blocks(6, 3, 2),
    Schedule.from_blocks(8, 4, 3),
    Schedule(6, 3, 3, (0, 2, 1, 3, 0, 0)),
    Schedule(7, 7, 3, (3, 1, 3)),
])
def test_flow_equals_brute_force_optimum(schedule):
    rng = np.random.default_rng(schedule.answer_length + sum(schedule.budgets[:2]))
    for _ in range(5):
        scores = np.log(rng.uniform(0.01, 1.0, size=(schedule.answer_length, schedule.num_steps)))
        assignment = solve_assignment(scores, schedule)
        for i, step in enumerate(assignment):  # every token exactly one step, inside its window
            assert step in schedule.window(i)
        assert tuple(np.bincount(assignment, minlength=schedule.num_steps)) == schedule.budgets
        value = scores[np.arange(schedule.answer_length), assignment].sum()
        assert value == pytest.approx(_brute_force(scores, schedule), abs=1e-5)


def test_ties_keep_the_previous_assignment_and_real_gains_still_win():
    schedule = Schedule.from_blocks(6, 3, 3)
    previous = (2, 1, 0, 5, 4, 3)
    flat = np.full((6, 6), -0.5)  # every feasible assignment ties
    assert solve_assignment(flat, schedule, previous=previous) == previous
    better = flat.copy()
    better[0, 0] = better[2, 2] = -0.4999  # swapping tokens 0 and 2 gains 2e-4 nats: more than any tie bonus
    assert solve_assignment(better, schedule, previous=previous) == (0, 1, 2, 5, 4, 3)
    rng = np.random.default_rng(5)
    for _ in range(5):  # the tie bonus never changes the optimum's value
        scores = np.log(rng.uniform(0.01, 1.0, size=(6, 6)))
        value = scores[np.arange(6), solve_assignment(scores, schedule, previous=previous)].sum()
        assert value == pytest.approx(_brute_force(scores, schedule), abs=1e-5)


def test_flow_refuses_non_finite_legal_scores_and_bad_assignments():
    schedule = Schedule.from_blocks(4, 2, 2)
    scores = np.zeros((4, 4))
    scores[1, 0] = -np.inf
    with pytest.raises(ScheduleError, match="token 1 at legal step 0"):
        solve_assignment(scores, schedule)
    with pytest.raises(ScheduleError, match="outside its window"):
        schedule.check((0, 1, 0, 3))
    with pytest.raises(ScheduleError, match="differ from the budgets"):
        schedule.check((0, 0, 2, 3))


def test_rollout_reveals_tokens_assigned_to_earlier_steps():
    schedule = Schedule.from_blocks(4, 2, 2)
    states = rollout([7, 8], [1, 2, 3, 4], (1, 0, 2, 3), schedule, MASK)
    assert states.tolist() == [
        [7, 8, MASK, MASK, MASK, MASK],
        [7, 8, MASK, 2, MASK, MASK],
        [7, 8, 1, 2, MASK, MASK],
        [7, 8, 1, 2, 3, MASK],
    ]


class _Bidirectional(torch.nn.Module):
    """A tiny model where every position sees every other (mean pooling), so S[i, t] depends on the state."""

    def __init__(self, vocab: int = 10) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(vocab, 8, generator=generator))
        self.mix = torch.nn.Parameter(torch.randn(8, 8, generator=generator))
        self.head = torch.nn.Parameter(torch.randn(8, vocab, generator=generator))
        self.calls = 0

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.calls += ids.shape[0]
        hidden = self.embed[ids]
        context = torch.tanh(hidden.mean(dim=1, keepdim=True) @ self.mix)
        return (hidden + 3 * context) @ self.head


def test_score_matrix_masks_the_scored_position_even_when_revealed():
    model = _Bidirectional()
    prompt, answer = [5, 6, 7], [1, 2, 3, 4]
    schedule = Schedule.from_blocks(4, 2, 2)
    assignment = (0, 1, 2, 3)
    scores = score_matrix(prompt, answer, assignment, schedule, MASK, model, batch_size=3)
    states = rollout(prompt, answer, assignment, schedule, MASK)
    for i in range(4):
        for step in range(4):
            if step not in schedule.window(i):
                assert scores[i, step] == -np.inf
                continue
            state = states[step].clone()
            state[3 + i] = MASK
            expected = torch.log_softmax(model(state[None]), -1)[0, 3 + i, answer[i]].item()
            assert scores[i, step] == pytest.approx(expected, abs=1e-6)
    # Token 0 is revealed at step 1 (assigned to step 0), so it needed a forward of its own there.
    assert scores[0, 1] != scores[1, 1]


def test_trace_returns_a_legal_trajectory_with_only_the_listed_fields():
    model = _Bidirectional()
    result = trace([5, 6, 7], [1, 2, 3, 4, 2, 1], model, MASK, "fp", steps_per_block=3, block_length=3,
                   max_rounds=3, batch_size=4)
    result.schedule.check(result.assignment)
    assert 1 <= result.rounds <= 3 and len(result.objectives) == result.rounds
    assert set(Trajectory.model_fields) == {
        "prompt_ids", "answer_ids", "assignment", "block_length", "steps_per_block", "budgets",
        "model_fingerprint", "rounds", "objectives", "settled"}
    assert Trajectory.model_validate_json(result.model_dump_json()) == result
    # Same inputs, same trajectory (deterministic initializer and solver).
    again = trace([5, 6, 7], [1, 2, 3, 4, 2, 1], model, MASK, "fp", steps_per_block=3, block_length=3)
    assert again == result


def test_trace_stops_when_the_assignment_is_stable():
    def position_only(ids: torch.Tensor) -> torch.Tensor:
        # Context-free logits: S[i, t] is the same for every t, so every assignment ties and round 1 keeps the
        # initial one: stable after one round.
        generator = torch.Generator().manual_seed(1)
        table = torch.randn(ids.shape[1], 10, generator=generator)
        return table.expand(ids.shape[0], -1, -1)

    result = trace([5], [1, 2, 3, 4], position_only, MASK, "fp", steps_per_block=2, block_length=2, max_rounds=3)
    assert result.rounds == 1 and result.assignment == initial_assignment(result.schedule) and result.settled
    with pytest.raises(ScheduleError, match="multiple of block_length"):
        trace([5], [1, 2, 3], position_only, MASK, "fp", block_length=2)
