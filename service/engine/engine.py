"""`Engine`: a loaded model with its tokenizer and spec, and the block-diffusion `generate` entry point."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from service.engine.batch import alone
from service.engine.errors import EngineInputError
from service.engine.families import check_family_settings, decoder_for, families_serving
from service.engine.graphs import LaterSteps
from service.engine.kv_store import KVStore
from service.engine.likelihood import PromptLikelihood
from service.engine.loading import load_checkpoint
from service.engine.models import family_cache_modes, reveal_rule
from service.engine.params import DecodeParams, RowOptions
from service.engine.prefix_cache import PrefixCache
from service.engine.prompts import encode_prompt
from service.engine.protocol import (
    CacheCost,
    Cancelled,
    Capabilities,
    Cohort,
    DecodeBatch,
    FamilyDecoder,
    OnBlock,
    Plan,
)
from service.engine.report import DecodeReport
from service.engine.spec import ModelSpec


class Engine:
    """A model of any registered family (`service.engine.families`) ready to decode.

    Attributes:
        spec: the model's :class:`~service.engine.spec.ModelSpec`.
        tokenizer: a transformers tokenizer, or None for a checkpoint without tokenizer files (token ids only).
        model: the torch module (:class:`~service.engine.models.DiffusionLM`), eval mode.
        decoder: its family's decoder (`service.engine.protocol.FamilyDecoder`, `service.engine.families`): the
            batch, cohorts, reports, settings rules and capabilities every method here asks.
        dtype, device: what the weights were loaded as.
    """

    def __init__(self, model, spec, tokenizer, dtype: torch.dtype, device: torch.device) -> None:
        self.model, self.spec, self.tokenizer, self.dtype, self.device = model, spec, tokenizer, dtype, device
        self.decoder: FamilyDecoder = decoder_for(model, spec)
        self._prefix_cache: PrefixCache | None = None
        if torch.device(device).type == "cuda":
            # CUDA graphs of the later steps by default on CUDA (`service.engine.graphs`); :meth:`use_graphs`
            # changes it. A family whose batches run no graphed step keeps the runner unused.
            self.decoder.later_steps = LaterSteps(capture=True)

    @property
    def later_steps(self) -> LaterSteps | None:
        """The later steps' forward runner of the batches made from now on (None: plain eager forwards)."""
        return self.decoder.later_steps

    def use_graphs(self, runner: LaterSteps | None) -> None:
        """Run the later steps of the batches made from now on with ``runner`` (None: plain eager forwards, the
        server's ``DLLM_CUDA_GRAPHS=false``)."""
        self.decoder.later_steps = runner

    @classmethod
    def load(
        cls,
        model: str | Path | None = None,
        dtype: str | torch.dtype = "float32",
        device: str | torch.device = "cpu",
        threads: int | None = None,
    ) -> Engine:
        """Load a checkpoint (local dir, HF repo id from the offline cache, or None for the embedded default).

        Args:
            threads: if set, ``torch.set_num_threads(threads)`` (process-wide; one thread is often fastest on a
                shared small machine).

        Raises:
            EngineInputError: bad dtype/device/threads or no loadable checkpoint (see `service.engine.loading`).
        """
        if threads is not None:
            if threads < 1:
                raise EngineInputError(f"threads must be >= 1, got {threads}")
            torch.set_num_threads(threads)
        loaded = load_checkpoint(model, dtype, device)
        weight = loaded.model.embed.weight
        return cls(loaded.model, loaded.spec, loaded.tokenizer, weight.dtype, weight.device)

    def encode_prompt(self, text: str, chat: bool) -> list[int]:
        """Token ids of ``text``; with ``chat`` the chat template wraps it as one user turn and adds the assistant
        generation prompt (`service.engine.prompts.encode_prompt`).

        Raises:
            EngineInputError: no tokenizer, no chat template when ``chat`` is asked for, or a lone surrogate.
        """
        return encode_prompt(self.tokenizer, text, self.spec.model_id, chat)

    def decode_text(self, ids: list[int]) -> str | None:
        """Text of ``ids`` without special tokens, or None without a tokenizer."""
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def generate(
        self,
        prompts: list[list[int]],
        params: DecodeParams,
        rows: list[RowOptions] | None = None,
        kv_store: KVStore | None = None,
        on_block: OnBlock | None = None,
        cancelled: Cancelled | None = None,
    ) -> DecodeReport:
        """Decode a batch of prompts (left-padded together) with block diffusion; see `service.engine.decode`.

        Args:
            prompts: token ids per row, each non-empty, in the vocabulary, without the mask id.
            params: batch settings; rows: per-row temperature/seed/stop strings (default: greedy, no stops).
            kv_store: holds the reused K/V in cached modes (default :class:`FullPrecisionKVStore`; cleared at the
                end; not used with ``cache_mode="none"``).
            on_block: ``on_block(block_index, ids_per_row)`` after each block committed by every live row.
            cancelled: polled after each forward call; rows marked True stop (finish reason ``cancelled``).

        Returns:
            A :class:`DecodeReport` with one :class:`RowReport` per prompt, in order.

        Raises:
            EngineInputError: any input outside what is legal (see :func:`validate_request`); nothing has run.
            GrammarViolation: a row's grammar failed mid-decode (`service.engine.grammar`).
            Exception: whatever the decoding raised (a KV store's error, e.g. `service.quant.errors.KVQuantError`).
        """
        batch = self.batch()
        cohort = self.cohort(prompts, params, rows, kv_store, on_block, cancelled)
        batch.join(cohort)
        try:
            with torch.inference_mode():
                while batch.cohorts:
                    batch.step()
                    if batch.failed:  # the one cohort failed (the batch does not raise for a cohort's fault)
                        raise batch.failed[0][1]
        finally:
            cohort.store.clear()
        return self.report(cohort)

    def likelihood(self, ids: list[int], mc_num: int, mc_batch_size: int, seed: int, top_k: int = 0,
                   cancelled: Callable[[], bool] | None = None) -> PromptLikelihood:
        """The per-token ELBO values of one prompt, one forward per ``step()`` (`service.engine.likelihood`).

        Raises:
            ValueError: an empty prompt, or ``mc_num`` not a multiple of ``mc_batch_size``.
            EngineInputError: a block-causal model (its ELBO over the block-causal mask is not implemented).
        """
        self.check_likelihood()
        return PromptLikelihood(self.model, self.spec.mask_id, ids, mc_num, mc_batch_size, seed, top_k, cancelled)

    def check_likelihood(self) -> None:
        """Raise `EngineInputError` (field ``logprobs``) when this model's family has no likelihood
        (`Capabilities.likelihood`; LLaDA2, whose ELBO over the block-causal mask is not implemented). The server's
        400 and the in-process lm-eval model's refusal (`evaluation.lm`) both come from here."""
        if not self.capabilities.likelihood:
            raise EngineInputError(f"likelihood (the ELBO) is not implemented for {self.spec.arch} models "
                                   f"({self.capabilities.mask_kind.replace('_', '-')} attention): the bidirectional "
                                   "ELBO would not be the model's", "logprobs")

    @property
    def prefix_cache(self) -> PrefixCache | None:
        """The prefix cache this model's running batches share (`service.engine.prefix_cache`; the server sets it
        from ``prefix_cache_bytes``); None: none. The family's decoder gets it: a block-causal one reads and fills
        it, a bidirectional one never does (its prompt K/V depend on what follows)."""
        return self._prefix_cache

    @prefix_cache.setter
    def prefix_cache(self, cache: PrefixCache | None) -> None:
        self._prefix_cache = cache
        self.decoder.prefix_cache = cache

    @property
    def capabilities(self) -> Capabilities:
        """What the loaded family's decoder can do (`service.engine.protocol.Capabilities`)."""
        return self.decoder.capabilities

    def batch(self, plan: Plan = alone) -> DecodeBatch:
        """An empty running batch of this model's family (`service.engine.protocol.DecodeBatch`); ``plan`` groups
        each ``step()``'s passes into forwards (default: each alone; the server's worker plans each iteration
        itself with `service.runtime.scheduler.forward_plan`)."""
        return self.decoder.batch(plan)

    def cohort(
        self,
        prompts: list[list[int]],
        params: DecodeParams,
        rows: list[RowOptions] | None = None,
        kv_store: KVStore | None = None,
        on_block: OnBlock | None = None,
        cancelled: Cancelled | None = None,
        validated: bool = False,
    ) -> Cohort:
        """Validate a request and make its cohort (arguments as :meth:`generate`), ready to join a batch.

        Args:
            validated: the caller already ran :func:`validate_request` on these prompts and params against this
                model (the server checks each request once, where it is made: `service.api.planning`); not again.

        Raises:
            EngineInputError: see :func:`validate_request` (not raised when ``validated``).
        """
        rows = rows if rows is not None else [RowOptions() for _ in prompts]
        if not validated:
            validate_request(self.spec, prompts, params, rows)
        return self.decoder.cohort(prompts, params, rows, kv_store, on_block, cancelled)

    def report(self, cohort: Cohort) -> DecodeReport:
        """The :class:`DecodeReport` of a finished (or abandoned) cohort (its family's decoder makes it)."""
        return self.decoder.report(cohort, self.decode_text)

    def cache_cost(self, prompt_len: int, params: DecodeParams, store_bytes: int, quantized: bool) -> CacheCost:
        """One row's K/V memory as the loaded family counts it (`FamilyDecoder.cache_cost`)."""
        return self.decoder.cache_cost(prompt_len, params, store_bytes, quantized)


