"""Continuous batching: the passes of many cohorts, at different blocks and steps, in few forwards.

Each iteration (:meth:`RunningBatch.step`) takes every cohort's next call (`service.engine.decode.Pass`) and runs
them grouped into forwards by :func:`plan_forwards`: passes (full: block-initial passes, no-cache steps,
whole-response calls; window: cached steps) share a forward while that costs no more than running them apart, by
a cost model of a forward's fixed overhead plus its arithmetic at the padded shape (`service.engine.forward_cost`),
and while the merged forward's transient memory stays within the largest single cohort's (what admission
reserves). The forwards run cheapest first, so a short request's steps never wait behind a long one's full pass
in the same iteration. Within a forward every row keeps its own layout:

* inputs and positions are right-padded to the longest row of the forward (padded query columns are computed and
  thrown away);
* keys are right-padded to the longest key length, and the key mask hides the padding, so each row attends over
  exactly the keys it would attend over alone;
* the KV hook (:class:`MergedHook`) hands each cohort's hook only its own rows and real columns, so each cohort's
  store writes and reads only its own reused K/V, and puts the per-cohort key tensors side by side;
* the LM head runs only at each row's own block columns (``logits_at``).

A cohort joins at the next iteration after :meth:`RunningBatch.join` and leaves in the iteration of its last
forward (EOS, its length, a stop condition of the caller, cancellation), its store cleared at once: its next
call is asked for right after each forward, so a finished cohort is known without waiting for another iteration.

**A failing row fails alone** (issue 13): an exception raised by one cohort (its next call, its reveal, its KV
store's hook inside a merged forward) takes only that cohort out of the batch (:attr:`RunningBatch.failed`); when
a merged forward raises, each of its passes is run again alone (a pass is a pure function of the cohort's state:
the block-initial pass rewrites each layer's reused K/V whole), so the others go on and the culprit is found.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F

from service.engine.decode import Cohort, Pass
from service.engine.forward_cost import ForwardCost
from service.engine.models import DiffusionLM

#: A merged forward may cost at most this fraction more than its passes run apart (padding against overhead).
PADDING_SLACK = 0.1


class MergedHook:
    """The KV hook of a merged forward: each cohort's hook on its own rows and columns, results padded together.

    Args:
        passes: the passes in the forward, in batch order; key_len: the forward's key length (longest pass).
    """

    def __init__(self, passes: list[Pass], key_len: int) -> None:
        self.passes, self.key_len = passes, key_len

    def __call__(self, layer, q, k_pre, k, v):
        parts, replaced, offset = [], False, 0
        for p in self.passes:
            n, width = len(p.rows), p.input_ids.shape[1]
            rows = slice(offset, offset + n)
            offset += n
            out = None
            if p.hook is not None:
                out = p.hook(layer, q[rows, :, :width], k_pre[rows, :, :width], k[rows, :, :width],
                             v[rows, :, :width])
            replaced = replaced or out is not None
            parts.append(out if out is not None else (k[rows, :, :width], v[rows, :, :width]))
        if not replaced:
            return None  # every cohort attends over its fresh K/V (full passes): the forward's own tensors

        def padded(x: torch.Tensor) -> torch.Tensor:
            return F.pad(x, (0, 0, 0, self.key_len - x.shape[2]))

        return torch.cat([padded(kk) for kk, _ in parts]), torch.cat([padded(vv) for _, vv in parts])


def run_passes(model: DiffusionLM, passes: list[Pass], pad_id: int) -> list[torch.Tensor]:
    """One forward over ``passes`` (full and window passes alike); the logits of each, ``[n, N_pass, V]``, in
    order.

    With a single pass the call is exactly the cohort's own forward (no padding, no merged hook).
    """
    if len(passes) == 1:
        p = passes[0]
        rows = len(p.rows)
        logits = model(p.input_ids, positions=p.positions, key_mask=p.key_mask, kv_hook=p.hook,
                       logits_at=p.logits_cols.expand(rows, -1))
        return [logits]
    width = max(p.input_ids.shape[1] for p in passes)
    key_len = max(p.key_len for p in passes)
    cols = max(p.logits_cols.numel() for p in passes)
    ids, positions, masks, at = [], [], [], []
    for p in passes:
        n, w = len(p.rows), p.input_ids.shape[1]
        ids.append(F.pad(p.input_ids, (0, width - w), value=pad_id))
        positions.append(F.pad(p.positions, (0, width - w)))
        mask = p.key_mask if p.key_mask is not None else torch.ones(
            n, p.key_len, dtype=torch.bool, device=p.input_ids.device)
        masks.append(F.pad(mask, (0, key_len - p.key_len), value=False))
        at.append(F.pad(p.logits_cols, (0, cols - p.logits_cols.numel())).expand(n, -1))
    hook = MergedHook(passes, key_len) if any(p.hook is not None for p in passes) else None
    logits = model(torch.cat(ids), positions=torch.cat(positions), key_mask=torch.cat(masks), kv_hook=hook,
                   logits_at=torch.cat(at))
    out, offset = [], 0
    for p in passes:
        n = len(p.rows)
        out.append(logits[offset:offset + n, : p.logits_cols.numel()])
        offset += n
    return out


def _shape(passes: list[Pass]) -> tuple[int, int, int]:
    """(rows, input columns, keys) of the forward that merges ``passes`` (padded to the widest)."""
    return (sum(len(p.rows) for p in passes), max(p.input_ids.shape[1] for p in passes),
            max(p.key_len for p in passes))


def peak_bytes(cost: ForwardCost, cohort: Cohort) -> int:
    """Transient bytes of the cohort's largest forward: a full pass over its sequence (what admission reserves)."""
    cols = cohort.seq_len - cohort.response_start if cohort.canvas else cohort.params.block_length
    return cost.bytes(len(cohort.rows), cohort.seq_len, cohort.seq_len, cols)


