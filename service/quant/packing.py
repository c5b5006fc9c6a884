"""Bit packing of low-bit codes into int32 words.

The word layout is KIVI's (``jy-yuan/KIVI``, ``quant/new_pack.py::pack_tensor`` / ``unpack_tensor``): along the
packed dimension, word ``w`` holds elements ``w * (32 / b) + i`` at bit offset ``i * b``, for b in {2, 4, 8}.

Two entry points:

* :func:`pack_along` / :func:`unpack_along` pack one dimension of a tensor, exactly as the reference does (its
  length must be a multiple of ``32 / b``); the golden tests check them bit for bit.
* :func:`pack_stream` / :func:`unpack_stream` pack a whole tensor as one flat stream of codes (a planar byte
  layout of our own, see :func:`pack_stream`), which is what the quantized KV store holds: nothing is spent on
  per-row or per-group alignment, only the last word of the stream may be partly empty (< 32 bits per packed
  tensor). :func:`decode_stream` reads such a stream straight into the codes' values (a codebook, or the codes
  as floats) through a per-byte table (:func:`byte_table`).
"""

from __future__ import annotations

import torch

from service.quant.errors import KVQuantError

#: Bit widths the packer (and every quantizer) supports.
PACK_BITS: tuple[int, ...] = (2, 4, 8)


def codes_per_word(bits: int) -> int:
    """How many b-bit codes share one int32 word (16, 8 or 4).

    Raises:
        KVQuantError: ``bits`` not in (2, 4, 8).
    """
    if bits not in PACK_BITS:
        raise KVQuantError(f"bits must be one of {PACK_BITS}, got {bits!r}")
    return 32 // bits


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    return torch.arange(codes_per_word(bits), device=device, dtype=torch.int64) * bits


