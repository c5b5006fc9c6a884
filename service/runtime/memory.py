"""What a request costs in memory (issue #14), measured for the scheduler (`service.runtime.scheduler`).

A running request holds two kinds of memory:

* **KV bytes**: the reused K/V its store holds, at the storage bits of its configuration (the accounting of
  ``DecodeReport.kv``: codes, scales, minima, indices and outliers), counted over ``seq_len + 1`` tokens (the
  full-precision store keeps the whole sequence in order and a spare column; the reused region alone is largest
  at the last block, ``seq_len - block_length``); cache mode ``none`` holds nothing. Bytes per reused
  token are measured once per configuration by writing every layer of the configuration's own store with a probe
  of :data:`PROBE_TOKENS` tokens (a full-precision store: ``2 x layers x kv_heads x head_dim x element size``),
  on the worker thread, never on the event loop (`service.runtime.loop`).
* **Transient bytes** of the largest forward a row runs: its block-initial pass over its whole sequence
  (`service.engine.forward_cost`: activations of one layer, the K/V of one layer with GQA repeats and a second
  copy, the LM head's logits).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from service.engine.forward_cost import ForwardCost
from service.engine.kv_store import FullPrecisionKVStore, KVStore, Segments
from service.engine.params import DecodeParams
from service.engine.spec import ModelSpec
from service.runtime.scheduler import Cost

# The budget on CPU when none is set (DLLM_KV_BUDGET_BYTES).
CPU_BUDGET_BYTES = 1 << 30
# Reused tokens written by the probe that measures a configuration's bytes per token (several K groups).
PROBE_TOKENS = 256
#: Configurations whose per-token KV bytes are remembered (one probe each; the oldest dropped first).
PER_TOKEN_KEEP = 256

class MemoryModel:
    """Bytes per request and per forward for one loaded model.

    Args:
        spec: the model's spec; forward: its forward's figures (`service.engine.forward_cost.ForwardCost`, the
        MLP's as the family declares them); device: where probes run.
    """

    def __init__(self, spec: ModelSpec, forward: ForwardCost, device: torch.device | str = "cpu",
                 layout: Any = None, kinds: Any = None) -> None:
        self.spec, self.forward, self.element_size = spec, forward, forward.element_size
        #: A model config whose layers hold K/V by kind (``kv_bytes``, ``sampler_bytes``, ``canvas_length``,
        #: ``layer_types``: DiffusionGemma's sliding and global layers, `service.engine.models.diffusion_gemma`);
        #: None: every layer holds ``num_kv_heads x head_dim`` per token.
        self.layout = layout
        #: With ``layout``: the model that measures a store's bytes per token per layer kind and the positions a
        #: kind holds (``kv_bytes_per_token(kind, store)``, ``kv_positions_held(kind, store)``), so a quantized
        #: request is counted at its packed bytes; None: every store of such a model is counted at full precision.
        self.kinds = kinds
        self.device = torch.device(device)
        # Per configuration: its bytes per token, whether its store quantizes, and (a model holding K/V by layer
        # kind, quantized) per kind its bytes per token, positions held (None: all) and K group; insertion-ordered,
        # the oldest dropped past PER_TOKEN_KEEP.
        self._per_token: dict[object, tuple[float, bool, dict[str, tuple[float, int | None, int]] | None]] = {}

    @classmethod
    def dense(cls, spec: ModelSpec, width: int, mlp_hidden: int, element_size: int,
              device: torch.device | str = "cpu") -> MemoryModel:
        """For a model with a dense gated MLP of hidden size ``mlp_hidden`` (`ForwardCost.dense`)."""
        return cls(spec, ForwardCost.dense(width, mlp_hidden, spec.num_heads, spec.head_dim, spec.vocab_size,
                                           element_size), device)

    @classmethod
    def for_engine(cls, engine) -> MemoryModel:
        """From a loaded `service.engine.Engine` (its model's declared cost figures, dtype and device); an engine
        without a torch model (the tests' fake) is costed as a float32 model of width heads x head_dim and a
        dense 3x MLP."""
        model = getattr(engine, "model", None)
        if model is None:
            width = engine.spec.num_heads * engine.spec.head_dim
            return cls.dense(engine.spec, width, 3 * width, 4)
        layout = model.config if callable(getattr(model.config, "kv_bytes", None)) else None
        kinds = model if layout is not None and callable(getattr(model, "kv_positions_held", None)) else None
        return cls(engine.spec, ForwardCost.of(model), model.embed.weight.device, layout, kinds)

    @property
    def full_precision_bytes_per_token(self) -> int:
        """Bytes one reused token of a full-precision store takes, every layer, K and V: ``2 x layers x kv_heads x
        head_dim x element size`` (its run in the K/V pool too, `service.engine.kv_pool`)."""
        s = self.spec
        return 2 * s.num_layers * s.num_kv_heads * s.head_dim * self.element_size

    def knows(self, key: object) -> bool:
        """Whether the bytes per token of configuration ``key`` are measured (asking costs no torch work)."""
        return key in self._per_token

    def kv_bytes_per_token(self, key: object, make_store: Callable[[], KVStore]) -> float:
        """Bytes held per reused token (all layers, K and V) by the stores ``make_store`` builds; measured once
        per ``key`` (the configuration). A model holding K/V by layer kind (``kinds``) measures a quantized store
        per kind at each layer's own geometry (`service.quant.canvas.bytes_per_token`), kept for :meth:`cost`;
        the figure returned is then the sum over kinds.

        Raises:
            KVQuantError: a configuration the model's family cannot run (the probe builds its packed cache).
        """
        if key not in self._per_token:
            store = make_store()
            if type(store) is FullPrecisionKVStore:
                self._per_token[key] = (float(self.full_precision_bytes_per_token), False, None)
            elif self.kinds is not None:
                group = store.quantizer.k_group_size
                by_kind = {kind: (self.kinds.kv_bytes_per_token(kind, store), self.kinds.kv_positions_held(kind, store),
                                  group) for kind in dict.fromkeys(self.layout.layer_types)}
                self._per_token[key] = (sum(b for b, _, _ in by_kind.values()), True, by_kind)
            else:
                self._per_token[key] = (self._probe(store) / PROBE_TOKENS, True, None)
            # One entry per distinct configuration a client names: bounded (issue 22), a dropped one is measured again.
            while len(self._per_token) > PER_TOKEN_KEEP:
                del self._per_token[next(iter(self._per_token))]
        return self._per_token[key][0]

    def quantized(self, key: object) -> bool:
        """Whether configuration ``key``'s store quantizes (is not full precision); measured by
        :meth:`kv_bytes_per_token` first (KeyError before)."""
        return self._per_token[key][1]

    def _probe(self, store: KVStore) -> int:
        """Bytes ``store`` holds after a block-initial pass that reuses :data:`PROBE_TOKENS` prefix tokens."""
        s, block = self.spec, 1
        total = PROBE_TOKENS + block
        segments = Segments(pad_lengths=(0,), block_start=PROBE_TOKENS, block_end=total, seq_len=total,
                            cache_mode="prefix")
        gen = torch.Generator(device=self.device).manual_seed(0)
        dtype = torch.float32 if self.element_size == 4 else torch.bfloat16
        scores = torch.full((1, total), 1.0 / total, device=self.device)
        with torch.inference_mode():
            for layer in range(s.num_layers):
                k, v = (torch.randn(1, s.num_kv_heads, total, s.head_dim, generator=gen, device=self.device)
                        .to(dtype) for _ in range(2))
                store.write(layer, k, v, segments, scores if store.needs_scores else None)
        held = int(store.bytes_held)
        store.clear()
        return held

    def cost(self, prompt_len: int, params: DecodeParams, bytes_per_token: float, key: object = None) -> Cost:
        """The request's KV bytes at its longest, and the transient bytes of its largest forward.

        ``key``: the request's configuration (measured by :meth:`kv_bytes_per_token`); on a model holding K/V by
        layer kind a quantized one is counted by :meth:`quantized_kv_bytes`, anything else at full precision."""
        if self.layout is not None:  # K/V by layer kind; the response in whole canvases; the sampler beside
            canvas = self.layout.canvas_length
            canvases = -(-params.gen_length // canvas)
            tokens = prompt_len + canvases * canvas
            by_kind = self._per_token[key][2] if key in self._per_token else None
            kv = (self.layout.kv_bytes(tokens, self.element_size) if by_kind is None
                  else self.quantized_kv_bytes(by_kind, prompt_len, canvases))
            return Cost(kv, self.transient(tokens, canvas) + self.layout.sampler_bytes())
        seq_len = prompt_len + params.gen_length
        # The full-precision store keeps the whole sequence in order plus a spare column (the window's columns are
        # written over at each later step, `FullPrecisionKVStore`); counted so for every store: a quantized one
        # is then over-counted by a block of its few bits per token.
        reused = 0 if params.cache_mode == "none" else seq_len + 1
        # The whole-response schedule (cache mode none) takes logits over the whole response at every call.
        cols = params.gen_length if params.cache_mode == "none" else params.block_length
        return Cost(int(bytes_per_token * reused), self.transient(seq_len, cols))

    def quantized_kv_bytes(self, by_kind: dict[str, tuple[float, int | None, int]], prompt_len: int,
                           canvases: int) -> int:
        """Bytes one row of a model holding K/V by layer kind holds packed after its prompt and ``canvases``
        canvases of ``layout.canvas_length`` tokens: per kind, its measured bytes per token (whole K groups)
        times its tokens, each run (the prompt, each canvas: what one encoder pass writes, `service.quant.canvas`)
        rounded up to whole K groups (a partial group keeps a whole group's statistics); a kind holding at most
        ``held`` positions (sliding layers: ``W - 1`` and the rest of the oldest K group) counts at most
        ``held`` rounded up to groups and one group more (the newest run's partial piece). Bytes, an upper bound
        of what `service.quant.canvas.PackedCanvas` holds (tested: tests/api/test_diffusion_gemma_quant_served.py)."""
        total = 0.0
        for per_token, held, group in by_kind.values():
            whole = lambda n, g=group: -(-n // g) * g
            tokens = whole(prompt_len) + canvases * whole(self.layout.canvas_length)
            if held is not None:
                tokens = min(tokens, whole(held) + group)
            total += per_token * tokens
        return int(-(-total // 1))

    def measure_forward(self, engine, tokens: int, block: int = 32) -> int:
        """Activation bytes of one forward at the token budget (``max_batched_tokens``), measured once at
        start-up: on CUDA the peak allocated during a block-initial-shaped forward of ``tokens`` input tokens
        (rows of up to 1,024 columns, logits at ``block`` columns per row) over what was allocated before; on
        other devices (no allocator statistics) the cost model's bytes of that forward
        (`service.engine.forward_cost.ForwardCost.bytes`). An engine without a torch model (the tests' fake): the
        cost model."""
        width = max(1, min(tokens, self.spec.max_length, 1024))
        rows = max(1, -(-tokens // width))
        cols = min(block, width)
        estimate = self.forward.bytes(rows, width, width, cols)
        model = getattr(engine, "model", None)
        # A two-pass model (DiffusionGemma: encode, decode; no one-pass forward to run here) is costed by the model.
        if model is None or self.device.type != "cuda" or self.layout is not None:
            return estimate
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        with torch.inference_mode():
            ids = torch.full((rows, width), self.spec.pad_id, dtype=torch.long, device=self.device)
            positions = torch.arange(width, device=self.device).expand(rows, width)
            model(ids, positions=positions, logits_at=positions[:, :cols], max_position=width)
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.max_memory_allocated(self.device) - before)

    def hidden_bytes(self, seq_len: int) -> int:
        """Bytes of one row's hidden states over ``seq_len`` columns (``C`` activations per column): what a
        block-initial pass split by layers holds between its pieces (`service.runtime.scheduler.split_by_layers`)."""
        return seq_len * self.forward.width * self.element_size

    def qkv_bytes(self, seq_len: int) -> int:
        """Bytes of one row's q, k and v of one layer over ``seq_len`` columns (GQA counted as full heads): what a
        likelihood forward split inside a layer holds between its pieces
        (`service.engine.likelihood.PromptLikelihood.step`)."""
        return 3 * seq_len * self.forward.num_heads * self.forward.head_dim * self.element_size

    def transient(self, seq_len: int, logits_cols: int) -> int:
        """Bytes of one row's full forward over ``seq_len`` columns with logits at ``logits_cols`` columns
        (`service.engine.forward_cost.ForwardCost.bytes`)."""
        return self.forward.bytes(1, seq_len, seq_len, logits_cols)


def default_budget(device: torch.device | str, fraction: float, cpu_bytes: int) -> int:
    """The budget when none is set: ``fraction`` of the device's free memory on CUDA (measured now, after the
    weights are loaded), else ``cpu_bytes``."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * fraction)
    return cpu_bytes