_OVERHEAD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def forward_overhead(model: DiffusionLM, cost: ForwardCost) -> float:
    """The fixed cost of one forward call (Python, kernel launches), in the units of :meth:`ForwardCost.flops`.

    Measured once per model: the best of 3 timings of forwards over 1 and 128 columns give the seconds per
    flop and the time a forward takes beyond its arithmetic. On a small model (the embedded one: ~8 ms on one CPU
    thread, the arithmetic of ~100 columns) this, not padding, decides whether merging pays.
    """
    if model not in _OVERHEAD:
        device = model.embed.weight.device
        seconds = []
        with torch.inference_mode():
            for width in (1, 128):
                ids = torch.zeros(1, width, dtype=torch.long, device=device)
                positions = torch.arange(width, device=device)[None]
                best = float("inf")
                for _ in range(3):
                    t0 = time.perf_counter()
                    model(ids, positions=positions, logits_at=positions[:, :1])
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    best = min(best, time.perf_counter() - t0)
                seconds.append(best)
        small, large = cost.flops(1, 1, 1), cost.flops(1, 128, 128)
        per_second = (large - small) / max(seconds[1] - seconds[0], 1e-9)
        _OVERHEAD[model] = max(0.0, seconds[0] * per_second - small)
    return _OVERHEAD[model]


def plan_forwards(passes: list[Pass], cost: ForwardCost, cap_bytes: int, overhead: float = 0.0,
                  slack: float = PADDING_SLACK) -> list[list[Pass]]:
    """Group one iteration's passes into forwards, cheapest forward first.

    A forward costs ``overhead`` (:func:`forward_overhead`) plus its arithmetic at the padded shape
    (:meth:`ForwardCost.flops`). Passes of both kinds, ordered by key length and width, join the current group
    while the merged forward costs at most ``1 + slack`` times the group and the pass run apart, and its transient
    memory (:meth:`ForwardCost.bytes`) is at most ``cap_bytes``; a pass that does not fit starts a new group (a
    single pass always runs).
    """
    def price(group: list[Pass]) -> float:
        return overhead + cost.flops(*_shape(group))

    groups: list[list[Pass]] = []
    current: list[Pass] = []
    for p in sorted(passes, key=lambda p: (p.key_len, p.input_ids.shape[1])):
        if current:
            merged = [*current, p]
            cols = max(q.logits_cols.numel() for q in merged)
            if (price(merged) <= (1 + slack) * (price(current) + price([p]))
                    and cost.bytes(*_shape(merged), cols) <= cap_bytes):
                current = merged
                continue
            groups.append(current)
        current = [p]
    if current:
        groups.append(current)
    # Cheapest first: a short request's forward (and its result, through ``on_done``) never waits for a long
    # request's pass within the same iteration.
    return sorted(groups, key=price)


