"""Block-diffusion decoding of a cohort, one forward call at a time: no cache, prefix cache and dual cache
(Fast-dLLM semantics).

Reference: NVlabs/Fast-dLLM commit 24cc59e, `llada/generate.py` (``generate``, ``generate_with_prefix_cache``,
``generate_with_dual_cache``) and `dream/model/generation_utils_block.py` / `generation_utils.py`; golden SPEC
section 3; paper "Preliminary". A **cohort** is the rows of one `generate` call (or one server request): they share
one :class:`DecodeParams` and one KV store, are left-padded together (``[left padding][prompt][response]``) and
move from block to block together. The response is ``gen_length`` masks cut into blocks decoded left to right.

Per block (block mode):

1. **Block-initial pass**: a full forward over the whole sequence (nfe + 1). In cached modes every layer writes its
   reused columns to the KV store (``store.write``). The model family's reveal rule
   (`service.engine.reveal`) reveals among the block's masks (Dream: exactly the block's first column).
2. Until the block has no mask: one forward (nfe + 1) -- full (``none``), block + suffix with the reused prefix
   (``prefix``), or block only with reused prefix and suffix (``dual``) -- then reveal among the block's masks.

When the reveal rule asks for its whole-response algorithm (Dream, ``cache_mode="none"``,
``dream_schedule="origin"``), every call is a full forward over the response's masks (:class:`Canvas`).

A cohort never runs a forward itself: :meth:`Cohort.next_pass` says what its next call needs (a :class:`Pass`) and
:meth:`Cohort.apply` takes that call's logits, so `service.engine.batch` can put the passes of many cohorts, at
different blocks and steps, into one forward.

Departures from the reference (tokens never differ from it in fp32; NFE only lower):

* No forward is made for a block that is already full: the reference's cached loops always make one more call
  after the block-initial pass, which reveals nothing when that pass filled the block (LLaDA threshold 0.0,
  golden ``llada_p17_g64_thr0.0_{prefix,dual}``: reference NFE 4, here 2), and crash with an IndexError when
  ``steps == number of blocks``; here both work and take one call per block.
* Batches: each row decodes exactly as it would alone (per-row schedule, confidence, NFE, RNG); the reference
  supports batch 1 only. A row whose block is full sits out the rest of that block's steps.
* EOS: unless ``ignore_eos``, a row stops as soon as every position up to its first EOS is revealed (the reference
  always decodes every block); its tokens up to that EOS are the same as with ``ignore_eos``.
* Dream's fixed (entropy) schedule needs >= 2 steps per block in block mode (the reference leaves 31 of 32
  masks in every block with 1 step per block; rejected at the engine boundary).
* Temperature > 0: see `service.engine.sampling` (per-row seeded noise).
* The mask id, and ids the tokenizer cannot decode, are never chosen (`service.engine.sampling`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch

from service.engine.cache_hooks import BlockInitialWrite, ReuseRead
from service.engine.kv_store import KVStore, Segments
from service.engine.models import DiffusionLM
from service.engine.models.layers import KVHook
from service.engine.params import DecodeParams, RowOptions
from service.engine.report import TokenLogprob
from service.engine.response import cut_response
from service.engine.reveal import Canvas
from service.engine.spec import ModelSpec

OnBlock = Callable[[int, list[list[int]]], None]
Cancelled = Callable[[], list[bool]]


@dataclass
class RowState:
    """Decoding state and accounting of one row (what the row would have alone).

    Attributes:
        pad: left-padding columns of the row.
        temperature: sampling temperature; generator: the row's RNG (None when greedy and not random remasking).
        nfe: forward calls the row took part in; reveals: tokens revealed at each of them;
        steps_per_block: forward calls per block the row worked on.
        status: ``running``, ``stop`` (stopped at EOS), ``cancelled``.
        plan: the fixed schedule's reveal counts of the current block (None under a threshold).
        canvas: the whole-response schedule's state (None in block mode).
    """

    pad: int
    temperature: float
    generator: torch.Generator | None
    nfe: int = 0
    reveals: list[int] = field(default_factory=list)
    steps_per_block: list[int] = field(default_factory=list)
    status: Literal["running", "stop", "cancelled"] = "running"
    plan: list[int] | None = None
    canvas: Canvas | None = None
    # Response position -> its token's log-probability and alternatives, when the row asked (RowOptions.logprobs).
    logprobs: dict[int, TokenLogprob] = field(default_factory=dict)


@dataclass
class Pass:
    """One cohort's part of a forward call.

    Attributes:
        cohort: who asked; rows: its row indices in the call (ascending).
        kind: ``full`` (the input is every column of the sequence) or ``window`` (the input is the active block, or
            block + suffix, next to reused K/V read from the store).
        input_ids, positions: int64 ``[n, L]``; key_mask: bool ``[n, T]`` over the keys (True = attend), or None
            when no row of the pass is padded; key_len: T, the keys each row attends over.
        hook: the cohort's KV hook of this call, or None.
        logits_cols: int64 ``[N]`` input columns whose logits the reveal needs (position-aligned).
        step: the call's index within the block (0 = block-initial pass); -1 for a whole-response call.
    """

    cohort: Cohort
    rows: list[int]
    kind: Literal["full", "window"]
    input_ids: torch.Tensor
    positions: torch.Tensor
    key_mask: torch.Tensor | None
    key_len: int
    hook: KVHook | None
    logits_cols: torch.Tensor
    step: int


class Cohort:
    """The rows of one request (or `generate` call) with one :class:`DecodeParams` and one KV store.

    Args:
        model: the network (its class carries the reveal rule); spec: its :class:`ModelSpec`.
        prompts: token ids per row (validated by the engine: non-empty, in vocabulary, no mask id).
        params: the cohort's settings; rows: per-row options (same length as prompts).
        store: holds the reused K/V of cached modes (unused with ``cache_mode="none"``).
        on_block: called as ``on_block(block_index, ids)`` each time a further block is committed for every row
            still decoding; ``ids`` are, per row, the response ids committed so far (cut after the first EOS unless
            ``ignore_eos``).
        cancelled: polled after every forward call; rows it marks True stop decoding.

    Attributes:
        done: no further call is needed; started_s, finished_s: ``perf_counter`` at the first call and when done;
        first_block_s: seconds from the first call to the first block committed by every row.
    """

    def __init__(
        self, model: DiffusionLM, spec: ModelSpec, prompts: list[list[int]], params: DecodeParams,
        rows: list[RowOptions], store: KVStore, on_block: OnBlock | None = None, cancelled: Cancelled | None = None,
    ) -> None:
        self.model, self.spec, self.params, self.store, self.row_options = model, spec, params, store, rows
        self.rule = type(model).reveal_rule
        self.on_block, self.cancelled = on_block, cancelled
        device = model.embed.weight.device
        longest = max(len(p) for p in prompts)
        self.response_start = longest
        self.seq_len = longest + params.gen_length
        self.x = torch.full((len(prompts), self.seq_len), spec.mask_id, dtype=torch.long, device=device)
        for i, prompt in enumerate(prompts):
            pad = longest - len(prompt)
            self.x[i, :pad] = spec.pad_id
            self.x[i, pad:longest] = torch.tensor(prompt, dtype=torch.long)
        self.pads = torch.tensor([longest - len(p) for p in prompts], device=device)
        self.positions = (torch.arange(self.seq_len, device=device) - self.pads[:, None]).clamp(min=0)
        self.eos = torch.tensor(spec.eos_ids, device=device)
        self.banned = torch.tensor(spec.banned_ids, dtype=torch.long, device=device)
        self.rows = [
            RowState(pad=longest - len(p), temperature=o.temperature, generator=_row_generator(o, params, device))
            for p, o in zip(prompts, rows)
        ]
        self.num_blocks = params.gen_length // params.block_length
        self.canvas = self.rule.uses_canvas(params)
        if self.canvas:
            for state in self.rows:
                state.canvas = self.rule.start_canvas(params)
                state.steps_per_block.append(0)  # the whole response is one canvas
        self.block, self.step = 0, 0
        self._live: list[int] = []
        self._segments: Segments | None = None
        self._emitted_blocks = 0
        self.done = False
        self.started_s = self.finished_s = 0.0
        self.first_block_s = 0.0

    # ------------------------------------------------------------------------------------------------- calls

    def next_pass(self) -> Pass | None:
        """What the cohort's next forward call needs, or None once it is done (then ``done`` is True)."""
        if self.done:
            return None
        if not self.started_s:
            self.started_s = time.perf_counter()
        found = self._canvas_pass() if self.canvas else self._block_pass()
        if found is None:
            self.done = True
            self.finished_s = time.perf_counter()
        return found

    def _canvas_pass(self) -> Pass | None:
        start, end = self.response_start, self.seq_len
        stepping = [
            r for r in self._running() if self.rows[r].canvas.step < self.rows[r].canvas.steps
            and self._has_mask(r, start, end)
        ]
        return self._full_pass(stepping, start, end, None, -1) if stepping else None

    def _block_pass(self) -> Pass | None:
        """The block loop of all three cache modes (module doc, steps 1-2)."""
        mode = self.params.cache_mode
        while True:
            start = self.response_start + self.block * self.params.block_length
            end = start + self.params.block_length
            if self.step == 0:
                live = self._running()
                if self.block >= self.num_blocks or not live:
                    return None
                self._live = live
                hook = None
                for r in live:
                    state = self.rows[r]
                    state.steps_per_block.append(0)
                    state.plan = self.rule.block_plan(int(self._mask_columns(r, start, end).numel()), self.params)
                if mode != "none":
                    self._segments = Segments(
                        pad_lengths=tuple(self.rows[r].pad for r in live), block_start=start, block_end=end,
                        seq_len=self.seq_len, cache_mode=mode,
                    )
                    hook = BlockInitialWrite(self.store, self._segments, self._key_mask(live))
                return self._full_pass(live, start, end, hook, 0)
            stepping = [r for r in self._running() if r in self._live and self._has_mask(r, start, end)]
            if stepping:
                if mode == "none":
                    return self._full_pass(stepping, start, end, None, self.step)
                return self._window_pass(stepping)
            self.block, self.step = self.block + 1, 0

    def _key_mask(self, rows: list[int]) -> torch.Tensor | None:
        """bool ``[n, T]`` (True = real token) over all columns, or None when none of ``rows`` is padded."""
        pads = self.pads[rows]
        if not bool((pads > 0).any()):
            return None
        return torch.arange(self.seq_len, device=pads.device)[None, :] >= pads[:, None]

    def _full_pass(self, rows: list[int], start: int, end: int, hook: KVHook | None, step: int) -> Pass:
        """Every column of ``rows``; logits of columns [start, end)."""
        return Pass(
            self, rows, "full", self.x[rows], self.positions[rows], self._key_mask(rows), self.seq_len, hook,
            torch.arange(start, end, device=self.x.device), step,
        )

    def _window_pass(self, rows: list[int]) -> Pass:
        """Window with reused K/V: prefix mode computes [s, T), dual mode [s, e); logits of [s, e)."""
        segments = self._segments
        start, end = segments.block_start, segments.block_end
        window_end = self.seq_len if segments.cache_mode == "prefix" else end
        selection = None
        if rows != self._live:
            selection = torch.tensor([self._live.index(r) for r in rows], device=self.x.device)
        reused_positions = None
        if self.store.pre_rope_keys:
            reused_positions = self.positions[rows][:, segments.reused_columns.to(self.x.device)]
        hook = ReuseRead(self.store, segments, selection, self.model.rope, reused_positions)
        return Pass(
            self, rows, "window", self.x[rows, start:window_end], self.positions[rows, start:window_end],
            self._key_mask(rows), self.seq_len, hook, torch.arange(0, end - start, device=self.x.device), self.step,
        )

    # -------------------------------------------------------------------------------------------------- reveals

    def apply(self, call: Pass, logits: torch.Tensor) -> None:
        """Apply one call's reveals to each of its rows (logits ``[n, N, V]`` of ``call.logits_cols``), then count
        the call, stop rows at EOS, poll cancellation and commit blocks."""
        params, counts = self.params, []
        if self.canvas:
            start, end = self.response_start, self.seq_len
        else:
            start = self.response_start + self.block * params.block_length
            end = start + params.block_length
        for j, r in enumerate(call.rows):
            state = self.rows[r]
            candidates = self._mask_columns(r, start, end)
            row_logits = logits[j, candidates - start]
            if self.canvas:
                chosen, tokens = self.rule.canvas_reveal(
                    state.canvas, row_logits, params, state.temperature, state.generator, self.banned
                )
            else:
                chosen, tokens = self.rule.reveal(
                    call.step, row_logits, params, state.plan, state.temperature, state.generator, self.banned
                )
            self.x[r, candidates[chosen]] = tokens
            if self.row_options[r].logprobs is not None:
                capture_logprobs(state.logprobs, candidates[chosen] - self.response_start, row_logits[chosen], tokens,
                                 self.row_options[r].logprobs)
            counts.append(int(chosen.numel()))
        if not self.canvas:
            self.step += 1
        self._account(call.rows, counts)

    # ------------------------------------------------------------------------------------------------ bookkeeping

    def _mask_columns(self, row: int, start: int, end: int) -> torch.Tensor:
        """Absolute columns in [start, end) of ``row`` that still hold the mask id (int64, ascending)."""
        return (self.x[row, start:end] == self.spec.mask_id).nonzero()[:, 0] + start

    def _has_mask(self, row: int, start: int, end: int) -> bool:
        return bool((self.x[row, start:end] == self.spec.mask_id).any())

    def _running(self) -> list[int]:
        return [r for r, state in enumerate(self.rows) if state.status == "running"]

    def _account(self, rows: list[int], counts: list[int]) -> None:
        """Count one forward call for ``rows``; then EOS stops, cancellation and block commits."""
        for r, count in zip(rows, counts):
            state = self.rows[r]
            state.nfe += 1
            state.reveals.append(count)
            state.steps_per_block[-1] += 1
            if not self.params.ignore_eos and self._eos_reached(r):
                state.status = "stop"
        if self.cancelled is not None:
            for r, flag in enumerate(self.cancelled()):
                if flag and self.rows[r].status == "running":
                    self.rows[r].status = "cancelled"
        self._emit_blocks()

    def _eos_reached(self, row: int) -> bool:
        """True once the row's response has an EOS with every position before it revealed."""
        response = self.x[row, self.response_start:]
        is_eos = torch.isin(response, self.eos)
        if not bool(is_eos.any()):
            return False
        first = int(is_eos.nonzero()[0, 0])
        return not bool((response[:first] == self.spec.mask_id).any())

    def response_ids(self, row: int, committed_only: bool = False) -> list[int]:
        """The row's response ids: cut after the first EOS unless ``ignore_eos``, and before the first mask."""
        response = self.x[row, self.response_start:].tolist()
        masked = [i for i, token in enumerate(response) if token == self.spec.mask_id]
        if masked:
            cut = masked[0]
            if committed_only:
                cut -= cut % self.params.block_length
            response = response[:cut]
        return cut_response(response, self.spec.eos_ids, self.params.ignore_eos).ids

    def response_logprobs(self, row: int, count: int) -> list[TokenLogprob] | None:
        """The captured log-probabilities of the row's first ``count`` response tokens (None: not asked for)."""
        if self.row_options[row].logprobs is None:
            return None
        captured = self.rows[row].logprobs
        return [captured[i] for i in range(count)]

    def _committed(self, row: int) -> CommittedIds:
        ids = CommittedIds(self.response_ids(row, committed_only=True))
        ids.logprobs = self.response_logprobs(row, len(ids))
        return ids

    def _committed_blocks(self, row: int) -> int:
        """Leading blocks of the row with no mask left (all of them once the row stopped at EOS)."""
        if self.rows[row].status == "stop":
            return self.num_blocks
        masked = (self.x[row, self.response_start:] == self.spec.mask_id).nonzero()
        first = int(masked[0, 0]) if masked.numel() else self.params.gen_length
        return first // self.params.block_length

    def _emit_blocks(self) -> None:
        """Call ``on_block`` for each block newly committed by every row that was not cancelled."""
        rows = [r for r, s in enumerate(self.rows) if s.status != "cancelled"]
        committed = min((self._committed_blocks(r) for r in rows), default=self.num_blocks)
        if committed > self._emitted_blocks and self._emitted_blocks == 0:
            self.first_block_s = time.perf_counter() - self.started_s
        if self.on_block is not None:
            for block in range(self._emitted_blocks, committed):
                self.on_block(block, [self._committed(r) for r in range(len(self.rows))])
        self._emitted_blocks = max(self._emitted_blocks, committed)


