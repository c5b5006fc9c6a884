"""Continuous batching: the passes of many cohorts, at different blocks and steps, in at most two forwards.

Each iteration (:meth:`RunningBatch.step`) asks every cohort for its next call (`service.engine.decode.Pass`) and
runs them grouped by kind: one forward for the full passes (block-initial passes, no-cache steps, whole-response
calls) and one for the window passes (cached steps). Within a forward every row keeps its own layout:

* inputs and positions are right-padded to the longest row of the forward (padded query columns are computed and
  thrown away);
* keys are right-padded to the longest key length, and the key mask hides the padding, so each row attends over
  exactly the keys it would attend over alone;
* the KV hook (:class:`MergedHook`) hands each cohort's hook only its own rows and real columns, so each cohort's
  store writes and reads only its own reused K/V, and puts the per-cohort key tensors side by side;
* the LM head runs only at each row's own block columns (``logits_at``).

A cohort joins at the next iteration after :meth:`RunningBatch.join` and leaves the iteration it finishes
(EOS, its length, a stop condition of the caller, cancellation), its store cleared at once.

**A failing row fails alone** (issue 13): an exception raised by one cohort (its next call, its reveal, its KV
store's hook inside a merged forward) takes only that cohort out of the batch (:attr:`RunningBatch.failed`); when
a merged forward raises, each of its passes is run again alone (a pass is a pure function of the cohort's state:
the block-initial pass rewrites each layer's reused K/V whole), so the others go on and the culprit is found.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from service.engine.decode import Cohort, Pass
from service.engine.models import DiffusionLM


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
    """One forward over ``passes`` (all of one kind); the logits of each, ``[n, N_pass, V]``, in order.

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


class RunningBatch:
    """The cohorts being decoded together; :meth:`step` runs one iteration.

    Args:
        model: the network; pad_id: the token id of padded input columns.

    Attributes:
        cohorts: the cohorts in the batch, oldest first.
        forwards: forward calls made by the last :meth:`step` (0, 1 or 2; more when a merged forward failed).
        failed: (cohort, exception) of the cohorts that raised in the last :meth:`step` (they have left).
    """

    def __init__(self, model: DiffusionLM, pad_id: int) -> None:
        self.model, self.pad_id = model, pad_id
        self.cohorts: list[Cohort] = []
        self.forwards = 0
        self.failed: list[tuple[Cohort, BaseException]] = []

    def join(self, cohort: Cohort) -> None:
        """Add a cohort; its first call is made at the next :meth:`step`."""
        self.cohorts.append(cohort)

    def leave(self, cohort: Cohort) -> None:
        """Remove a cohort now (e.g. its client went away) and free its KV store."""
        if cohort in self.cohorts:
            self.cohorts.remove(cohort)
        cohort.store.clear()

    def step(self, on_done: Callable[[Cohort], None] | None = None) -> list[Cohort]:
        """One iteration: every cohort's next call, grouped by kind into forwards. Returns the cohorts that finished
        (they have left the batch, their stores cleared); ``on_done`` is called for each as soon as it is known.
        Cohorts that raised leave too and are listed in :attr:`failed`.

        Raises whatever the forward raises when every cohort of the iteration failed with it (nothing to isolate:
        the caller decides, e.g. a device fault); the cohorts stay in the batch then.
        """
        finished, calls, self.failed = [], [], []
        for cohort in list(self.cohorts):
            try:
                call = cohort.next_pass()
            except Exception as exc:  # noqa: BLE001 -- one cohort's fault is its own (module docstring)
                self.failed.append((cohort, exc))
                continue
            if call is None:
                finished.append(cohort)
            else:
                calls.append(call)
        for cohort in finished:
            self.leave(cohort)
            if on_done is not None:
                on_done(cohort)
        self.forwards = 0
        for kind in ("full", "window"):
            group = [c for c in calls if c.kind == kind]
            for call, logits in self._run_group(group, len(calls)):
                try:
                    call.cohort.apply(call, logits)
                except Exception as exc:  # noqa: BLE001 -- one cohort's fault is its own
                    self.failed.append((call.cohort, exc))
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
