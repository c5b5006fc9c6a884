"""Block-diffusion decoding of a left-padded batch: no cache, prefix cache and dual cache (Fast-dLLM semantics).

Reference: NVlabs/Fast-dLLM commit 24cc59e, `llada/generate.py` (``generate``, ``generate_with_prefix_cache``,
``generate_with_dual_cache``) and `dream/model/generation_utils_block.py` / `generation_utils.py`; golden SPEC
section 3; paper "Preliminary". Sequence layout per row: ``[left padding][prompt][response]``; the response is
``gen_length`` masks cut into blocks decoded left to right.

Per block (block mode):

1. **Block-initial pass**: a full forward over the whole sequence (nfe + 1). In cached modes every layer writes its
   reused columns to the KV store (``store.write``). LLaDA reveals by the normal rule among the block's masks;
   Dream reveals exactly the block's first column (predicted from the column before it), whatever the schedule.
2. Until the block has no mask: one forward (nfe + 1) -- full (``none``), block + suffix with the reused prefix
   (``prefix``), or block only with reused prefix and suffix (``dual``) -- then reveal among the block's masks.

Dream with ``cache_mode="none"`` runs Dream's own whole-sequence algorithm by default (``dream_schedule="origin"``,
:meth:`Decoder.run_dream_origin`), which is what the reference's no-cache path does; ``dream_schedule="block"``
gives the block loop above with full forwards (the full-recompute counterpart of the cached modes).

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
from service.engine.params import DecodeParams, RowOptions
from service.engine.response import cut_response
from service.engine.sampling import (
    dream_fixed_count,
    dream_threshold_reveals,
    dream_tokens_and_confidence,
    llada_fixed_schedule,
    llada_tokens_and_confidence,
    select_reveals,
)
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
    """

    pad: int
    temperature: float
    generator: torch.Generator | None
    nfe: int = 0
    reveals: list[int] = field(default_factory=list)
    steps_per_block: list[int] = field(default_factory=list)
    status: Literal["running", "stop", "cancelled"] = "running"