class CommittedIds(list):
    """A row's committed response ids as ``on_block`` gets them; ``logprobs`` holds their captured
    log-probabilities when the row asked for them (else None)."""

    logprobs: list[TokenLogprob] | None = None


def capture_logprobs(into: dict[int, TokenLogprob], positions: torch.Tensor, logits: torch.Tensor,
                     tokens: torch.Tensor, top_k: int) -> None:
    """Record the revealed tokens' log-probabilities under the logits that revealed them (no extra forward).

    Args:
        into: response position -> entry; positions: int64 ``[n]`` response positions revealed;
        logits: ``[n, V]`` their logits at this step (model dtype; the log-softmax runs in float32, before any
        temperature); tokens: int64 ``[n]`` the tokens chosen; top_k: alternatives kept per token.
    """
    if positions.numel() == 0:
        return
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(-1, tokens[:, None])[:, 0].tolist()
    values, ids = logp.topk(top_k, dim=-1) if top_k else (logp[:, :0], tokens[:, None][:, :0])
    for pos, token, lp, top_ids, top_values in zip(positions.tolist(), tokens.tolist(), chosen, ids.tolist(),
                                                   values.tolist()):
        into[pos] = TokenLogprob(token=token, logprob=lp, top=list(zip(top_ids, top_values)))


def _row_generator(options: RowOptions, params: DecodeParams, device: torch.device) -> torch.Generator | None:
    """The row's RNG, seeded from its request (a fresh random seed when none is given); None when greedy."""
    if options.temperature == 0 and params.remasking != "random":
        return None
    generator = torch.Generator(device=device)
    if options.seed is None:
        generator.seed()
    else:
        generator.manual_seed(options.seed)
    return generator