def cache_modes(spec) -> tuple[str, ...]:
    """The cache modes the model ``spec`` describes decodes with, as its family declares them
    (`service.engine.models.DiffusionLM.cache_modes`): ``none``, ``prefix`` and ``dual`` for the bidirectional
    families; LLaDA2 (docs/llada2.md) also ``block`` (where ``prefix`` and ``dual`` decode as ``block``)."""
    return tuple(family_cache_modes(spec.arch))


def legal_cache_modes(spec) -> str:
    """``this llada model takes none, prefix or dual``: what a refused cache mode is told."""
    *first, last = cache_modes(spec)
    return f"this {spec.arch} model takes {', '.join(first)} or {last}"


def check_cache_mode(spec, cache_mode: str) -> None:
    """Raise `EngineInputError` (field ``cache_mode``) unless ``cache_mode`` is one of :func:`cache_modes`. The
    API checks it before it resolves a request's KV configuration for that mode."""
    if cache_mode in cache_modes(spec):
        return
    # The families that take it, from their declarations (a family not served in this version takes none).
    others = families_serving("cache_mode", cache_mode)
    if others:
        raise EngineInputError(f"cache mode {cache_mode!r} is a cache mode of {', '.join(others)} models, not of this "
                               f"one; {legal_cache_modes(spec)}", "cache_mode")
    raise EngineInputError(f"unknown cache mode {cache_mode!r}; {legal_cache_modes(spec)}", "cache_mode")


