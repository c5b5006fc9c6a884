"""Quantizers the tests build around the real store paths."""

from __future__ import annotations

from service.quant.base import KVQuantizer


class HeldQuantizer(KVQuantizer):
    """KIVI's store path with both sides held in the model dtype (what ``sides`` does for the side it leaves
    alone): the write, the accounting and the read-back run, and nothing is lost. ``pre_rope_keys``: KVQuant's
    path (pre-RoPE keys in, RoPE after the read)."""

    def __init__(self, config, spec, pre_rope_keys: bool = False) -> None:
        super().__init__(config, spec)
        self.pre_rope_keys = pre_rope_keys

    @property
    def quantizes_k(self) -> bool:
        return False

    @property
    def quantizes_v(self) -> bool:
        return False
