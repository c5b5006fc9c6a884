"""Preemption by recompute (issue 36 item 5), as a pure function: which running requests give their memory back
so that the request blocked at the head of the queue can start, instead of waiting for their whole run.

A preempted request leaves the running batch at a block boundary (`service.engine.batch.RunningBatch.preempt`:
its next call is a full pass, so every token it revealed is final), its KV store is freed, and it waits in the
queue right behind the request it made way for; when it fits again it resumes with that call, a block-initial pass
over its prompt and committed tokens that rebuilds its store (the pass it would have made at that block anyway:
nothing is computed twice). Its output is token for token what it would have been (its tokens, counts,
generators, grammar state and streamed blocks stay on its cohort). The loop that applies the plan is
`service.runtime.loop.Worker`.

**The rule** (:func:`plan_preemption`). When the request at the head of the queue does not fit the memory budget
beside the running ones, a running request may be preempted for it if

* it is larger than the head (KV + transient bytes): a request never makes way for one as large as itself, so
  equal requests stay first come, first served and a preempted request never preempts the one it made way for;
* it has been preempted fewer than ``max_preemptions`` times, or, past that cap, it has committed enough blocks
  since it last joined: the ``(max_preemptions + k)``-th preemption waits until it has committed ``k`` blocks
  since it last rejoined (issue 45 item 9). Before the cap a small request waits at most one block of the large
  one (its boundary); after it, the next small request waits at most one block more, the one after two, and so
  on: no cliff where a small request suddenly waits for the large one's whole run. The large one still cannot
  be starved: it advances ``k`` blocks before its ``(max_preemptions + k)``-th preemption, so a request of ``B``
  blocks is preempted at most ``max_preemptions + k`` times where ``k (k + 1) / 2 <= B`` (16 blocks: at most
  ``max_preemptions + 5``), each time delayed by at most the backfill window, ``backfill_s``, plus the run of
  the requests it made way for (it waits at the head of the queue right behind them);
* it is a decoding request of a family whose decoder can pause it (`Capabilities.preemption`; not a likelihood
  task), at a block boundary (`DecodeBatch.preemptible`).

Candidates are taken in the order they have held their memory, longest first (since they last joined), until the
head fits; if it would not fit even with every candidate gone, nobody is preempted. Of those taken, the ones at a
block boundary now are preempted now; the others when the plan is made again at a later iteration (each reaches
a boundary within one block), so the head waits at most one block of the requests it preempts.
"""

from __future__ import annotations

from dataclasses import dataclass

from service.runtime.scheduler import Cost, fits, kv_held

#: Preemptions one request may undergo (``max_preemptions``, DLLM_MAX_PREEMPTIONS); 0 turns preemption off.
DEFAULT_MAX_PREEMPTIONS = 4


@dataclass(frozen=True)
class Holder:
    """A running request as the preemption rule sees it.

    Attributes:
        cost: its reserved memory; held_since: when it last joined the batch (seconds, any one clock);
        preemptions: how often it was preempted so far; pausable: its batch can pause it at all (a decoding
        request of a family that supports it); at_boundary: it can be paused now (its next call is a full pass);
        progress: blocks it committed since it last joined (what a preemption past the cap waits for).
    """

    cost: Cost
    held_since: float
    preemptions: int
    pausable: bool
    at_boundary: bool
    progress: int = 0


def may_preempt(holder: Holder, max_preemptions: int) -> bool:
    """Whether the preemption count and progress of ``holder`` let it be preempted (module doc, the rule): fewer
    than ``max_preemptions`` preemptions, or past the cap ``k`` blocks committed since it last joined for its
    ``(max_preemptions + k)``-th. ``max_preemptions`` 0: never."""
    if max_preemptions <= 0:
        return False
    return holder.preemptions < max_preemptions or holder.progress > holder.preemptions - max_preemptions


def size(cost: Cost) -> int:
    """A request's size for the rule: its KV plus transient bytes (as backfill compares requests)."""
    return kv_held([cost]) + cost.transient


def plan_preemption(head: Cost, running: list[Holder], budget: int, reserve: int = 0,
                    max_preemptions: int = DEFAULT_MAX_PREEMPTIONS) -> list[int]:
    """Indices into ``running`` of the requests to preempt now so that ``head`` can start (module doc, the rule).

    Args:
        head: the cost of the request blocked at the head of the queue.
        running: the running requests (and those joining this iteration, as not pausable).
        budget, reserve: bytes, as `service.runtime.scheduler.fits`.
        max_preemptions: preemptions allowed per request before they are spaced by its progress (0: none).

    Returns:
        The indices, longest held first; empty when preemption cannot make the head fit, or when the requests it
        needs are not at a block boundary yet.
    """
    candidates = sorted(
        (i for i, h in enumerate(running)
         if h.pausable and may_preempt(h, max_preemptions) and size(h.cost) > size(head)),
        key=lambda i: running[i].held_since,
    )
    kept = set(range(len(running)))
    taken: list[int] = []
    for i in candidates:
        if fits([running[j].cost for j in sorted(kept)], head, budget, reserve):
            break
        kept.discard(i)
        taken.append(i)
    if not fits([running[j].cost for j in sorted(kept)], head, budget, reserve):
        return []
    return [i for i in taken if running[i].at_boundary]