def _to_int32_words(words: torch.Tensor) -> torch.Tensor:
    # The OR of the codes is built in int64 (so 2-bit code 3 at offset 30 cannot overflow); the top half of the
    # range maps onto negative int32 values, two's complement, as the reference's int32 arithmetic gives.
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_along(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack integer codes in ``[0, 2^b)`` along ``dim`` into int32 words (the reference layout).

    Args:
        codes: any integer dtype; ``codes.shape[dim]`` a multiple of ``32 / bits``.
        bits: 2, 4 or 8.
        dim: the dimension to pack.

    Returns:
        int32 tensor, the same shape except ``shape[dim] / (32 / bits)`` along ``dim``.

    Raises:
        KVQuantError: bad ``bits``, or a length that is not a multiple of ``32 / bits``.
    """
    per_word = codes_per_word(bits)
    dim = dim % codes.dim()
    length = codes.shape[dim]
    if length % per_word:
        raise KVQuantError(f"dimension {dim} has length {length}, not a multiple of 32 / bits = {per_word}")
    moved = codes.movedim(dim, -1).to(torch.int64)
    grouped = moved.reshape(*moved.shape[:-1], length // per_word, per_word)
    # Codes occupy disjoint bit ranges, so the sum of the shifted codes is their OR.
    words = (grouped << _shifts(bits, codes.device)).sum(-1)
    return _to_int32_words(words).movedim(-1, dim)


def unpack_along(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of :func:`pack_along`: int32 words -> uint8 codes, ``shape[dim] * (32 / bits)`` along ``dim``."""
    per_word = codes_per_word(bits)
    dim = dim % words.dim()
    moved = words.movedim(dim, -1).to(torch.int64)
    codes = (moved.unsqueeze(-1) >> _shifts(bits, words.device)) & (2**bits - 1)
    return codes.reshape(*moved.shape[:-1], moved.shape[-1] * per_word).to(torch.uint8).movedim(-1, dim)


def pack_stream(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack all of ``codes`` (any shape, flattened in C order) into a 1-D int32 stream.

    Stream layout (planar, ours): with ``n`` codes, ``k = 8 / b`` codes per byte and ``m = ceil(n / k)`` bytes,
    code ``i`` lives in byte ``i mod m`` at bit offset ``(i div m) * b``; the bytes are held as int32 words (the
    last word zero-padded). Unpacking then writes k contiguous planes instead of interleaving codes, which is
    what makes a per-layer read cheap. Returns ``ceil(m / 4)`` words; :func:`unpack_stream` needs ``n``.
    """
    codes_per_word(bits)  # validates bits
    per_byte = 8 // bits
    flat = codes.reshape(-1).to(torch.uint8)
    m = -(-flat.numel() // per_byte)
    words = -(-m // 4)
    planes = torch.zeros(per_byte * m, dtype=torch.uint8, device=flat.device)
    planes[: flat.numel()] = flat
    planes = planes.view(per_byte, m)
    packed = torch.zeros(4 * words, dtype=torch.uint8, device=flat.device)
    body = packed[:m]
    body.copy_(planes[0])
    for i in range(1, per_byte):
        body |= planes[i] << (i * bits)
    return packed.view(torch.int32)


def stream_words(numel: int, bits: int) -> int:
    """int32 words of a :func:`pack_stream` stream of ``numel`` codes: ``ceil(ceil(numel / (8 / b)) / 4)``."""
    m = -(-numel // (8 // bits))
    return -(-m // 4)


def pack_streams(codes: torch.Tensor, bits: int, counts: list[int]) -> torch.Tensor:
    """Several :func:`pack_stream` streams laid end to end, in one set of tensor operations (a stacked write of many
    requests' stores, `service.quant.store.QuantizedKVStore.write_batch`).

    Args:
        codes: ``[sum(counts), ...]`` codes of every stream, stream after stream (its rows, any trailing shape).
        bits: 2, 4 or 8.
        counts: rows of ``codes`` per stream.

    Returns:
        int32 ``[sum(stream_words(c x row, bits))]``: ``torch.cat([pack_stream(part) for part in
        codes.split(counts)])``, the same words (each stream whole int32 words, its tail zero), so every stream's
        words are a contiguous range of the result.
    """
    codes_per_word(bits)  # validates bits
    per_byte = 8 // bits
    row = codes[0].numel() if codes.dim() > 1 else 1
    flat = codes.reshape(-1).to(torch.uint8)
    device = flat.device
    sizes = [c * row for c in counts]
    m = [-(-n // per_byte) for n in sizes]
    nbytes = [4 * stream_words(n, bits) for n in sizes]
    total = sum(nbytes)
    # Per output byte: its stream's first code, its ``m`` and its byte within the stream; code ``q m + b`` of the
    # stream sits in plane ``q`` of byte ``b`` (a byte past ``m`` or a code past the stream reads the zero code).
    host = torch.tensor([[sum(sizes[:i]) for i in range(len(sizes))], m, [sum(nbytes[:i]) for i in range(len(sizes))],
                         sizes], dtype=torch.int64).to(device)
    stream = torch.repeat_interleave(torch.arange(len(sizes), device=device), torch.tensor(nbytes).to(device),
                                     output_size=total)
    first, m_t, offset, size = (x.index_select(0, stream) for x in host.unbind(0))
    byte = torch.arange(total, device=device) - offset
    local = byte[None, :] + torch.arange(per_byte, device=device)[:, None] * m_t[None, :]  # [planes, bytes]
    valid = (byte[None, :] < m_t[None, :]) & (local < size[None, :])
    index = torch.where(valid, first[None, :] + local, flat.numel())
    planes = torch.cat([flat, flat.new_zeros(1)]).index_select(0, index.view(-1)).view(per_byte, total)
    packed = planes[0].clone()
    for i in range(1, per_byte):
        packed |= planes[i] << (i * bits)
    return packed.view(torch.int32)


def unpack_stream(words: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_stream`: the first ``numel`` codes, uint8, 1-D."""
    codes_per_word(bits)  # validates bits
    per_byte = 8 // bits
    m = -(-numel // per_byte)
    data = words.view(torch.uint8)[:m]
    if per_byte == 1:
        return data
    key = (bits, words.device)
    if key not in _PLANE_SHIFTS:
        _PLANE_SHIFTS[key] = torch.arange(0, 8, bits, dtype=torch.uint8, device=words.device)[:, None]
    return ((data[None, :] >> _PLANE_SHIFTS[key]) & (2**bits - 1)).view(-1)[:numel]


#: Per (bits, device): the bit offset of each plane, ``[8 / b, 1]`` uint8 (made once; a read is a few ops).
_PLANE_SHIFTS: dict[tuple[int, torch.device], torch.Tensor] = {}


def byte_table(values: torch.Tensor, bits: int) -> torch.Tensor:
    """``[8 / b, 256]``: row ``p``, column ``byte`` = ``values[(byte >> p b) & (2^b - 1)]``, the value of the code
    that plane ``p`` of a stream byte holds (see :func:`pack_stream`); for :func:`decode_stream`.

    Args:
        values: ``[2^b]``, the value of each code (a codebook, or the codes themselves as floats).
        bits: 2, 4 or 8.
    """
    codes_per_word(bits)  # validates bits
    per_byte = 8 // bits
    byte = torch.arange(256, device=values.device)
    shifts = torch.arange(0, 8, bits, device=values.device)[:, None]
    return values[(byte[None, :] >> shifts) & (2**bits - 1)].reshape(per_byte, 256).contiguous()


def decode_stream(words: torch.Tensor, table: torch.Tensor, numel: int, extra: int = 0) -> torch.Tensor:
    """The values of the first ``numel`` codes of a :func:`pack_stream` stream, 1-D in ``table``'s dtype:
    ``values[unpack_stream(words, bits, numel)]`` with ``table = byte_table(values, bits)``, in one gather per
    stream byte and plane (the planar layout puts plane ``p`` of every byte at codes ``[p m, (p + 1) m)``, which
    is exactly the output of an ``index_select`` along the table's columns), without unpacked codes.

    ``extra``: the result has that many more elements after the values (uninitialized), for a caller that wants
    room next to them (`SlotLayout.place` reads a zero row after the slots).
    """
    per_byte = table.shape[0]
    m = -(-numel // per_byte)
    data = words.view(torch.uint8)[:m].to(torch.int32)
    out = torch.empty(max(per_byte * m, numel + extra), dtype=table.dtype, device=table.device)
    torch.index_select(table, 1, data, out=out[: per_byte * m].view(per_byte, m))
    return out[: numel + extra]
