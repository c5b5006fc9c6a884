"""A prefix cache across requests for the block-causal families: the committed K/V of a prompt's whole blocks,
keyed by content, shared by every request that starts with the same tokens (issue 44).

Why it is exact: a block-causal family (LLaDA2.x; DiffusionGemma next) attends causally across blocks, so the K/V
of a prompt's whole block depend only on the tokens of that block and of the blocks before it, as in an
autoregressive model. Two requests whose prompts share their first ``n`` whole blocks compute the same K/V there;
the second one reads them from here and runs its committed (prompt) pass over the rest only. The bidirectional
families (LLaDA, Dream) cannot use it: their prompt K/V depend on what follows.

Keys (:func:`block_key`): a block's key is the SHA-256 of its parent's key (the block before it; for the first
block, the :class:`Namespace`) and its token ids, so a key names the whole chain of tokens up to the block's end,
under one namespace: the model (weights fingerprint), its dtype, the block length and the KV configuration the
blocks were stored under (unquantized, or a quantizer's configuration and artifact). Activating another KV
configuration (a hot swap) therefore gives new keys: a block quantized under the old configuration is never served
to a request admitted under the new one, and the old blocks age out by LRU.

What a block holds (:class:`CachedBlock`, its ``payload``): per layer, whatever the family's committed store holds
for that block, opaque here: LLaDA2 keeps ``(k, v)`` tensors ``[H_kv, block, D]`` for an unquantized row and the
quantizer's packed layer (`service.quant.base.PackedLayer`: KIVI or KVQuant codes, as
`service.quant.committed.CommittedBlocks` holds them) for a quantized one, so a cached quantized block is the very
codes the request would have made itself. ``nbytes`` is what the family measured of that payload.

Sharing and eviction: :meth:`PrefixCache.lookup` takes a reference on every block of the hit (the rows of the
running batch read them, never write them); :meth:`PrefixCache.release` gives it back when the request leaves. A
referenced block is never evicted. Eviction is least recently used among unreferenced blocks, leaves first (a
block with a cached child stays while the child does: a chain is never cut in its middle), whenever an insertion
would go over ``capacity_bytes`` and when the runtime asks for room (:meth:`PrefixCache.evict`: the cache gives way
before a request waits for memory). A block that does not fit even after every evictable block went is not stored.

Counts (:class:`PrefixCacheStats`, per label, the KV configuration's): queried and hit tokens (vLLM's
``prefix_cache_queries`` / ``prefix_cache_hits``: a query counts the prompt's tokens, a hit the cached tokens
served), bytes held, bytes inserted and evicted. The cache is used from the runtime's worker thread; a lock keeps
the telemetry's reads (another thread) consistent.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

#: The labels of the ``dllm_prefix_cache_*`` series (`service.telemetry.PrefixCacheCollector`): the configuration
#: fields that change the blocks held (their codes, or which side is held as it is) or how they are read, so two
#: configurations the namespace keeps apart (KIVI 2-bit at K groups 16 and 32, say) count into two series. Not
#: ``keep_dequantized`` (the blocks are the same codes either way).
LABELS = ("method", "bits", "cache_mode", "policy", "k_group_size", "v_group_size", "sides", "key_bias_correction")


def prefix_label(config: Any | None) -> tuple[str, ...]:
    """The :data:`LABELS` values of a block-cache-mode row's KV configuration (a `service.quant.config.KVQuantConfig`;
    None or method ``none``: the unquantized cache, every field after ``cache_mode`` empty), as
    ``dllm_active_config_info`` writes them (``v_group_size`` empty when the config leaves it to the head dim;
    ``key_bias_correction`` ``on`` or ``off``)."""
    if config is None or config.method == "none":
        return ("none", "", "block", "", "", "", "", "")
    v_group = "" if config.v_group_size is None else str(config.v_group_size)
    return (config.method, str(config.bits), "block", config.artifact_id or "", str(config.k_group_size), v_group,
            config.sides, "on" if config.key_bias_correction else "off")


@dataclass(frozen=True)
class Namespace:
    """What a cached block's K/V depend on besides its tokens.

    Attributes:
        model: the weights' fingerprint (`service.engine.spec.ModelSpec.fingerprint`).
        dtype: the K/V dtype (``torch.float32`` ...), as text.
        block_length: tokens per block (a block's key covers exactly this many ids).
        kv_config: the KV configuration the blocks are held under, as text (``none``: unquantized; else the
            configuration's JSON and its artifact id): part of the key, so a swap never serves the old one's codes.
        label: how telemetry names the configuration (LLaDA2: :func:`prefix_label`, the values of
            :data:`LABELS`); not part of the key.
    """

    model: str
    dtype: str
    block_length: int
    kv_config: str
    label: tuple[str, ...] | str = "none"

    def __post_init__(self) -> None:
        if self.block_length < 1:
            raise ValueError(f"block_length {self.block_length} must be >= 1")

    @property
    def root(self) -> bytes:
        """The digest every chain of this namespace starts from (the parent key of a prompt's first block)."""
        text = "\x1f".join((self.model, self.dtype, str(self.block_length), self.kv_config))
        return hashlib.sha256(text.encode()).digest()


def block_key(parent: bytes, ids: Sequence[int]) -> bytes:
    """The key of a block: SHA-256 over its parent's key (32 bytes; a namespace's :attr:`Namespace.root` for the
    first block) and its ids (each as 8 little-endian bytes, so ``[1, 23]`` and ``[12, 3]`` differ)."""
    digest = hashlib.sha256(parent)
    digest.update(b"".join(int(t).to_bytes(8, "little", signed=True) for t in ids))
    return digest.digest()


def chain_keys(namespace: Namespace, ids: Sequence[int], blocks: int) -> list[bytes]:
    """The keys of the first ``blocks`` whole blocks of ``ids`` under ``namespace`` (each chained to the last)."""
    size = namespace.block_length
    if blocks * size > len(ids):
        raise ValueError(f"{blocks} blocks of {size} need {blocks * size} ids, got {len(ids)}")
    keys, parent = [], namespace.root
    for b in range(blocks):
        parent = block_key(parent, ids[b * size:(b + 1) * size])
        keys.append(parent)
    return keys


@dataclass(eq=False)
class CachedBlock:
    """One cached block. ``payload``: per layer, what the family's store holds for it (read-only once stored);
    ``nbytes``: its bytes; ``refs``: requests reading it now; ``children``: cached blocks whose parent it is."""

    key: bytes
    parent: bytes
    label: tuple[str, ...] | str
    payload: tuple[Any, ...]
    nbytes: int
    refs: int = 0
    children: int = 0
    last_used: int = 0


@dataclass
class PrefixCacheStats:
    """Counts of one KV configuration's label (telemetry reads :meth:`PrefixCache.stats`).

    Attributes:
        queried_tokens: prompt tokens of the lookups. hit_tokens: tokens served from the cache.
        held_bytes: bytes of the blocks held now. inserted_bytes, evicted_bytes: bytes ever stored, dropped.
        blocks: blocks held now.
    """

    queried_tokens: int = 0
    hit_tokens: int = 0
    held_bytes: int = 0
    inserted_bytes: int = 0
    evicted_bytes: int = 0
    blocks: int = 0


@dataclass
class PrefixHit:
    """A lookup's answer: the cached blocks of the prompt's longest cached prefix, in order (referenced until
    :meth:`PrefixCache.release`), and the namespace they were looked up under."""

    namespace: Namespace
    blocks: list[CachedBlock] = field(default_factory=list)
    released: bool = False

    @property
    def tokens(self) -> int:
        """Prompt tokens the hit covers (whole blocks)."""
        return len(self.blocks) * self.namespace.block_length

    @property
    def last_key(self) -> bytes:
        """The key the next block of the prompt chains to (the namespace's root on a miss)."""
        return self.blocks[-1].key if self.blocks else self.namespace.root


class PrefixCache:
    """Content-keyed committed K/V of prompts' whole blocks, bounded by ``capacity_bytes`` (module doc).

    Args:
        capacity_bytes: bytes the cache may hold at most (>= 0; 0 holds nothing, every lookup misses).

    Raises:
        ValueError: a negative capacity.
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes {capacity_bytes} must be >= 0")
        self.capacity_bytes = capacity_bytes
        self._blocks: dict[bytes, CachedBlock] = {}
        self._stats: dict[tuple[str, ...] | str, PrefixCacheStats] = {}
        self._clock = itertools.count(1)
        self._lock = threading.Lock()
        self.held_bytes = 0
        # What :meth:`joined` made per (chain, part), held only while some request holds it.
        self._joined: weakref.WeakValueDictionary[tuple[bytes, int], Any] = weakref.WeakValueDictionary()

    # ---- what a request does ---------------------------------------------------------------------------------
    def lookup(self, namespace: Namespace, ids: Sequence[int], max_blocks: int | None = None) -> PrefixHit:
        """The longest run of cached whole blocks at the start of ``ids`` (at most ``max_blocks``), each
        referenced (a hit is never evicted until :meth:`release`) and made most recently used. Counts
        ``len(ids)`` queried tokens and the hit's tokens."""
        size = namespace.block_length
        most = len(ids) // size if max_blocks is None else min(max_blocks, len(ids) // size)
        hit = PrefixHit(namespace)
        with self._lock:
            parent = namespace.root
            for b in range(most):
                block = self._blocks.get(block_key(parent, ids[b * size:(b + 1) * size]))
                if block is None:
                    break
                block.refs += 1
                block.last_used = next(self._clock)
                hit.blocks.append(block)
                parent = block.key
            stats = self._stats_of(namespace.label)
            stats.queried_tokens += len(ids)
            stats.hit_tokens += hit.tokens
        return hit

    def release(self, hit: PrefixHit) -> None:
        """Give back the references :meth:`lookup` took (once; a second call does nothing)."""
        if hit.released:
            return
        with self._lock:
            for block in hit.blocks:
                block.refs -= 1
            hit.released = True

    def insert(self, hit: PrefixHit, blocks: Sequence[tuple[Sequence[int], tuple[Any, ...], int]]) -> int:
        """Store the blocks that follow ``hit`` (a request's own whole prompt blocks after its committed pass):
        per block its ids (``block_length`` of them), per-layer payload and bytes, in order. A block already
        cached is only made most recently used; one that does not fit after evicting what may go is not stored,
        nor are the blocks after it (a chain is never stored with a gap). Returns the blocks stored.

        Raises:
            ValueError: a block whose ids are not ``block_length`` long; ``hit`` already released (its chain may
                be gone).
        """
        if hit.released:
            raise ValueError("insert after release: the hit's chain may have been evicted")
        size, label = hit.namespace.block_length, hit.namespace.label
        stored = 0
        # Each block stored or touched here is referenced until the end, so that making room for its child never
        # evicts it (the hit's own blocks are referenced by the hit).
        pinned: list[CachedBlock] = []
        with self._lock:
            parent = hit.last_key
            try:
                for ids, payload, nbytes in blocks:
                    if len(ids) != size:
                        raise ValueError(f"a block holds {size} ids, got {len(ids)}")
                    key = block_key(parent, ids)
                    block = self._blocks.get(key)
                    if block is None:
                        if not self._make_room(nbytes):
                            break
                        block = CachedBlock(key, parent, label, tuple(payload), nbytes)
                        self._blocks[key] = block
                        if parent in self._blocks:
                            self._blocks[parent].children += 1
                        self.held_bytes += nbytes
                        stats = self._stats_of(label)
                        stats.held_bytes += nbytes
                        stats.inserted_bytes += nbytes
                        stats.blocks += 1
                        stored += 1
                    block.last_used = next(self._clock)
                    block.refs += 1
                    pinned.append(block)
                    parent = key
            finally:
                for block in pinned:
                    block.refs -= 1
        return stored

    def joined(self, hit: PrefixHit, part: int, make: Callable[[], Any]) -> Any:
        """What ``make()`` makes of part ``part`` (a family's index: LLaDA2's layer) of the hit's blocks, made once
        for every request that reads the same chain while one of them holds it (a weak reference, keyed by the
        hit's last block, whose key names the whole chain and its namespace): LLaDA2 joins a quantized row's
        cached blocks into one packed run per layer (`service.quant.committed.CommittedBlocks`), and the rows of
        a forward that read the same run dequantize it once. None from ``make`` is returned and not kept; a
        value must accept weak references (not a tuple). Its bytes are the requests' own: the cache's
        ``held_bytes`` counts the blocks only."""
        key = (hit.last_key, part)
        with self._lock:
            held = self._joined.get(key)
        if held is None:
            held = make()
            if held is not None:
                with self._lock:
                    self._joined[key] = held
        return held

    # ---- what the runtime does -------------------------------------------------------------------------------
    def evict(self, nbytes: int) -> int:
        """Free at least ``nbytes`` (bytes) if the unreferenced blocks allow it, least recently used leaves first;
        returns the bytes freed (less than asked when every other block is referenced)."""
        with self._lock:
            return self._evict(nbytes)

    @property
    def evictable_bytes(self) -> int:
        """Bytes held by unreferenced blocks: what :meth:`evict` can free (a referenced block's ancestors are
        referenced by the same request, so every unreferenced block is reachable leaves first)."""
        with self._lock:
            return sum(b.nbytes for b in self._blocks.values() if b.refs == 0)

    def stats(self) -> dict[tuple[str, ...] | str, PrefixCacheStats]:
        """A copy of the counts per KV configuration label."""
        with self._lock:
            return {label: PrefixCacheStats(**vars(s)) for label, s in self._stats.items()}

    def blocks(self) -> list[CachedBlock]:
        """The blocks held now (a list; the blocks themselves, not copies)."""
        with self._lock:
            return list(self._blocks.values())

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: bytes) -> bool:
        return key in self._blocks

    def refs(self, key: bytes) -> int:
        """References on the block ``key`` (0 when not cached)."""
        block = self._blocks.get(key)
        return block.refs if block is not None else 0

    # ---- inside the lock -------------------------------------------------------------------------------------
    def _stats_of(self, label: tuple[str, ...] | str) -> PrefixCacheStats:
        return self._stats.setdefault(label, PrefixCacheStats())

    def _make_room(self, nbytes: int) -> bool:
        """Evict until ``nbytes`` more fit under the capacity; False when they cannot."""
        over = self.held_bytes + nbytes - self.capacity_bytes
        if nbytes > self.capacity_bytes:
            return False
        if over > 0:
            self._evict(over)
        return self.held_bytes + nbytes <= self.capacity_bytes

    def _evict(self, nbytes: int) -> int:
        # A scan per evicted block: the cache holds thousands of blocks at most (a block is tens of tokens), and an
        # eviction happens at an insertion or an admission, not per forward.
        freed = 0
        while freed < nbytes:
            leaves = [b for b in self._blocks.values() if b.refs == 0 and b.children == 0]
            if not leaves:
                break
            block = min(leaves, key=lambda b: b.last_used)
            del self._blocks[block.key]
            parent = self._blocks.get(block.parent)
            if parent is not None:
                parent.children -= 1
            self.held_bytes -= block.nbytes
            stats = self._stats_of(block.label)
            stats.held_bytes -= block.nbytes
            stats.evicted_bytes += block.nbytes
            stats.blocks -= 1
            freed += block.nbytes
        return freed
