"""The prefix cache's bookkeeping (service/engine/prefix_cache.py), no model: keys, longest-prefix lookup,
references, LRU eviction leaves first, byte accounting."""

from __future__ import annotations

import pytest

from service.engine.prefix_cache import Namespace, PrefixCache, block_key, chain_keys

NS = Namespace(model="fp", dtype="torch.float32", block_length=4, kv_config="none", label="none")


def blocks_of(ids: list[int], size: int = 4, nbytes: int = 10) -> list[tuple[list[int], tuple, int]]:
    """``ids`` cut into whole blocks, each with a one-layer payload naming its ids and ``nbytes`` bytes."""
    return [(ids[i:i + size], (tuple(ids[i:i + size]),), nbytes) for i in range(0, len(ids) // size * size, size)]


def store(cache: PrefixCache, ids: list[int], ns: Namespace = NS, nbytes: int = 10) -> int:
    hit = cache.lookup(ns, ids)
    stored = cache.insert(hit, blocks_of(ids, ns.block_length, nbytes)[len(hit.blocks):])
    cache.release(hit)
    return stored


def test_key_is_the_chain_of_blocks_under_the_namespace() -> None:
    a = chain_keys(NS, [1, 2, 3, 4, 5, 6, 7, 8], 2)
    b = chain_keys(NS, [9, 9, 9, 9, 5, 6, 7, 8], 2)
    assert a[1] != b[1], "the same block after another parent must have another key"
    assert a[0] == block_key(NS.root, [1, 2, 3, 4]) and a[1] == block_key(a[0], [5, 6, 7, 8])
    assert block_key(NS.root, [1, 23]) != block_key(NS.root, [12, 3])
    for other in (Namespace("fp2", NS.dtype, 4, "none"), Namespace("fp", "torch.bfloat16", 4, "none"),
                  Namespace("fp", NS.dtype, 4, '{"method":"kivi","bits":4}|none')):
        assert chain_keys(other, [1, 2, 3, 4], 1) != chain_keys(NS, [1, 2, 3, 4], 1)
    # The label names the series only: it does not change the key.
    assert chain_keys(Namespace("fp", NS.dtype, 4, "none", label="x"), [1, 2, 3, 4], 1) == chain_keys(
        NS, [1, 2, 3, 4], 1)
    with pytest.raises(ValueError, match="need 8 ids"):
        chain_keys(NS, [1, 2, 3], 2)


def test_lookup_finds_the_longest_cached_prefix_and_counts_tokens() -> None:
    cache = PrefixCache(1000)
    assert store(cache, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13]) == 3  # the tail (13) is no whole block
    hit = cache.lookup(NS, [1, 2, 3, 4, 5, 6, 7, 8, 0, 0, 0, 0, 7])
    assert hit.tokens == 8 and [b.payload for b in hit.blocks] == [((1, 2, 3, 4),), ((5, 6, 7, 8),)]
    miss = cache.lookup(NS, [0, 2, 3, 4, 5, 6, 7, 8])
    assert miss.blocks == [] and miss.last_key == NS.root
    capped = cache.lookup(NS, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], max_blocks=1)
    assert capped.tokens == 4
    other = cache.lookup(Namespace("fp", NS.dtype, 4, "kivi", label="kivi"), [1, 2, 3, 4])
    assert other.tokens == 0, "another KV configuration must not see these blocks"
    stats = cache.stats()
    assert stats["none"].queried_tokens == 13 + 13 + 8 + 12 and stats["kivi"].queried_tokens == 4
    assert stats["none"].hit_tokens == 0 + 8 + 0 + 4
    for h in (hit, miss, capped, other):
        cache.release(h)


def test_a_referenced_block_is_never_evicted_and_release_is_once() -> None:
    cache = PrefixCache(20)  # room for two blocks of 10 bytes
    store(cache, [1, 1, 1, 1, 2, 2, 2, 2])
    hit = cache.lookup(NS, [1, 1, 1, 1, 2, 2, 2, 2])
    keys = [b.key for b in hit.blocks]
    assert [cache.refs(k) for k in keys] == [1, 1]
    assert store(cache, [3, 3, 3, 3]) == 0, "no room: both blocks are in use"
    assert cache.evict(100) == 0 and all(k in cache for k in keys)
    cache.release(hit)
    cache.release(hit)
    assert [cache.refs(k) for k in keys] == [0, 0]
    assert store(cache, [3, 3, 3, 3]) == 1
    assert keys[0] in cache and keys[1] not in cache, "the leaf goes first, its parent stays"