class RunningBatch:
    """The cohorts being decoded together; :meth:`step` runs one iteration.

    Args:
        model: the network; pad_id: the token id of padded input columns.
        padding_slack: see :func:`plan_forwards` (``inf`` merges every pass of a kind the memory cap allows).

    Attributes:
        cohorts: the cohorts in the batch, oldest first.
        forwards: forward calls made by the last :meth:`step` (more when a merged forward failed); merged: the most
            cohorts that shared one of them.
        failed: (cohort, exception) of the cohorts that raised in the last :meth:`step` (they have left).
    """

    def __init__(self, model: DiffusionLM, pad_id: int, padding_slack: float = PADDING_SLACK) -> None:
        self.model, self.pad_id, self.padding_slack = model, pad_id, padding_slack
        self.cost = ForwardCost.of(model)
        self.cohorts: list[Cohort] = []
        self._next: dict[Cohort, Pass] = {}
        self.forwards = self.merged = 0
        self.failed: list[tuple[Cohort, BaseException]] = []

    def join(self, cohort: Cohort) -> None:
        """Add a cohort; its first call is made at the next :meth:`step`."""
        self.cohorts.append(cohort)

    def leave(self, cohort: Cohort) -> None:
        """Remove a cohort now (e.g. its client went away) and free its KV store."""
        if cohort in self.cohorts:
            self.cohorts.remove(cohort)
        self._next.pop(cohort, None)
        cohort.store.clear()

    def _ask(self, cohort: Cohort, finished: list[Cohort], on_done: Callable[[Cohort], None] | None) -> None:
        """Take the cohort's next call, or let it leave (finished) when it has none, or record its fault."""
        try:
            call = cohort.next_pass()
        except Exception as exc:  # noqa: BLE001 -- one cohort's fault is its own (module docstring)
            self.failed.append((cohort, exc))
            return
        if call is not None:
            self._next[cohort] = call
            return
        self.leave(cohort)
        finished.append(cohort)
        if on_done is not None:
            on_done(cohort)

    def step(self, on_done: Callable[[Cohort], None] | None = None) -> list[Cohort]:
        """One iteration: every cohort's next call, grouped into forwards (:func:`plan_forwards`). Returns the
        cohorts that finished (they have left the batch, their stores cleared); ``on_done`` is called for each as
        soon as it is known. Cohorts that raised leave too and are listed in :attr:`failed`.

        Raises whatever the forward raises when every cohort of the iteration failed with it (nothing to isolate:
        the caller decides, e.g. a device fault); the cohorts stay in the batch then.
        """
        finished: list[Cohort] = []
        self.failed = []
        for cohort in list(self.cohorts):
            if cohort not in self._next:  # joined since the last iteration
                self._ask(cohort, finished, on_done)
        calls = [self._next[c] for c in self.cohorts if c in self._next]
        cap = max((peak_bytes(self.cost, c) for c in self.cohorts), default=0)
        overhead = forward_overhead(self.model, self.cost) if len(calls) > 1 else 0.0
        self.forwards = self.merged = 0
        for group in plan_forwards(calls, self.cost, cap, overhead, self.padding_slack):
            self.merged = max(self.merged, len(group))
            for call, logits in self._run_group(group, len(calls)):
                del self._next[call.cohort]
                try:
                    call.cohort.apply(call, logits)
                except Exception as exc:  # noqa: BLE001 -- one cohort's fault is its own
                    self.failed.append((call.cohort, exc))
                    continue
                self._ask(call.cohort, finished, on_done)
        for cohort, _ in self.failed:
            self.leave(cohort)
        return finished

    def _run_group(self, group: list[Pass], calls: int) -> list[tuple[Pass, torch.Tensor]]:
        """The group's forward; when it raises, each pass again alone, the failing ones into :attr:`failed`.
        Re-raises when every call of the iteration (``calls``) failed alone."""
        if not group:
            return []
        self.forwards += 1
        try:
            return list(zip(group, run_passes(self.model, group, self.pad_id)))
        except Exception as exc:
            if len(group) == 1 and calls == 1:
                raise
            if len(group) == 1:
                self.failed.append((group[0].cohort, exc))
                return []
        done = []
        for call in group:
            self.forwards += 1
            try:
                done.append((call, run_passes(self.model, [call], self.pad_id)[0]))
            except Exception as exc:  # noqa: BLE001 -- isolate the culprit
                self.failed.append((call.cohort, exc))
        if not done and len(group) == calls:
            raise self.failed[-1][1]
        return done
