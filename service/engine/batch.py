"""Continuous batching: one iteration runs every running request's next call in the forwards its plan groups (a
plan the caller gives), reveals for all their rows in one batched call, and reads the device once (issue 21).

An iteration (:meth:`RunningBatch.step`) is a plain loop:

1. **plan**: each cohort says what its next call needs (`service.engine.decode.Pass`, built on the host,
   :meth:`RunningBatch.passes`); the caller's plan groups the calls into forwards (:data:`Plan`; the server's is
   `service.runtime.scheduler.plan_forwards`: window passes apart from full passes, each forward within a token
   budget; `Engine.generate`'s one cohort makes one pass per iteration, run alone, :func:`alone`);
2. **run**: per forward, inputs and positions are right-padded to the widest pass, keys carry a key mask (each
   row attends over exactly its own keys: its padding and anything past its sequence get no weight), RoPE's
   cos/sin are looked up in the model's table once, and the LM head runs only at the columns each row's reveal
   reads (a greedy row's masked columns, `Cohort.reveal_columns`; the vocabulary softmax then runs only there);
3. **reveal**: one batched reveal over all rows of the forward (`service.engine.reveal.reveal_batch`), each row
   by its own family rule, settings and generator; the revealed windows go back into each cohort's tokens;
4. **read**: one host read for the whole iteration (per row: tokens revealed, masks left, EOS reached and the
   window's tokens; per store that put off its block-initial write's checks, their verdict), from which each
   cohort updates its host state (:meth:`Cohort.absorb`): counts, EOS, cancellation, committed blocks; finished
   cohorts leave.

**Attention across requests.** In a window forward, the rows of every store kept in sequence order (the engine's
full-precision store, `FullPrecisionKVStore.sequence_kv`) are copied side by side into one buffer per layer (each
row's keys once; a lone row attends from its store's own buffer), the fresh window's K/V copied over their window
columns with one row copy (``index_copy_``), and attended in the forward's one call.
Other stores (quantized) answer through the protocol (``window_kv``: their dequantized layer with the window in
place) and join the same concatenation; a store that attends itself (the fused kernel on CUDA, ``attend``) gets
its rows' queries and the hook attends the others, so the layer still makes one attention call for the rest.
Padded query columns write their K/V into a spare key column that no row attends.

**A failing row fails alone** (issues 13 and 21): a fault of one cohort takes only that cohort out of the batch
(:attr:`RunningBatch.failed`, with its exception); the other cohorts of the same forward and iteration go on and
decode token for token as they would alone. Where a fault is caught decides how:

* its next call (:meth:`Cohort.next_pass`), its host bookkeeping after the iteration's read (:meth:`Cohort.absorb`,
  its log-probabilities, its ``on_block`` callback, and ``on_done`` of :meth:`RunningBatch.step`): caught around
  that cohort's own call;
* its grammar at the reveal (`service.engine.grammar.constrained_reveal`: the grammar engine's work limit, or no
  token allowed): the row's chain records a `GrammarViolation` and stops, the other rows' chains and the batched
  reveal go on with the same logits (each row's reveal reads only its own row), and the failing cohort's window is
  not written back;
* anything raised inside a merged forward (its KV store's hook: a quantizer refusing its input) or its reveal (out
  of memory for the merged rows): each of the forward's passes is run again alone, so the others go on and the
  culprit is found. A pass is a pure function of the cohort's state (the block-initial pass rewrites each layer's
  reused K/V whole, a window pass writes only window columns), and a reveal that raised is undone first (each
  row's generator state and grammar position as before it; the windows are written back last), so a pass run
  again decides exactly as it would have;
* a quantized store's block-initial write checks (finite K/V and scores, ranges that fit the dtype): not read
  inside the layers; the forward runs with them put off (`service.engine.kv_store.DEFER_WRITE_CHECKS`) and their
  verdict joins the iteration's read. A cohort whose verdict is False is not absorbed: its pass runs again alone
  with each check read at once (the failure path only; its window columns put back to masks, as they were before
  the reveal), which raises exactly what the write raised before the checks were put off, and the cohort fails
  with that (a false alarm, which raises nothing, is absorbed as usual). A row's non-finite K/V never reaches
  another row: each row attends over its own keys only.

:meth:`RunningBatch.run` therefore never raises for one cohort's fault, not even when it is the iteration's only
call (the server fails that request alone and keeps any other running work); what the caller does about a fault
that cannot be one cohort's (a device fault, `service.runtime.loop.is_device_fault`) is its decision.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from service.engine.cache_hooks import WriteSet, write_together
from service.engine.decode import Cohort, Pass
from service.engine.grammar import constrained_reveal
from service.engine.kv_pool import KVPool, PooledReuse, window_flat_index
from service.engine.kv_store import DEFER_WRITE_CHECKS
from service.engine.models import DiffusionLM
from service.engine.models.layers import attend
from service.engine.reveal import RevealBatch, RevealResult, reveal_batch


@dataclass(frozen=True)
class Bucket:
    """The shapes a window forward runs at (the bucket of a CUDA graph, `service.engine.graphs`): ``rows`` (batch
    rows), ``width`` (input columns), ``key_len`` (key columns: every row's sequence plus the spare column,
    padded)."""

    rows: int
    width: int
    key_len: int

    def __post_init__(self) -> None:
        if min(self.rows, self.width, self.key_len) < 1:
            raise ValueError(f"a bucket's rows, width and key_len are >= 1, got {self}")


#: An iteration's plan: its passes grouped into forwards (`service.runtime.scheduler.plan_forwards` in the server).
Plan = Callable[[list[Pass]], list[list[Pass]]]
#: What runs one forward of a group and gives its logits, tokens and listed columns (:func:`run_forward`'s
#: signature; `service.engine.graphs.LaterSteps` replays the later steps' forwards).
Forward = Callable[..., "tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]"]


def alone(passes: list[Pass]) -> list[list[Pass]]:
    """The plan that runs each pass in a forward of its own (one cohort, as `Engine.generate` runs, makes one pass
    per iteration, so this is its plan)."""
    return [[p] for p in passes]


def spans(counts: Iterable[int]) -> list[slice]:
    """Consecutive slices of the given lengths, from 0 (each part's rows in a batch of parts laid end to end)."""
    slices, offset = [], 0
    for count in counts:
        slices.append(slice(offset, offset + count))
        offset += count
    return slices


def _rows(group: list[Pass]) -> list[slice]:
    """Each pass's rows in the forward (consecutive, in group order)."""
    return spans(len(p.rows) for p in group)


def _padded(x: torch.Tensor, width: int, value: int = 0) -> torch.Tensor:
    return x if x.shape[1] == width else F.pad(x, (0, width - x.shape[1]), value=value)


class BlockWrites:
    """KV hook of a full forward: each cohort's block-initial hook on its own rows and columns; attention runs
    over the forward's own K/V."""

    def __init__(self, group: list[Pass]) -> None:
        self.parts = [(p, rows) for p, rows in zip(group, _rows(group)) if p.hook is not None]
        # Stores of one write key take each layer in one write for all their rows (`write_together`), made at
        # the first layer (it needs the device).
        self._sets: list[WriteSet] | None = None

    def __call__(self, layer, q, k_pre, k, v):
        if self._sets is None:
            self._sets, alone = write_together([(p.hook, rows) for p, rows in self.parts], q)
            self.parts = [self.parts[i] for i in alone]
        for together in self._sets:
            together(layer, q, k_pre, k, v)
        for p, rows in self.parts:
            t = p.seq_len
            p.hook(layer, q[rows, :, :t], k_pre[rows, :, :t], k[rows, :, :t], v[rows, :, :t])


class BatchedReuse:
    """KV hook of a window forward: every row's reused K/V in sequence order, side by side, with the fresh window
    written over its window columns (module doc).

    Args:
        group: the forward's window passes; key_len: keys per row (longest sequence + 1 spare column);
        dest: int64 ``[R, 1, W, 1]``, the key column each input column's fresh K/V goes to (padded input
        columns: the spare column); key_mask: bool ``[R, key_len]``.
    """

    def __init__(self, group: list[Pass], key_len: int, dest: torch.Tensor, key_mask: torch.Tensor, rope=None,
                 ) -> None:
        self.parts = list(zip(group, _rows(group)))
        self.real = sum(len(p.rows) for p in group)
        self.key_len, self.dest, self.key_mask, self.rope = key_len, dest, key_mask, rope
        # Flat row index of each fresh K/V row in a [R, H_kv, key_len, D] buffer, made at the first layer.
        self._flat: torch.Tensor | None = None

    def _kv(self, p: Pass, rows: slice, layer, q, k_pre, k, v):
        """The pass's keys and values ``[n, H_kv, T_n, D]`` (``T_n <= key_len``: its own sequence, maybe with
        its spare column), or the attention output when its store attended itself."""
        if p.hook is None:  # a store kept in sequence order
            kk, vv = p.cohort.store.sequence_kv(layer)
            if p.selection is not None:
                kk, vv = kk.index_select(0, p.selection), vv.index_select(0, p.selection)
        else:
            w = p.width
            out = p.hook(layer, q[rows, :, :w], k_pre[rows, :, :w], k[rows, :, :w], v[rows, :, :w])
            if isinstance(out, torch.Tensor):
                return out
            kk, vv = out
        return kk, vv

    def _together(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list:
        """Per part, what its store gave together with the other stores of its kind: the attention output of its
        rows when they attend in one call (`KVStore.attend_batch`: the fused kernel's one launch for all their
        rows), else the keys and values (`KVStore.window_kv_batch`: one dequantization for all their rows); None
        for a part that answers alone (its store has no batch key, or no other store shares it, or only some of
        its rows take part). When one kind holds the whole forward, its one result."""
        kinds: dict = {}
        for i, (p, _) in enumerate(self.parts):
            if p.hook is not None and p.selection is None:
                key = p.cohort.store.batch_key(layer, q.device)
                if key is not None:
                    kinds.setdefault(key, []).append(i)
        got: list = [None] * len(self.parts)
        for members in kinds.values():
            if len(members) < 2:
                continue
            stores = [self.parts[i][0].cohort.store for i in members]
            whole = len(members) == len(self.parts)
            taken = (q, k, v)
            if not whole:
                rows = torch.tensor([r for i in members for r in range(self.parts[i][1].start, self.parts[i][1].stop)],
                                    device=q.device)
                taken = tuple(x.index_select(0, rows) for x in taken)
            positions = [self.parts[i][0].reused_positions for i in members]
            out = stores[0].attend_batch(stores, layer, *taken, [self.parts[i][0].width for i in members],
                                         positions, self.rope)
            if out is None:
                out = stores[0].window_kv_batch(stores, layer, self.key_len, positions, self.rope)
            if whole:  # the whole forward: no split, no concatenation
                return [out]
            for i, rows in zip(members, spans(len(self.parts[i][0].rows) for i in members)):
                got[i] = out[rows] if isinstance(out, torch.Tensor) else (out[0][rows], out[1][rows])
        return got

    def __call__(self, layer, q, k_pre, k, v):
        n = self.real
        if q.shape[0] == n:
            return self._attended(layer, q, k_pre, k, v)
        # Rows padded to a bucket (`service.engine.graphs`): the real rows as without them; a padded row gets zero
        # keys and values (its key mask lets it see only the spare column), so its output is finite and unused.
        out = self._attended(layer, q[:n], k_pre[:n], k[:n], v[:n])
        extra = (0, 0, 0, 0, 0, 0, 0, q.shape[0] - n)
        return F.pad(out, extra) if isinstance(out, torch.Tensor) else tuple(F.pad(x, extra) for x in out)

    def _attended(self, layer, q, k_pre, k, v):
        together = self._together(layer, q, k, v)
        if len(together) == 1 and len(self.parts) > 1:
            whole = together[0]
            return whole if isinstance(whole, torch.Tensor) else self._placed(*whole, k, v)
        got = [g if g is not None else self._kv(p, rows, layer, q, k_pre, k, v)
               for g, (p, rows) in zip(together, self.parts)]
        fused = [isinstance(g, torch.Tensor) for g in got]
        if not any(fused):
            return self._placed(*self._side_by_side(got), k, v)
        # Some stores attended themselves: attend the other rows here, then put the outputs in row order.
        outputs = []
        for (p, rows), g, own in zip(self.parts, got, fused):
            if own:
                outputs.append(F.pad(g, (0, 0, 0, q.shape[2] - g.shape[2])))
            else:
                kk, vv = (F.pad(x, (0, 0, 0, self.key_len - x.shape[2])) for x in g)
                kk, vv = self._gathered([(kk, vv)], rows, k, v)
                outputs.append(attend(q[rows], kk, vv, self.key_mask[rows]))
        return torch.cat(outputs)

    def _side_by_side(self, got: list) -> tuple[torch.Tensor, torch.Tensor]:
        """Every part's keys and values ``[n, H_kv, T_n, D]`` side by side, ``[R, H_kv, key_len, D]`` (zeros past
        a row's length: no key there gets weight, and a zero value keeps the weighted sum finite). A lone part
        that already spans ``key_len`` is used as it is (its store's own buffer: only its window and spare
        columns are written, which nothing reuses)."""
        padded = [tuple(F.pad(x, (0, 0, 0, self.key_len - x.shape[2])) if x.shape[2] < self.key_len else x
                        for x in g) for g in got]
        if len(padded) == 1:
            return padded[0]
        return torch.cat([g[0] for g in padded]), torch.cat([g[1] for g in padded])

    def _placed(self, kk: torch.Tensor, vv: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """``kk, vv`` ``[R, H_kv, key_len, D]`` (every row of the forward) with the fresh window's K/V copied over
        their key columns (:attr:`dest`), in place: one row copy per layer and tensor (``index_copy_`` of
        D-wide rows on the flattened buffers; the same values a scatter would write)."""
        if not (kk.is_contiguous() and vv.is_contiguous()):
            return self._gathered([(kk, vv)], slice(None), k, v)
        r, h, w, d = k.shape
        if self._flat is None or self._flat.shape[0] != r * h * w:
            self._flat = window_flat_index(self.dest, h, self.key_len)
        kk.view(-1, d).index_copy_(0, self._flat, k.reshape(-1, d))
        vv.view(-1, d).index_copy_(0, self._flat, v.reshape(-1, d))
        return kk, vv

    def _gathered(self, got, rows, k, v):
        ks, vs = [g[0] for g in got], [g[1] for g in got]
        kk = ks[0] if len(ks) == 1 else torch.cat(ks)
        vv = vs[0] if len(vs) == 1 else torch.cat(vs)
        dest = self.dest[rows].expand(-1, k.shape[1], -1, k.shape[3])
        # In place: a store's own buffer only has its window columns (never reused) and spare column written.
        kk.scatter_(2, dest, k[rows])
        vv.scatter_(2, dest, v[rows])
        return kk, vv


def _inputs(model: DiffusionLM, group: list[Pass], pad_id: int, bucket: Bucket | None = None,
            pool: KVPool | None = None) -> dict:
    """The model's keyword arguments for the forward over ``group`` (passes of one kind and one layer range):
    inputs and positions right-padded to the widest pass, the key mask, the KV hook, RoPE's table bound, and
    for a pass split by layers (`service.runtime.scheduler.split_by_layers`) its layer range and the hidden states
    its previous piece left (padded columns: zeros; no real column attends to them, the key mask says so).
    With ``bucket`` (a window group, :class:`Bucket`) the shapes are the bucket's: rows, input
    width and keys padded up to it; a padded row's input is ``pad_id`` at position 0 and it sees only the spare
    key column. With ``pool`` (a window group whose every pass reads its whole store's run in ``pool``,
    `FullPrecisionKVStore.run`) the hook gathers the rows from the pool (`service.engine.kv_pool.PooledReuse`),
    padded rows included; quantized stores held in its packed pool attend in one fused launch per layer over it
    (`service.quant.pooled.PooledPacked`)."""
    device = group[0].input_ids.device
    width = max(p.width for p in group) if bucket is None else bucket.width
    one = len(group) == 1 and bucket is None
    ids = group[0].input_ids if one else torch.cat([_padded(p.input_ids, width, pad_id) for p in group])
    positions = group[0].positions if one else torch.cat([_padded(p.positions, width) for p in group])
    pads = [pad for p in group for pad in p.pads]
    lengths = [p.seq_len for p in group for _ in p.rows]
    longest = max(lengths)
    window = group[0].kind == "window"
    key_len = width if not window else longest + 1 if bucket is None else bucket.key_len
    extra = 0 if bucket is None else bucket.rows - len(lengths)
    if extra:
        ids = F.pad(ids, (0, 0, 0, extra), value=pad_id)
        positions = F.pad(positions, (0, 0, 0, extra))
    key_mask = None
    if window or any(pads) or any(t < key_len for t in lengths):
        keys = torch.arange(key_len, device=device)[None, :]
        key_mask = ((keys >= torch.tensor(pads + [key_len - 1] * extra, device=device)[:, None])
                    & (keys < torch.tensor(lengths + [key_len] * extra, device=device)[:, None]))
    hook = None
    if window:  # padded rows (width 0): every input column to the spare key column
        starts = [p.input_start for p in group for _ in p.rows] + [0] * extra
        widths = [p.width for p in group for _ in p.rows] + [0] * extra
        wcols = torch.arange(width, device=device)[None, :]
        dest = torch.where(wcols < torch.tensor(widths, device=device)[:, None],
                           wcols + torch.tensor(starts, device=device)[:, None], key_len - 1)[:, None, :, None]
        if pool is not None and getattr(group[0].cohort.store, "packed_runs", None) is not None:
            # the store knows its packed format (the engine imports nothing of service.quant)
            hook = group[0].cohort.store.pooled_hook(pool.packed, group, ids.shape[0], key_len, device)
        elif pool is not None:
            where = pool.rows_where([(p.cohort.store.run, len(p.rows)) for p in group], ids.shape[0], device)
            hook = PooledReuse(pool, where, dest, key_len)
        else:
            n = len(lengths)  # the hook attends the real rows only (a padded row's output is zeros)
            hook = BatchedReuse(group, key_len, dest[:n] if extra else dest, key_mask[:n], model.rope)
    elif any(p.hook is not None for p in group):
        hook = BlockWrites(group)
    found = {"input_ids": ids, "positions": positions, "key_mask": key_mask, "kv_hook": hook,
             "max_position": longest if bucket is None else key_len}
    if group[0].layers is not None:
        found["layers"] = group[0].layers
        if group[0].hidden is not None:
            found["hidden"] = (torch.cat([F.pad(p.hidden, (0, 0, 0, width - p.width)) for p in group])
                               if len(group) > 1 else group[0].hidden)
    return found


def run_piece(model: DiffusionLM, group: list[Pass], pad_id: int) -> torch.Tensor:
    """A forward over the layers of ``group``'s range that are not the last (a block-initial pass split by
    layers, `service.runtime.scheduler.split_by_layers`): its KV hook writes those layers' reused K/V, and the
    hidden states after the range come back, ``[R, W, C]`` (rows in group order, right-padded to the widest
    pass), for the next piece; no LM head, no reveal."""
    return model(**_inputs(model, group, pad_id))


def run_forward(model: DiffusionLM, group: list[Pass], pad_id: int, columns: list[list[int]] | None = None,
                bucket: Bucket | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One forward over ``group`` (passes of one kind; of a pass split by layers, its last piece): the logits at
    each row's reveal columns ``[R, W_r, V]``
    and the tokens there now ``[R, W_r]`` (int64), rows in group order, right-padded to the widest reveal, and
    None. With ``columns`` (per row, window columns as `Cohort.reveal_columns` gives them) the LM head runs only
    there: the logits are ``[R, M, V]`` (M the longest list; shorter rows repeat their last column) and the third
    value is their window columns, int64 ``[R, M]`` with padded entries W_r (`RevealBatch.columns`). With ``bucket``
    the forward runs at the bucket's shapes (:func:`_inputs`) and what comes back is its real rows only."""
    inputs = _inputs(model, group, pad_id, bucket)
    ids, device = inputs["input_ids"], inputs["input_ids"].device
    reveal = max(p.reveal_width for p in group)
    offsets = [p.logits_offset for p in group for _ in p.rows]
    last = [p.reveal_width - 1 for p in group for _ in p.rows]
    cols = torch.arange(reveal, device=device)[None, :]
    if all(p.reveal_width == reveal for p in group):
        at = cols + torch.tensor(offsets, device=device)[:, None]
    else:
        at = torch.minimum(cols, torch.tensor(last, device=device)[:, None]) + torch.tensor(offsets, device=device)[:, None]
    listed, logits_at = None, at
    if columns is not None:
        most = max(len(c) for c in columns)
        # One host-to-device copy: the listed window columns (padded with W) and the input columns the LM head
        # reads (padded with the row's last listed column).
        both = torch.tensor([[c + [reveal] * (most - len(c)) for c in columns],
                             [[j + o for j in c + [c[-1]] * (most - len(c))] for c, o in zip(columns, offsets)]],
                            device=device)
        listed, logits_at = both[0], both[1]
    rows = at.shape[0]
    if ids.shape[0] > rows:  # rows padded to a bucket: their logits are made and dropped
        logits_at = F.pad(logits_at, (0, 0, 0, ids.shape[0] - rows))
    logits = model(**inputs, logits_at=logits_at)
    return logits[:rows], ids[:rows].gather(1, at), listed


def _whole(call: Pass) -> Pass:
    """``call`` over every layer: the last piece of a pass split by layers, run again alone on the failure path,
    runs the whole pass (a quantized store starts its block again when a layer it holds is written again, so
    running only the last piece again would drop the earlier pieces' layers)."""
    return call if call.layers is None else replace(call, layers=None, hidden=None)


def _advanced_by_reveal(group: list[Pass]) -> list[tuple]:
    """What a reveal advances in each row of ``group``, as it is now: (generator, its state, grammar state, its
    mark), None where the row has none (a greedy row has no generator, an unconstrained one no grammar)."""
    saved = []
    for call in group:
        for r in call.rows:
            row = call.cohort.rows[r]
            saved.append((row.generator, row.generator.get_state() if row.generator is not None else None,
                          row.grammar, row.grammar.mark() if row.grammar is not None else None))
    return saved


def _restore(saved: list[tuple]) -> None:
    """Put back what :func:`_advanced_by_reveal` saved."""
    for generator, state, grammar, mark in saved:
        if generator is not None:
            generator.set_state(state)
        if grammar is not None:
            grammar.restore(mark)


class RunningBatch:
    """The cohorts being decoded together; :meth:`step` runs one iteration (module doc).

    Args:
        model: the network; pad_id: the token id of padded input columns.
        plan: how :meth:`step` groups an iteration's passes into forwards (default :func:`alone`; the server's
            loop plans each iteration itself, :meth:`passes` then :meth:`run`).
        forward: runs one forward (default :func:`run_forward`; `service.engine.graphs.LaterSteps` replays graphs).
        pool: the pool the full-precision stores of the cohorts it starts keep their K/V in
            (`FullPrecisionKVStore.use_pool`, `service.engine.kv_pool`; the graphs' ``LaterSteps.pool``), or None.

    **Who keeps the running set.** The caller does: each iteration starts with the cohorts it names
    (:meth:`passes`), and :meth:`run` returns the ones that finished and lists the ones that failed (both have left:
    their stores are freed); the batch keeps only each cohort's next call between iterations. So data flows one
    way, and nothing of the caller runs inside :meth:`run`. The server's worker keeps its running map and never
    calls :meth:`join` (`service.runtime.loop`); a caller with no running set of its own (`Engine.generate`,
    tests, benchmarks) lets :meth:`join` keep one for it in :attr:`cohorts` and runs :meth:`step`.

    Attributes:
        cohorts: the cohorts :meth:`join` added and that have not left, oldest first (empty in the server).
        forwards: forward calls made by the last :meth:`step` (more when a merged forward failed); merged: the most
            cohorts that shared one of them; rows: row-forwards of the last step (rows summed over forwards).
        failed: (cohort, exception) of the cohorts that failed in the last :meth:`step` (they have left; module
            doc, "A failing row fails alone").
    """

    def __init__(self, model: DiffusionLM, pad_id: int, plan: Plan = alone, forward: Forward = run_forward,
                 pool: KVPool | None = None) -> None:
        self.model, self.pad_id, self.plan = model, pad_id, plan
        # Runs a forward and gives its logits (issue 41: the later-step forward captured once per bucket and
        # replayed, `service.engine.graphs.LaterSteps`, wraps run_forward here).
        self.forward_call = forward
        # Where the full-precision stores of the cohorts it starts keep their K/V (the graphs' pool), or None.
        self.pool = pool
        self.cohorts: list[Cohort] = []
        self._next: dict[Cohort, Pass] = {}
        self.forwards = self.merged = self.rows = 0
        self.failed: list[tuple[Cohort, BaseException]] = []
        self._finished: list[Cohort] = []

    def join(self, cohort: Cohort, call: Pass | None = None) -> None:
        """Add a cohort to :attr:`cohorts` (the running set :meth:`step` decodes); its first call is made at the
        next :meth:`step`, or is ``call`` when given (:meth:`resume`)."""
        self.cohorts.append(cohort)
        if call is not None:
            self.resume(cohort, call)

    def resume(self, cohort: Cohort, call: Pass) -> None:
        """Give a preempted cohort back the call :meth:`preempt` took from it: the next iteration that names it
        (:meth:`passes`) runs that call, so it resumes exactly where it stopped."""
        self._next[cohort] = call

    def preemptible(self, cohort: Cohort) -> bool:
        """Whether :meth:`preempt` may take ``cohort`` out now: its next call is a full pass, which reads nothing
        from its KV store (a block-initial pass rewrites the store whole; cache mode ``none`` and the
        whole-response schedule hold nothing), so it is at a block boundary (or holds no K/V) and every token
        it revealed is final."""
        call = self._next.get(cohort)
        # Between the pieces of a pass split by layers the store holds some layers of the block: not a boundary.
        return call is not None and call.kind == "full" and call.hidden is None

    def preempt(self, cohort: Cohort) -> Pass:
        """Take ``cohort`` out between iterations and free its KV store; return its next call, which
        :meth:`join` takes back to resume it. Nothing is recomputed beyond that call: a block-initial pass
        rebuilds the store from the prompt and the committed tokens, as it would have at this block anyway.
        The cohort's host state (tokens, counts, generators, grammar, streamed blocks) stays on it.

        Raises:
            ValueError: not :meth:`preemptible`.
        """
        if not self.preemptible(cohort):
            raise ValueError("a cohort is preempted only when its next call is a full pass")
        call = self._next.pop(cohort)
        if cohort in self.cohorts:
            self.cohorts.remove(cohort)
        cohort.store.clear()
        return call

    def leave(self, cohort: Cohort) -> None:
        """Let a cohort go now (finished, failed, its client went away): its next call is dropped, its KV store
        freed, and it leaves :attr:`cohorts` if :meth:`join` put it there."""
        if cohort in self.cohorts:
            self.cohorts.remove(cohort)
        self._next.pop(cohort, None)
        cohort.store.clear()

    def _ask(self, cohort: Cohort, finished: list[Cohort]) -> None:
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

    def step(self, on_done: Callable[[Cohort], None] | None = None) -> list[Cohort]:
        """One iteration of :attr:`cohorts` (module doc): :meth:`passes`, the batch's plan groups them into
        forwards, :meth:`run`. Returns the cohorts that finished (they have left, their stores cleared), after
        ``on_done`` was called for each (a caller's callback that raises fails that cohort alone: it goes into
        :attr:`failed` instead). Cohorts that failed leave too and are listed in :attr:`failed` (never raised,
        even for the only cohort: module doc); only a fault outside every cohort (the iteration's one host read)
        raises, and the cohorts stay in the batch then.
        """
        finished = self.run(self.plan(self.passes(self.cohorts)))
        if on_done is not None:
            for cohort in list(finished):
                try:
                    on_done(cohort)
                except Exception as exc:  # noqa: BLE001 -- the caller's callback for this cohort: its fault alone
                    finished.remove(cohort)
                    self.failed.append((cohort, exc))
        return finished

    def passes(self, cohorts: Sequence[Cohort]) -> list[Pass]:
        """Start an iteration of ``cohorts`` (the caller's running set, oldest first: class doc): the next call of
        each, for a plan to group into forwards. A cohort not seen since it last left is asked now; one with no
        call finishes (:meth:`run` returns it); one that raises goes into :attr:`failed`."""
        self._finished = []
        self.failed = []
        self.forwards = self.merged = self.rows = 0
        for cohort in cohorts:
            if cohort not in self._next:  # new since the last iteration
                if self.pool is not None:  # before its first call writes anything
                    cohort.store.use_pool(self.pool)
                self._ask(cohort, self._finished)
        return [self._next[c] for c in cohorts if c in self._next]

    def run(self, forwards: list[list[Pass]]) -> list[Cohort]:
        """Run the iteration :meth:`passes` started, as planned: each group one forward (passes of one kind) and
        one reveal, then the iteration's one host read; a pass the plan left out waits for the next iteration.
        Returns the cohorts that finished (they have left: :meth:`leave`); the ones that failed have left too and
        are in :attr:`failed` (never raised: module doc); only a fault outside every cohort (the iteration's one
        host read) raises, and every cohort keeps its state then."""
        finished = self._finished
        done: list[tuple[list[Pass], RevealResult]] = []
        for group in forwards:
            self.merged = max(self.merged, len(group))
            if group[0].layers is not None and group[0].layers[1] < len(self.model.layers):
                self._run_piece(group)
                continue
            done += self._run_group(group)
        self._absorb(done)
        for group, _ in done:
            for call in group:
                del self._next[call.cohort]
                if self._has_failed(call.cohort):
                    continue
                self._ask(call.cohort, finished)
        for cohort, _ in self.failed:
            self.leave(cohort)
        self._finished = []
        return finished

    def _absorb(self, done: list[tuple[list[Pass], RevealResult]]) -> None:
        """The iteration's one host read (with the verdicts of the write checks put off, module doc), then each
        cohort's host bookkeeping; a cohort whose checks failed goes into :attr:`failed` with the write's error."""
        if not done:
            return
        flat = [torch.cat([res.counts[:, None], res.masks_left[:, None], res.stop[:, None].long(), res.tokens],
                          dim=1).flatten() for _, res in done]
        checked = [(call, verdict) for group, _ in done for call in group
                   if (verdict := call.cohort.store.take_checks()) is not None]
        if checked:
            flat.append(torch.stack([verdict for _, verdict in checked]).long())
        values = (flat[0] if len(flat) == 1 else torch.cat(flat)).tolist()
        for (call, _), passed in zip(checked, values[len(values) - len(checked):]):
            if not passed and not self._has_failed(call.cohort) and (exc := self._checked_again(call)) is not None:
                self.failed.append((call.cohort, exc))
        offset = 0
        for group, res in done:
            width = 3 + res.tokens.shape[1]
            read = self._read_logprobs(res)
            for call, rows in zip(group, _rows(group)):
                if self._has_failed(call.cohort):  # its window was never written back (module doc)
                    continue
                table = [values[offset + r * width: offset + (r + 1) * width] for r in range(rows.start, rows.stop)]
                try:
                    call.cohort.absorb(call, [t[0] for t in table], [t[1] for t in table], [bool(t[2]) for t in table],
                                       [t[3:] for t in table], self._logprobs(call, rows, read))
                except Exception as exc:  # noqa: BLE001 -- one cohort's fault is its own (a callback of its caller)
                    self.failed.append((call.cohort, exc))
            offset += width * res.tokens.shape[0]

    def _has_failed(self, cohort: Cohort) -> bool:
        return any(c is cohort for c, _ in self.failed)

    @staticmethod
    def _read_logprobs(res: RevealResult) -> tuple | None:
        """The forward's revealed columns, tokens, log-probabilities and alternatives on the host, when a cohort
        of the forward asked for them (a second host read, only then), else None."""
        if res.token_logprobs is None:
            return None
        revealed, tokens, logp = res.revealed.tolist(), res.tokens.tolist(), res.token_logprobs.tolist()
        top = (list(zip(res.top_ids.tolist(), res.top_logprobs.tolist())) if res.top_ids is not None
               else [None] * len(revealed))
        return revealed, tokens, logp, top

    @staticmethod
    def _logprobs(call: Pass, rows: slice, read: tuple | None) -> list | None:
        """Per row of ``call`` (its ``rows`` of the forward), ``(column, token, logprob, [(id, logprob), ...])``
        of each revealed column, from :meth:`_read_logprobs`'s ``read`` (None: nobody asked)."""
        if read is None:
            return None
        revealed, tokens, logp, top = read
        k = call.cohort.logprobs or 0
        return [[(call.reveal_start + j, tokens[r][j], logp[r][j],
                  list(zip(top[r][0][j][:k], top[r][1][j][:k])) if top[r] is not None else [])
                 for j, hit in enumerate(revealed[r]) if hit]
                for r in range(rows.start, rows.stop)]

    @staticmethod
    def _columns(group: list[Pass]) -> list[list[int]] | None:
        """Per row of the forward, the window columns its reveal reads (`Cohort.reveal_columns`), or None (every
        column) when a cohort of the forward constrains its tokens or asks for log-probabilities (they read
        the whole window) or when no row would skip a column."""
        if any(call.cohort.allowed is not None or call.cohort.logprobs is not None for call in group):
            return None
        columns = [c for call in group for c in call.cohort.reveal_columns(call)]
        widths = [call.reveal_width for call in group for _ in call.rows]
        if all(len(c) == w for c, w in zip(columns, widths)):
            return None
        return columns

    def _forward(self, group: list[Pass]) -> tuple[RevealResult, list[tuple[Cohort, BaseException]]]:
        """The group's forward (the LM head only at the columns its reveal reads) and reveal (:meth:`_reveal`);
        a reveal that raises is undone (module doc) before the exception goes on."""
        logits, tokens, columns = self.forward_call(self.model, group, self.pad_id, self._columns(group))
        saved = _advanced_by_reveal(group)
        try:
            return self._reveal(group, logits, tokens, columns)
        except Exception:
            _restore(saved)
            raise

    def _reveal(self, group: list[Pass], logits: torch.Tensor, tokens: torch.Tensor,
                columns: torch.Tensor | None = None) -> tuple[RevealResult, list[tuple[Cohort, BaseException]]]:
        """The group's one batched reveal; its rows' new windows written back into their cohorts. ``logits`` at
        ``columns`` only when given (`RevealBatch.columns`). Returns the reveal and the (cohort, exception) of
        each cohort whose grammar failed (module doc): its rows' results are not written back, the others'
        are exactly what they would be without it."""
        first = group[0].cohort
        lists: dict[str, list] = {}
        for call in group:
            for key, values in call.cohort.reveal_rows(call).items():
                lists.setdefault(key, []).extend(values)
        allowed = None
        if any(call.cohort.allowed is not None for call in group):
            allowed = torch.ones(logits.shape, dtype=torch.bool, device=logits.device)
            for call, rows in zip(group, _rows(group)):
                if call.cohort.allowed is not None:
                    for j, r in enumerate(call.rows):
                        mask = call.cohort.allowed(r, call)
                        if mask is not None:
                            allowed[rows.start + j, : mask.shape[0] if mask.shape[0] > 1 else None] = mask
        wanted = [call.cohort.logprobs for call in group if call.cohort.logprobs is not None]
        # The chains below rewrite the logits in place; the log-probabilities are the model's, read before.
        model_logits = logits.clone() if wanted and self._constrained_rows(group) else None
        fixed, faults = self._constrain(group, logits, lists)
        result = reveal_batch(first.rule, RevealBatch(
            logits=logits, tokens=tokens, mask_id=first.spec.mask_id, eos=first.eos, banned=first.banned,
            allowed=allowed, logprobs=max(wanted) if wanted else None, logprob_logits=model_logits,
            columns=columns, **lists,
        ))
        if fixed:
            rows, masks_left = zip(*fixed)
            result.masks_left[list(rows)] = torch.tensor(masks_left, device=result.masks_left.device)
        failing = {id(cohort) for cohort, _ in faults}
        for call, rows in zip(group, _rows(group)):
            if id(call.cohort) not in failing:
                call.cohort.write(call, result.tokens[rows])
        return result, faults

    @staticmethod
    def _constrained_rows(group: list[Pass]) -> list[tuple[int, Pass, int]]:
        """(batch row, pass, row of the pass) of each grammar-constrained row of the forward."""
        return [(rows.start + j, call, j) for call, rows in zip(group, _rows(group))
                for j, r in enumerate(call.rows) if call.cohort.rows[r].grammar is not None]

    @staticmethod
    def _constrain(group: list[Pass], logits: torch.Tensor, lists: dict[str, list],
                   ) -> tuple[list[tuple[int, int]], list[tuple[Cohort, BaseException]]]:
        """The grammar-constrained rows of the forward (`service.engine.grammar`): their chains are decided
        together (one mask fill for all of them per position, across requests), then handed to the batched
        reveal as exactly those columns: the row's window ends after its chain, each chain column's logits keep
        only its token (written in place: ``logits`` serve this reveal only), and the row reveals every candidate
        (no count, no threshold, no sampling: the chain already chose). Returns, per constrained row, (batch row,
        masks left after the call): the reveal counts masks only within the shortened window; and the (cohort,
        `GrammarViolation`) of each cohort a row of which failed its grammar (its rows are left as they are:
        their reveal is not used)."""
        found = RunningBatch._constrained_rows(group)
        if not found:
            return [], []
        chains = [call.cohort.constrained_row(call, j, logits[b]) for b, call, j in found]
        constrained_reveal(chains, group[0].cohort.banned)
        faults: dict[int, tuple[Cohort, BaseException]] = {}
        for (_, call, _), chain in zip(found, chains):
            if chain.error is not None and id(call.cohort) not in faults:
                faults[id(call.cohort)] = (call.cohort, chain.error)
        fixed = []
        for (b, call, j), chain in zip(found, chains):
            if id(call.cohort) in faults:
                continue
            end = chain.start + len(chain.chosen)
            columns = torch.arange(chain.start, end, device=logits.device)
            tokens = torch.tensor(chain.tokens, device=logits.device)
            kept = logits[b, columns, tokens]
            logits[b, chain.start:end] = float("-inf")
            logits[b, columns, tokens] = kept
            for key, value in (("width", end), ("count", None), ("fraction", None), ("first_only", False),
                               ("threshold", None), ("temperature", 0.0), ("generator", None),
                               ("random_remasking", False), ("neg_entropy", False)):
                lists[key][b] = value
            fixed.append((b, call.reveal_width - end))
        return fixed, list(faults.values())

    def _checked_again(self, call: Pass) -> BaseException | None:
        """The failure path of a write whose checks were put off (module doc): the block-initial pass run again
        alone, its window columns back to masks (a block is all masks before its first call, and the reveal has
        written them since), each check read at once; what it raises, or None (a false alarm: the same K/V were
        written again)."""
        ids = call.input_ids.clone()
        ids[:, call.logits_offset: call.logits_offset + call.reveal_width] = call.cohort.spec.mask_id
        self.forwards += 1
        try:  # the whole pass, every layer, when it was split by layers
            run_forward(self.model, [replace(call, input_ids=ids, layers=None, hidden=None)], self.pad_id)
        except Exception as exc:  # noqa: BLE001 -- the cohort's own fault, handed to the caller
            return exc
        return None

    def _run_piece(self, group: list[Pass]) -> None:
        """A piece of the group's passes split by layers, not their last (`run_piece`): its layers' K/V written
        (their checks put off to the read of the iteration that runs the last piece), and each pass's next call
        becomes the rest of its layers from the hidden states it reached, for the next iteration. When the
        forward raises, each pass runs its layers up to the piece's end again alone (from layer 0: a quantized
        store starts its block again when a layer it holds is written again), the failing ones into
        :attr:`failed`."""
        self.forwards += 1
        deferred = DEFER_WRITE_CHECKS.set(True)
        try:
            parts = [(group, run_piece(self.model, group, self.pad_id))]
        except Exception as exc:  # noqa: BLE001 -- one cohort's fault is its own (module doc)
            parts = []
            if len(group) == 1:
                self.failed.append((group[0].cohort, exc))
                return
        finally:
            DEFER_WRITE_CHECKS.reset(deferred)
        if not parts:
            for call in group:
                self.forwards += 1
                again = replace(call, layers=(0, call.layers[1]), hidden=None)
                try:
                    parts.append(([again], run_piece(self.model, [again], self.pad_id)))
                except Exception as exc:  # noqa: BLE001 -- isolate the culprit
                    self.failed.append((call.cohort, exc))
        last = len(self.model.layers)
        for members, hidden in parts:
            self.rows += sum(len(p.rows) for p in members)
            for call, rows in zip(members, _rows(members)):
                self._next[call.cohort] = replace(call, layers=(call.layers[1], last),
                                                  hidden=hidden[rows, : call.width])

    def _run_group(self, group: list[Pass]) -> list[tuple[list[Pass], RevealResult]]:
        """The group's forward and reveal, its stores' write checks put off to the iteration's read, the cohorts
        whose grammar failed into :attr:`failed`; when the forward raises, each pass again alone with every check
        read at once, the failing ones into :attr:`failed` (module doc)."""
        self.forwards += 1
        deferred = DEFER_WRITE_CHECKS.set(True)
        try:
            result, faults = self._forward(group)
        except Exception as exc:  # noqa: BLE001 -- one cohort's fault is its own (module doc)
            if len(group) == 1:
                self.failed.append((group[0].cohort, exc))
                return []
        else:
            self.rows += sum(len(p.rows) for p in group)
            self.failed += faults
            return [(group, result)]
        finally:
            DEFER_WRITE_CHECKS.reset(deferred)
        done = []
        for call in group:
            self.forwards += 1
            try:
                result, faults = self._forward([_whole(call)])
            except Exception as exc:  # noqa: BLE001 -- isolate the culprit
                self.failed.append((call.cohort, exc))
                continue
            done.append(([call], result))
            self.rows += len(call.rows)
            self.failed += faults
        return done
