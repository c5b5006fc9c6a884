"""TRACE: reconstruct a dLLM reveal trajectory for a prompt-answer pair by rollout and min-cost flow.

Paper, "TRACE Trajectory Calibration" and "TRACE Flow Construction". For an answer ``y`` of ``L`` tokens cut into
blocks, every answer token ``y_i`` gets one reveal step in its legal window ``W_i`` (the steps of its block), and
every step ``t`` receives exactly its reveal budget ``k_t`` tokens (``sum_t k_t = L``). Starting from a
deterministic schedule-consistent assignment, each refinement round

1. rolls out the masked states ``x_t`` of the current assignment (state ``t`` is the sequence *before* step ``t``
   reveals: answer tokens assigned to steps ``< t`` are revealed, all others are ``<mask>``);
2. scores ``S[i, t] = log p(y_i | p, x_t)`` for legal pairs from full-recompute forwards, where position ``i`` is
   masked in the forward even when the state has already revealed it (issue 6: a revealed token is scored as if
   it were not), so ``S[i, t]`` is the log-probability of unmasking ``y_i`` at step ``t``;
3. solves the next assignment as a min-cost flow (source -> token, capacity 1, cost 0; token -> legal step,
   capacity 1, cost ``-S`` scaled to integers; step -> sink, capacity ``k_t``), with ``networkx``;

until the assignment stops changing or the round limit is reached. Prompt tokens are never flow items.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import networkx as nx
import numpy as np
import torch
from pydantic import BaseModel, ConfigDict

#: Multiplier that turns log-probabilities (nats) into the integer edge costs networkx's simplex needs exactly.
COST_SCALE = 1_000_000


class ScheduleError(ValueError):
    """A block schedule that no assignment can satisfy; the message says which rule fails."""


@dataclass(frozen=True)
class Schedule:
    """The block schedule of one answer: blocks of ``block_length`` tokens, ``steps_per_block`` reveal steps each.

    Steps are numbered globally: block ``b`` owns steps ``[b * steps_per_block, (b + 1) * steps_per_block)``.

    Attributes:
        answer_length: ``L``, a multiple of ``block_length``.
        block_length: tokens per block.
        steps_per_block: reveal steps per block.
        budgets: ``k_t`` for every global step; each block's budgets sum to ``block_length``.
    """

    answer_length: int
    block_length: int
    steps_per_block: int
    budgets: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.block_length <= 0 or self.steps_per_block <= 0:
            raise ScheduleError(
                f"block_length ({self.block_length}) and steps_per_block ({self.steps_per_block}) must be positive"
            )
        if self.answer_length <= 0 or self.answer_length % self.block_length:
            raise ScheduleError(
                f"answer length {self.answer_length} must be a positive multiple of block_length {self.block_length}"
            )
        if len(self.budgets) != self.num_steps:
            raise ScheduleError(
                f"need one budget per step: {self.num_blocks} blocks x {self.steps_per_block} steps = "
                f"{self.num_steps}, got {len(self.budgets)}"
            )
        for block in range(self.num_blocks):
            share = self.budgets[block * self.steps_per_block:(block + 1) * self.steps_per_block]
            if min(share) < 0 or sum(share) != self.block_length:
                raise ScheduleError(
                    f"block {block}: budgets {list(share)} must be non-negative and sum to the block's "
                    f"{self.block_length} tokens (each token is revealed in a step of its own block)"
                )

    @classmethod
    def from_blocks(cls, answer_length: int, block_length: int, steps_per_block: int = 8) -> Schedule:
        """Budgets as LLaDA's ``get_num_transfer_tokens`` spreads a block's tokens over its steps: each step gets
        ``block_length // steps_per_block``, the first ``block_length % steps_per_block`` steps one more.

        Raises:
            ScheduleError: non-positive sizes or an answer that is not a whole number of blocks.
        """
        if block_length <= 0 or steps_per_block <= 0:
            raise ScheduleError(f"block_length ({block_length}) and steps_per_block ({steps_per_block}) must be positive")
        base, extra = divmod(block_length, steps_per_block)
        per_block = tuple(base + (1 if s < extra else 0) for s in range(steps_per_block))
        # __post_init__ rejects an answer that is not a whole number of blocks.
        return cls(answer_length, block_length, steps_per_block, per_block * (answer_length // block_length))

    @property
    def num_blocks(self) -> int:
        return self.answer_length // self.block_length

    @property
    def num_steps(self) -> int:
        return self.num_blocks * self.steps_per_block

    def block_of_token(self, i: int) -> int:
        return i // self.block_length

    def window(self, i: int) -> range:
        """The legal reveal steps ``W_i`` of answer token ``i``: the steps of its block."""
        block = self.block_of_token(i)
        return range(block * self.steps_per_block, (block + 1) * self.steps_per_block)

    def check(self, assignment: Sequence[int]) -> None:
        """Raise :class:`ScheduleError` unless every token has one step in its window and step ``t`` has ``k_t``."""
        if len(assignment) != self.answer_length:
            raise ScheduleError(f"assignment has {len(assignment)} entries for {self.answer_length} tokens")
        for i, step in enumerate(assignment):
            if step not in self.window(i):
                raise ScheduleError(f"token {i} assigned to step {step}, outside its window {self.window(i)}")
        counts = np.bincount(np.asarray(assignment, dtype=np.int64), minlength=self.num_steps)
        if tuple(counts.tolist()) != self.budgets:
            raise ScheduleError(f"tokens per step {counts.tolist()} differ from the budgets {list(self.budgets)}")


def initial_assignment(schedule: Schedule) -> tuple[int, ...]:
    """The deterministic schedule-consistent initializer: within each block, steps take their ``k_t`` tokens
    left to right (step ``tau_b`` the first ``k_tau_b`` tokens of the block, and so on)."""
    assignment = []
    for step, budget in enumerate(schedule.budgets):
        assignment.extend([step] * budget)
    return tuple(assignment)


def rollout(prompt_ids: Sequence[int], answer_ids: Sequence[int], assignment: Sequence[int], schedule: Schedule,
            mask_id: int) -> torch.Tensor:
    """Masked states of an assignment: int64 ``[num_steps, P + L]``; row ``t`` is the state before step ``t``
    reveals (answer token ``i`` shown iff ``assignment[i] < t``)."""
    steps = torch.arange(schedule.num_steps).unsqueeze(1)  # [S, 1]
    revealed = torch.as_tensor(assignment).unsqueeze(0) < steps  # [S, L]
    answer = torch.where(revealed, torch.as_tensor(answer_ids), torch.tensor(mask_id))
    prompt = torch.as_tensor(prompt_ids).expand(schedule.num_steps, -1)
    return torch.cat([prompt, answer], dim=1)


#: Maps input ids ``[N, T]`` (int64) to logits ``[N, T, V]`` of a full-recompute forward (no cache).
Forward = Callable[[torch.Tensor], torch.Tensor]


def score_matrix(prompt_ids: Sequence[int], answer_ids: Sequence[int], assignment: Sequence[int],
                 schedule: Schedule, mask_id: int, forward: Forward, batch_size: int = 16) -> np.ndarray:
    """``S[i, t] = log p(y_i | p, x_t with position i masked)`` for legal pairs, ``-inf`` elsewhere.

    One forward per state ``x_t`` scores every token still masked in it; a token already revealed at ``t`` gets
    its own forward of ``x_t`` with that position masked. Forwards run in batches of ``batch_size`` rows.

    Returns:
        float64 ``[L, num_steps]`` (nats).
    """
    states = rollout(prompt_ids, answer_ids, assignment, schedule, mask_id)
    offset = len(prompt_ids)
    # Each forward row: (input ids, [(token i, step t), ...] it scores).
    rows: list[tuple[torch.Tensor, list[tuple[int, int]]]] = []
    for step in range(schedule.num_steps):
        block = step // schedule.steps_per_block
        tokens = range(block * schedule.block_length, (block + 1) * schedule.block_length)
        rows.append((states[step], [(i, step) for i in tokens if assignment[i] >= step]))
        for i in tokens:
            if assignment[i] < step:
                masked = states[step].clone()
                masked[offset + i] = mask_id
                rows.append((masked, [(i, step)]))
    answer = torch.as_tensor(answer_ids)
    scores = np.full((schedule.answer_length, schedule.num_steps), -np.inf)
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        with torch.no_grad():
            log_probs = torch.log_softmax(forward(torch.stack([ids for ids, _ in chunk])).float(), dim=-1)
        for row, (_, pairs) in enumerate(chunk):
            for i, step in pairs:
                scores[i, step] = log_probs[row, offset + i, answer[i]].item()
    return scores


def solve_assignment(scores: np.ndarray, schedule: Schedule, scale: int = COST_SCALE,
                     previous: Sequence[int] | None = None) -> tuple[int, ...]:
    """The assignment maximizing ``sum_i S[i, a_i]`` under the windows and budgets, by min-cost flow.

    Graph as in the paper's "TRACE Flow Construction": source -> token ``i`` (capacity 1, cost 0), token ->
    step ``t`` for ``t`` in ``W_i`` (capacity 1, cost ``-round(S[i, t] * scale)``), step -> sink (capacity
    ``k_t``, cost 0); the source supplies ``L`` units and the sink takes ``L``, so every token is assigned once and
    every step gets exactly ``k_t``. Integer costs keep networkx's network simplex exact; the optimum found is
    within ``L / (2 * scale)`` nats of the real-valued one.

    Ties: with ``previous`` (the current assignment), every cost is multiplied by ``L + 1`` and the edge of each
    token's current step gets one unit less, so among assignments of equal (rounded) score the solver keeps the
    current one; the bonus sums to at most ``L`` units, less than one unit of score, so it never outweighs a real
    difference. Without it, interchangeable tokens (such as the EOS padding of an answer) could swap steps in every
    round and the refinement would never see a stable assignment.

    Args:
        scores: float ``[L, num_steps]``; entries outside the windows are ignored; legal ones must be finite.

    Raises:
        ScheduleError: a non-finite legal score, or no feasible flow.
    """
    if scores.shape != (schedule.answer_length, schedule.num_steps):
        raise ScheduleError(f"scores shape {scores.shape} != (L, steps) = "
                            f"({schedule.answer_length}, {schedule.num_steps})")
    graph = nx.DiGraph()
    graph.add_node("source", demand=-schedule.answer_length)
    graph.add_node("sink", demand=schedule.answer_length)
    for i in range(schedule.answer_length):
        graph.add_edge("source", ("token", i), capacity=1, weight=0)
        for step in schedule.window(i):
            if not np.isfinite(scores[i, step]):
                raise ScheduleError(f"score of token {i} at legal step {step} is {scores[i, step]}")
            weight = -round(float(scores[i, step]) * scale)
            if previous is not None:
                weight = weight * (schedule.answer_length + 1) - int(previous[i] == step)
            graph.add_edge(("token", i), ("step", step), capacity=1, weight=weight)
    for step, budget in enumerate(schedule.budgets):
        graph.add_edge(("step", step), "sink", capacity=budget, weight=0)
    try:
        flow = nx.min_cost_flow(graph)
    except nx.NetworkXUnfeasible as error:
        raise ScheduleError(f"no assignment satisfies the windows and budgets {list(schedule.budgets)}") from error
    assignment = tuple(
        next(node[1] for node, units in flow[("token", i)].items() if units == 1)
        for i in range(schedule.answer_length)
    )
    schedule.check(assignment)
    return assignment


class Trajectory(BaseModel):
    """The stored TRACE artifact: exactly what the issue lists, nothing else (no logits, no caches).

    ``objectives[r]`` is ``sum_i S^(r)[i, a^(r+1)_i]`` in nats: the optimum of round ``r``'s assignment problem.
    ``settled``: the last round's assignment equals its input (refinement converged within the round limit);
    False when the limit stopped it; None in trajectories stored before it was recorded.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    prompt_ids: tuple[int, ...]
    answer_ids: tuple[int, ...]
    assignment: tuple[int, ...]
    block_length: int
    steps_per_block: int
    budgets: tuple[int, ...]
    model_fingerprint: str
    rounds: int
    objectives: tuple[float, ...]
    settled: bool | None = None

    @property
    def schedule(self) -> Schedule:
        return Schedule(len(self.answer_ids), self.block_length, self.steps_per_block, self.budgets)