def test_eviction_is_lru_among_leaves() -> None:
    cache = PrefixCache(40)
    store(cache, [1, 1, 1, 1, 2, 2, 2, 2])  # a chain: 1 -> 2
    store(cache, [5, 5, 5, 5])
    store(cache, [6, 6, 6, 6])
    a1, a2 = chain_keys(NS, [1, 1, 1, 1, 2, 2, 2, 2], 2)
    (b,) = chain_keys(NS, [5, 5, 5, 5], 1)
    (c,) = chain_keys(NS, [6, 6, 6, 6], 1)
    cache.release(cache.lookup(NS, [5, 5, 5, 5]))  # [5] is now the most recently used
    # The oldest block is a1, but it has a child: the least recently used leaf is a2, then a1 (a leaf now), then c.
    assert cache.evict(10) == 10 and a2 not in cache and a1 in cache
    assert cache.evict(10) == 10 and a1 not in cache
    assert cache.evict(10) == 10 and c not in cache and b in cache
    assert cache.stats()["none"].evicted_bytes == 30


def test_bytes_held_inserted_and_evicted_are_counted() -> None:
    cache = PrefixCache(25)
    ns_q = Namespace("fp", NS.dtype, 4, "kivi-2", label="kivi-2")
    store(cache, [1, 1, 1, 1, 2, 2, 2, 2], nbytes=10)
    assert cache.held_bytes == 20 and cache.stats()["none"].held_bytes == 20 and len(cache) == 2
    store(cache, [7, 7, 7, 7], ns_q, nbytes=5)
    assert cache.held_bytes == 25
    assert store(cache, [7, 7, 7, 7, 8, 8, 8, 8], ns_q, nbytes=5) == 1  # evicts the LRU leaf [2,2,2,2]
    stats = cache.stats()
    assert stats["none"].held_bytes == 10 and stats["none"].evicted_bytes == 10 and stats["none"].blocks == 1
    assert stats["kivi-2"].held_bytes == 10 and stats["kivi-2"].inserted_bytes == 10
    assert cache.held_bytes == 20 == sum(s.held_bytes for s in stats.values())
    assert cache.evictable_bytes == 20
    assert store(cache, [9, 9, 9, 9], nbytes=26) == 0, "a block over the capacity is never stored"
    assert cache.held_bytes == 20, "and nothing is evicted for it"


def test_a_chain_is_stored_without_gaps_and_inserting_keeps_its_own_parent() -> None:
    cache = PrefixCache(20)
    store(cache, [1, 1, 1, 1, 2, 2, 2, 2])
    # Three new blocks, room for two: the first two evict the old chain, the third finds only its own chain left.
    assert store(cache, [3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5]) == 2
    assert cache.lookup(NS, [3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5]).tokens == 8
    assert PrefixCache(0).lookup(NS, [1, 1, 1, 1]).tokens == 0
    with pytest.raises(ValueError, match="must be >= 0"):
        PrefixCache(-1)
    hit = cache.lookup(NS, [3, 3, 3])
    with pytest.raises(ValueError, match="holds 4 ids"):
        cache.insert(hit, [([3, 3], (), 1)])
    cache.release(hit)
    with pytest.raises(ValueError, match="after release"):
        cache.insert(hit, [])


def test_what_is_joined_of_a_chain_is_made_once_while_a_request_holds_it() -> None:
    """`PrefixCache.joined`: the same object for every hit of one chain and part while it is held, made again
    once nobody holds it; a None from ``make`` is not kept; another chain or part makes its own."""
    import gc

    class Run:  # stands for a joined packed layer (weakly referenceable)
        pass

    cache = PrefixCache(1000)
    store(cache, [1, 2, 3, 4, 5, 6, 7, 8])
    made: list[Run] = []

    def make() -> Run:
        made.append(Run())
        return made[-1]

    a, b = (cache.lookup(NS, [1, 2, 3, 4, 5, 6, 7, 8]) for _ in range(2))
    held = cache.joined(a, 0, make)
    assert cache.joined(b, 0, make) is held and len(made) == 1
    assert cache.joined(b, 1, make) is not held and len(made) == 2
    shorter = cache.lookup(NS, [1, 2, 3, 4, 9])
    assert cache.joined(shorter, 0, make) is not held and len(made) == 3
    assert cache.joined(a, 5, lambda: None) is None and cache.joined(a, 5, make) is made[-1]
    del held
    made.clear()
    gc.collect()
    cache.joined(a, 0, make)
    assert len(made) == 1, "made again once nobody held it"