def validate_request(spec: ModelSpec, prompts: list[list[int]], params: DecodeParams, rows: list[RowOptions]) -> None:
    """Check a decode request against the model and the schedule rules; raise before any work.

    Raises:
        EngineInputError: no prompts; rows not matching prompts; an empty prompt; a token id outside
            ``[0, vocab_size)``; the mask id inside a prompt; pad id equal to mask id; gen length not a multiple of
            block length; neither or both of threshold and steps; threshold outside [0, 1]; steps not a positive
            multiple of the number of blocks; what the model family's reveal rule refuses
            (`service.engine.reveal`, e.g. Dream's fixed schedule with < 2 steps per block in block mode); unknown
            cache mode or architecture (``block`` outside block-causal families); a setting value the family's
            decoder does not serve (its declaration, `service.engine.families.check_family_settings`, e.g.
            ``ignore_eos`` on LLaDA2); prompt + response longer than the model's context; the bounds of
            :meth:`DecodeParams.check_bounds` (block length, steps).
    """
    if not prompts:
        raise EngineInputError("prompts is empty; give at least one prompt (a list of token ids)", "prompt")
    if len(rows) != len(prompts):
        raise EngineInputError(f"rows has {len(rows)} entries for {len(prompts)} prompts; give one per prompt or None")
    if spec.pad_id == spec.mask_id:
        raise EngineInputError(f"pad id equals mask id ({spec.mask_id}); the pad id must be a non-mask token")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise EngineInputError(f"prompt {i} is empty; a prompt needs at least one token", "prompt")
        bad = [t for t in prompt if not (isinstance(t, int) and 0 <= t < spec.vocab_size)]
        if bad:
            raise EngineInputError(f"prompt {i} has token ids {bad[:5]} outside the vocabulary [0, {spec.vocab_size})",
                                   "prompt")
        if spec.mask_id in prompt:
            raise EngineInputError(
                f"prompt {i} contains the mask id {spec.mask_id}; prompts must not contain it (only the response is masked)",
                "prompt",
            )
    check_cache_mode(spec, params.cache_mode)
    if params.gen_length % params.block_length:
        raise EngineInputError(
            f"gen_length {params.gen_length} is not a multiple of block_length {params.block_length}", "gen_length"
        )
    if (params.threshold is None) == (params.steps is None):
        raise EngineInputError(
            "set exactly one of threshold (confidence-threshold decoding) and steps (fixed schedule)", "threshold"
        )
    if params.threshold is not None and not 0.0 <= params.threshold <= 1.0:
        raise EngineInputError(f"threshold {params.threshold} is outside [0, 1] (0 reveals a whole block at once)",
                               "threshold")
    num_blocks = params.gen_length // params.block_length
    if params.steps is not None and (params.steps <= 0 or params.steps % num_blocks):
        raise EngineInputError(
            f"steps {params.steps} must be a positive multiple of the number of blocks {num_blocks} "
            f"(gen_length / block_length), e.g. {num_blocks * max(1, params.block_length // 4)}", "steps"
        )
    params.check_bounds(spec.max_length)
    reveal_rule(spec.arch).check(params)
    reveal_rule(spec.arch).check_request(spec, params, rows)
    check_family_settings(spec.arch, params.decode_settings())
    longest = max(len(p) for p in prompts)
    if longest + params.gen_length > spec.max_length:
        raise EngineInputError(
            f"prompt ({longest} tokens) + response ({params.gen_length} positions) = {longest + params.gen_length} "
            f"tokens is over the model's context of {spec.max_length}",
            "prompt" if longest >= spec.max_length else "gen_length",
        )