def trace(prompt_ids: Sequence[int], answer_ids: Sequence[int], forward: Forward, mask_id: int,
          model_fingerprint: str, *, steps_per_block: int = 8, block_length: int = 32, max_rounds: int = 3,
          batch_size: int = 16, schedule: Schedule | None = None) -> Trajectory:
    """Run TRACE on one prompt-answer pair (module docstring), at most ``max_rounds`` refinement rounds.

    Args:
        prompt_ids, answer_ids: token ids; ``len(answer_ids)`` a multiple of ``block_length``.
        forward: full-recompute forward, ids ``[N, T]`` -> logits ``[N, T, V]``.
        mask_id: the model's ``<mask>`` id.
        schedule: overrides the default budgets of :meth:`Schedule.from_blocks`.

    Raises:
        ScheduleError: infeasible schedule; ValueError: ``max_rounds < 1``.
    """
    if max_rounds < 1:
        raise ValueError(f"max_rounds must be >= 1, got {max_rounds}")
    schedule = schedule or Schedule.from_blocks(len(answer_ids), block_length, steps_per_block)
    if schedule.answer_length != len(answer_ids):
        raise ScheduleError(f"schedule is for {schedule.answer_length} tokens, the answer has {len(answer_ids)}")
    assignment = initial_assignment(schedule)
    objectives = []
    stable = False
    for _ in range(max_rounds):
        scores = score_matrix(prompt_ids, answer_ids, assignment, schedule, mask_id, forward, batch_size)
        following = solve_assignment(scores, schedule, previous=assignment)
        objectives.append(float(scores[np.arange(len(following)), following].sum()))
        stable = following == assignment
        assignment = following
        if stable:
            break
    return Trajectory(
        prompt_ids=tuple(prompt_ids), answer_ids=tuple(answer_ids), assignment=assignment,
        block_length=schedule.block_length, steps_per_block=schedule.steps_per_block, budgets=schedule.budgets,
        model_fingerprint=model_fingerprint, rounds=len(objectives), objectives=tuple(objectives), settled=stable,
    )