class Decoder:
    """Decodes one batch of prompts with one :class:`DecodeParams`; :meth:`run` does the work.

    Args:
        model: the network; spec: its :class:`ModelSpec`.
        prompts: token ids per row (validated by the engine: non-empty, in vocabulary, no mask id).
        params: batch-level settings; rows: per-row options (same length as prompts).
        store: holds the reused K/V of cached modes (unused with ``cache_mode="none"``).
        on_block: called as ``on_block(block_index, ids)`` each time a further block is committed for every row
            still decoding; ``ids`` are, per row, the response ids committed so far (cut after the first EOS unless
            ``ignore_eos``).
        cancelled: polled after every forward call; rows it marks True stop decoding.
    """

    def __init__(
        self, model: DiffusionLM, spec: ModelSpec, prompts: list[list[int]], params: DecodeParams,
        rows: list[RowOptions], store: KVStore, on_block: OnBlock | None = None, cancelled: Cancelled | None = None,
    ) -> None:
        self.model, self.spec, self.params, self.store = model, spec, params, store
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
        self.rows = [
            RowState(pad=longest - len(p), temperature=o.temperature, generator=_row_generator(o, params, device))
            for p, o in zip(prompts, rows)
        ]
        self.num_blocks = params.gen_length // params.block_length
        self._emitted_blocks = 0
        self._started = 0.0
        self.first_block_s = 0.0

    # ----------------------------------------------------------------------------------------------- entry points

    def run(self) -> torch.Tensor:
        """Decode every row; returns the final ids ``[B, T]`` (rows' states in ``self.rows``)."""
        self._started = time.perf_counter()
        if self.spec.arch == "dream" and self.params.cache_mode == "none" and self.params.dream_schedule == "origin":
            self.run_dream_origin()
        else:
            self.run_blocks()
        return self.x

    def run_blocks(self) -> None:
        """The block loop of all three cache modes (module doc, steps 1-2)."""
        block_length, mode = self.params.block_length, self.params.cache_mode
        for block in range(self.num_blocks):
            start = self.response_start + block * block_length
            end = start + block_length
            live = self._running()
            if not live:
                break
            for r in live:
                self.rows[r].steps_per_block.append(0)
            schedules = self._llada_schedules(live, start, end)
            hook, segments = None, None
            if mode != "none":
                segments = Segments(
                    pad_lengths=tuple(self.rows[r].pad for r in live), block_start=start, block_end=end,
                    seq_len=self.seq_len, cache_mode=mode,
                )
                hook = BlockInitialWrite(self.store, segments, self._key_mask(live))
            logits = self._forward_full(live, start, end, hook)
            self._reveal_block(live, logits, start, end, 0, schedules)
            step = 1
            while True:
                stepping = [r for r in self._running() if r in live and self._has_mask(r, start, end)]
                if not stepping:
                    break
                if mode == "none":
                    logits = self._forward_full(stepping, start, end, None)
                else:
                    logits = self._forward_cached(stepping, live, segments)
                self._reveal_block(stepping, logits, start, end, step, schedules)
                step += 1

    def run_dream_origin(self) -> None:
        """Dream's whole-sequence no-cache algorithm (reference `generation_utils.py` ``_sample``; SPEC 3.5).

        Every call is a full forward; the candidates are all masks of the response. Threshold: ``steps`` is
        ``gen_length / block_length`` (the reference eval scripts' choice), so the quota is ``block_length`` tokens
        per call plus what earlier calls rejected; when the last step rejects, the loop is extended by one step with
        a zero base quota. Fixed schedule: Dream's timestep truncation over ``params.steps`` (entropy confidence).
        The whole response is one canvas, so each row's ``steps_per_block`` has a single entry.
        """
        params, start, end = self.params, self.response_start, self.seq_len
        threshold = params.threshold
        total = params.gen_length // params.block_length if threshold is not None else params.steps
        steps = {r: total for r in range(len(self.rows))}
        quota = {r: params.gen_length // total for r in range(len(self.rows))}
        carried = {r: 0 for r in range(len(self.rows))}
        step = {r: 0 for r in range(len(self.rows))}
        for r in self._running():
            self.rows[r].steps_per_block.append(0)
        while True:
            stepping = [r for r in self._running() if step[r] < steps[r] and self._has_mask(r, start, end)]
            if not stepping:
                break
            logits = self._forward_full(stepping, start, end, None)
            counts = []
            for j, r in enumerate(stepping):
                candidates = self._mask_columns(r, start, end)
                row_logits = logits[j, candidates - start]
                state = self.rows[r]
                if threshold is not None:
                    tokens, confidence = dream_tokens_and_confidence(row_logits, state.temperature, state.generator, False)
                    chosen, rejected = dream_threshold_reveals(confidence, quota[r] + carried[r], threshold)
                    carried[r] = rejected
                    if rejected and step[r] == steps[r] - 1:
                        quota[r], steps[r] = 0, steps[r] + 1
                else:
                    tokens, confidence = dream_tokens_and_confidence(row_logits, state.temperature, state.generator, True)
                    count = dream_fixed_count(int(candidates.numel()), step[r], steps[r])
                    chosen = select_reveals(confidence, count, None)
                self.x[r, candidates[chosen]] = tokens[chosen]
                counts.append(int(chosen.numel()))
                step[r] += 1
            self._account(stepping, counts)

    # ------------------------------------------------------------------------------------------------- forwards

    def _key_mask(self, rows: list[int]) -> torch.Tensor | None:
        """bool ``[n, T]`` (True = real token) over all columns, or None when none of ``rows`` is padded."""
        pads = self.pads[rows]
        if not bool((pads > 0).any()):
            return None
        return torch.arange(self.seq_len, device=pads.device)[None, :] >= pads[:, None]

    def _forward_full(self, rows: list[int], start: int, end: int, hook) -> torch.Tensor:
        """Full forward of ``rows``; logits of columns [start, end): ``[n, end - start, V]``."""
        return self.model(
            self.x[rows], positions=self.positions[rows], key_mask=self._key_mask(rows), kv_hook=hook,
            logits_range=(start, end),
        )

    def _forward_cached(self, rows: list[int], block_rows: list[int], segments: Segments) -> torch.Tensor:
        """Window forward with reused K/V: prefix mode computes [s, T), dual mode [s, e); logits of [s, e)."""
        start, end = segments.block_start, segments.block_end
        window_end = self.seq_len if segments.cache_mode == "prefix" else end
        selection = None
        if rows != block_rows:
            selection = torch.tensor([block_rows.index(r) for r in rows], device=self.x.device)
        reused_positions = None
        if self.store.pre_rope_keys:
            reused_positions = self.positions[rows][:, segments.reused_columns.to(self.x.device)]
        hook = ReuseRead(self.store, segments, selection, self.model.rope, reused_positions)
        return self.model(
            self.x[rows, start:window_end], positions=self.positions[rows, start:window_end],
            key_mask=self._key_mask(rows), kv_hook=hook, logits_range=(0, end - start),
        )

    # -------------------------------------------------------------------------------------------------- reveals

    def _llada_schedules(self, rows: list[int], start: int, end: int) -> dict[int, list[int]]:
        """Per row, LLaDA's fixed per-step reveal counts for this block (empty with a threshold or for Dream)."""
        if self.spec.arch != "llada" or self.params.threshold is not None:
            return {}
        steps_per_block = self.params.steps // self.num_blocks
        return {r: llada_fixed_schedule(int(self._mask_columns(r, start, end).numel()), steps_per_block) for r in rows}

    def _reveal_block(
        self, rows: list[int], logits: torch.Tensor, start: int, end: int, step: int, schedules: dict[int, list[int]]
    ) -> None:
        """Apply one call's reveals to each row of the call (logits ``[n, end - start, V]``)."""
        params, counts = self.params, []
        for j, r in enumerate(rows):
            state = self.rows[r]
            candidates = self._mask_columns(r, start, end)
            if self.spec.arch == "dream" and step == 0:
                # Dream's block-initial pass reveals the block's first column, unconditionally (SPEC 3.6 step 1).
                candidates = candidates[:1]
                tokens, _ = dream_tokens_and_confidence(logits[j, :1], state.temperature, state.generator, False)
                chosen = torch.zeros(1, dtype=torch.long, device=tokens.device)
            elif self.spec.arch == "dream":
                row_logits = logits[j, candidates - start]
                fixed = params.threshold is None  # fixed schedule: negative-entropy confidence (SPEC 3.6)
                tokens, confidence = dream_tokens_and_confidence(row_logits, state.temperature, state.generator, fixed)
                count = int(candidates.numel())
                if fixed:
                    count = dream_fixed_count(count, step, params.steps // self.num_blocks)
                chosen = select_reveals(confidence, count, params.threshold)
            else:
                row_logits = logits[j, candidates - start]
                tokens, confidence = llada_tokens_and_confidence(
                    row_logits, state.temperature, params.remasking, state.generator
                )
                count = schedules[r][step] if schedules else int(candidates.numel())
                chosen = select_reveals(confidence, min(count, int(candidates.numel())), params.threshold)
            self.x[r, candidates[chosen]] = tokens[chosen]
            counts.append(int(chosen.numel()))
        self._account(rows, counts)

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
            self.first_block_s = time.perf_counter() - self._started
        if self.on_block is not None:
            for block in range(self._emitted_blocks, committed):
                self.on_block(block, [self.response_ids(r, committed_only=True) for r in range(len(self.rows))])
        self._emitted_blocks = max(self._emitted_blocks, committed)


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
