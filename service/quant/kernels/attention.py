"""Triton kernel: a later step's attention over the packed reused cache and the fresh window, in one pass.

Why: a later step of a block reads every layer's reused K/V. Dequantizing them into a full-precision tensor
first (the PyTorch path, `service.quant.base.KVQuantizer.dequantize`) reads the codes, writes the dequantized
tensor and reads it again; KIVI's speed comes from kernels that multiply straight from the packed codes (paper
"KIVI and KVQuant Adaptations"; ``jy-yuan/KIVI`` ``quant/matmul.py`` for the idea). Here each program owns one
(row, query head, tile of queries) and streams tiles of reused tokens, dequantizing them in registers, then the
fresh window's unquantized K/V, with an online softmax (FlashAttention's recurrence).

Values are those of the PyTorch path: each dequantized entry is computed as the QDQ path computes it (float32
``code * scale + min``, or ``lut[code] * range + offset``; protected tokens and outliers exact) and rounded to
the model dtype, KVQuant's pre-RoPE keys are rotated as `service.engine.models.layers.RotaryEmbedding` rotates
them (float32 for LLaDA; in the model dtype for Dream), and padding columns (no slot) get no weight. The only
difference from ``dequantize`` + ``scaled_dot_product_attention`` is the summation order (fp32 round-off).

**The rows of many requests in one launch** (issue 21): `fused_reuse_attention_rows` serves every row of several
stores of one uniform format (KIVI, dLLM-KVQ; a running batch's rows of one batch key, `KVStore.attend_batch`) in
one launch per layer. Their operands are concatenated as they are (`service.quant.kernels.parts`) and each
program looks up its row's store in a small table: its window width and reused length (the loops run to the
row's own lengths) and where its slots, K groups, protected rows and code streams begin, added to the pointers,
so each row reads exactly its own store and the arithmetic is the per-store kernel's: the same values whenever
the key tiles are the same (under the interpreter they follow the longest reused length of the launch; on a GPU
they are fixed, ``BLOCK_T``; not yet checked there). What one launch covers: every query head and
query tile of every row of the set, over its own reused tokens and its own fresh window; the concatenations of
the layer's codes and statistics (a few tensor copies per layer, not per request) are the only other work.
KVQuant's format (codebooks, outlier rows, pre-RoPE keys) still takes one launch per store.

**The key-bias correction** (``BIAS``, `service.quant.key_bias`): each reused key's scaled score is lowered by the
second-order term ``sum_i q_i^2 D_i^2 / (24 d)``, with the steps ``D`` made in registers beside the dequantized
key (uniform: the group's scale; nuq: the code's bin width times the channel's half range; 0 for protected tokens
and outliers) and met by the query's features in one more ``tl.dot`` per tile (two for pre-RoPE keys, whose term
takes the query rotated back by each key's angle: the rotate-half expansion of ``key_score_bias``). The fresh window
gets none.

On CUDA tensors the kernel is compiled; on CPU tensors it runs only under Triton's interpreter
(``TRITON_INTERPRET=1`` when the kernel is first used), which is how the exactness tests run without a GPU.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from service.quant.errors import KVQuantError
from service.quant.kernels.operands import BlockMaps, KernelOperands
from service.quant.kernels.parts import k_code_count, side_by_side, stores_side_by_side, stream_bytes

#: Reused or fresh tokens per tile on a GPU (16 is tl.dot's minimum); queries per tile: the window, 16 to 64.
BLOCK_T = 64
#: Under the interpreter every tl operation costs a numpy call whatever its size, so tiles are as large as the
#: shapes allow (up to this many tokens).
INTERPRETER_BLOCK_T = 256
#: int32 entries per store of `fused_reuse_attention_rows`'s table (`service.quant.kernels.parts.PART_INFO`).
_INFO = tl.constexpr(9)


@triton.jit
def _code(codes_ptr, i, m, mask, BITS: tl.constexpr):
    """Code ``i`` of a planar stream of ``m`` bytes (`service.quant.packing.pack_stream`)."""
    if BITS == 8:
        return tl.load(codes_ptr + i, mask=mask, other=0).to(tl.int32)
    byte = tl.load(codes_ptr + i % m, mask=mask, other=0).to(tl.int32)
    return (byte >> ((i // m) * BITS)) & ((1 << BITS) - 1)


@triton.jit
def _nuq_entries(codes_ptr, m, lut_ptr, scale, offset, out_start_ptr, out_index_ptr, out_values_ptr, most,
                 row, d, valid, mask, D: tl.constexpr, BITS: tl.constexpr):
    """KVQuant entries of (slot, kv head) rows ``row`` ``[T]`` at channels ``d`` (float32):
    ``lut[code] * range + offset``, then each row's few sparse outliers (CSR, at most ``most``) put in exactly;
    and the entries' codes (int32) and whether each is an outlier."""
    flat = row[:, None] * D + d[None, :]
    code = _code(codes_ptr, flat, m, mask, BITS)
    value = tl.load(lut_ptr + code, mask=mask, other=0.0) * scale + offset
    start = tl.load(out_start_ptr + row, mask=valid, other=0)
    end = tl.load(out_start_ptr + row + 1, mask=valid, other=0)
    outlier = tl.zeros_like(mask)
    for j in range(most):
        at = start + j
        has = valid & (at < end)
        column = tl.load(out_index_ptr + at, mask=has, other=0) - row * D
        stored = tl.load(out_values_ptr + at, mask=has, other=0.0).to(tl.float32)
        hit = has[:, None] & (column[:, None] == d[None, :])
        value = tl.where(hit, stored[:, None], value)
        outlier = outlier | hit
    return value, code, outlier


@triton.jit
def _reused_k(k_codes, k_m, k_row_ptr, group_ptr, k_scale, k_mn, k_prot, k_lut, k_width, k_os, k_oi, k_ov, k_most,
              slot, valid, hkv, d, dmask, DTYPE: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
              BITS: tl.constexpr, NUQ: tl.constexpr, PROTECTED: tl.constexpr, BIAS: tl.constexpr):
    """Dequantized K ``[BLOCK_T, BLOCK_D]`` (float32 holding model-dtype values) of ``slot`` at channels ``d``,
    and each entry's rounding step (float32, `service.quant.key_bias`: the group's scale, or the code's bin width
    times the channel's half range; 0 for a protected token or an outlier; with BIAS only, else undefined)."""
    mask = valid[:, None] & dmask[None, :]
    if NUQ:
        c = hkv * D + d
        scale = tl.load(k_scale + c, mask=dmask, other=0.0)[None, :]
        offset = tl.load(k_mn + c, mask=dmask, other=0.0)[None, :]
        k, code, outlier = _nuq_entries(k_codes, k_m, k_lut, scale, offset, k_os, k_oi, k_ov, k_most,
                                        slot * HKV + hkv, d, valid, mask, D, BITS)
        step = scale
        if BIAS:
            step = tl.where(outlier, 0.0, tl.load(k_width + code, mask=mask, other=0.0) * scale)
    else:
        row = slot
        if PROTECTED:
            row = tl.load(k_row_ptr + slot, mask=valid, other=0)
        coded = mask & (row >= 0)[:, None]
        code = _code(k_codes, (row[:, None] * HKV + hkv) * D + d[None, :], k_m, coded, BITS)
        g = tl.load(group_ptr + slot, mask=valid, other=0)
        stat = (g[:, None] * HKV + hkv) * D + d[None, :]
        scale = tl.load(k_scale + stat, mask=mask, other=0.0).to(tl.float32)
        mn = tl.load(k_mn + stat, mask=mask, other=0.0).to(tl.float32)
        k = code.to(tl.float32) * scale + mn
        step = scale
        if PROTECTED:
            kept = mask & (row < 0)[:, None]
            prow = -1 - row
            exact = tl.load(k_prot + (prow[:, None] * HKV + hkv) * D + d[None, :], mask=kept, other=0.0)
            k = tl.where(kept, exact.to(tl.float32), k)
            step = tl.where(kept, 0.0, scale)
    return k.to(DTYPE).to(tl.float32), step


@triton.jit
def _bias_query(q_ptr, b, h, qi, d, qmask, sqb, sqh, sqt, D: tl.constexpr, ROPE: tl.constexpr):
    """The query features of the key-bias term (`service.quant.key_bias.key_score_bias`), float32
    ``[BLOCK_Q, BLOCK_D]`` twice: post-RoPE keys ``q^2`` (and zeros); pre-RoPE keys, with ``q_1, q_2`` the
    rotate-half pairs ``(j, j + D/2)``: ``[(q_1^2 + q_2^2) / 2 | (q_1^2 - q_2^2) / 2]`` and ``[q_1 q_2 | 0]``."""
    q = tl.load(q_ptr + b * sqb + h * sqh + qi[:, None] * sqt + d[None, :], mask=qmask, other=0.0).to(tl.float32)
    if ROPE:
        half = D // 2
        partner = (d + half) % D
        qp = tl.load(q_ptr + b * sqb + h * sqh + qi[:, None] * sqt + partner[None, :], mask=qmask,
                     other=0.0).to(tl.float32)
        first = (d < half)[None, :]
        return tl.where(first, (q * q + qp * qp) * 0.5, (qp * qp - q * q) * 0.5), tl.where(first, q * qp, 0.0)
    return q * q, q * 0.0


@triton.jit
def _bias_keys(step, partner_step, angle, d, D: tl.constexpr, ROPE: tl.constexpr):
    """The key features matching :func:`_bias_query` (``S = step^2``): post-RoPE ``S``; pre-RoPE, with the
    key's angle ``t`` per pair, ``[S_1 + S_2 | cos(2t) (S_1 - S_2)]`` and ``[sin(2t) (S_1 - S_2) | 0]``."""
    s = step * step
    if ROPE:
        sp = partner_step * partner_step
        first = (d < D // 2)[None, :]
        return (tl.where(first, s + sp, (sp - s) * tl.cos(2.0 * angle)),
                tl.where(first, (s - sp) * tl.sin(2.0 * angle), 0.0))
    return s, s


@triton.jit
def _fused_reuse_attention(
    out_ptr, q_ptr, kf_ptr, vf_ptr, rows_ptr, part_ptr, info_ptr, slot_of_ptr, group_ptr,
    k_codes, k_m, k_row_ptr, k_scale, k_mn, k_prot, k_lut, k_width, k_os, k_oi, k_ov, k_most,
    v_codes, v_m, v_scale, v_mn, v_lut, v_os, v_oi, v_ov, v_most,
    pos_ptr, inv_freq_ptr,
    Tq, Tw, Tr, sm_scale, bias_scale,
    sob, soh, sot, sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, spb,
    DTYPE: tl.constexpr, H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BITS: tl.constexpr, NUQ: tl.constexpr, PROTECTED: tl.constexpr, VG: tl.constexpr,
    ROPE: tl.constexpr, ROPE_FP32: tl.constexpr, MULTI: tl.constexpr, BIAS: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_T: tl.constexpr,
):
    pid_q = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    hkv = h // (H // HKV)
    srow = tl.load(rows_ptr + b)
    tw = Tw
    tr = Tr
    if MULTI:
        # Several stores side by side (`fused_reuse_attention_rows`): the row's store's window width, reused
        # length, and where its slots, K groups, protected rows and code streams start in the concatenations.
        info = info_ptr + tl.load(part_ptr + b) * _INFO
        tw = tl.load(info)
        tr = tl.load(info + 1)
        slot0 = tl.load(info + 2)
        group0 = tl.load(info + 3)
        k_codes += tl.load(info + 5)
        k_m = tl.load(info + 6)
        v_codes += tl.load(info + 7)
        v_m = tl.load(info + 8)
        k_row_ptr += slot0
        group_ptr += slot0
        k_scale += group0 * (HKV * D)
        k_mn += group0 * (HKV * D)
        k_prot += tl.load(info + 4) * (HKV * D)
        v_scale += slot0 * (HKV * (D // VG))
        v_mn += slot0 * (HKV * (D // VG))
    qi = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    qmask = (qi < Tq)[:, None] & dmask[None, :]
    q = tl.load(q_ptr + b * sqb + h * sqh + qi[:, None] * sqt + d[None, :], mask=qmask, other=0.0)
    if BIAS:  # the key-bias correction's query features (per-key steps meet them in the reused loop)
        qa, qb = _bias_query(q_ptr, b, h, qi, d, qmask, sqb, sqh, sqt, D, ROPE)

    m_i = tl.full([BLOCK_Q], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], dtype=tl.float32)

    # Fresh window first: it is never padding, so the running maximum is finite before any padded tile.
    for t0 in range(0, tw, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        tmask = t < tw
        kv_mask = tmask[:, None] & dmask[None, :]
        k = tl.load(kf_ptr + b * skb + hkv * skh + t[:, None] * skt + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(vf_ptr + b * svb + hkv * svh + t[:, None] * svt + d[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * sm_scale
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
        m_i = m_new

    # Reused columns: dequantized in registers.
    k_len = D // 2
    for t0 in range(0, tr, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        tmask = t < tr
        slot = tl.load(slot_of_ptr + srow * Tr + t, mask=tmask, other=-1)
        valid = slot >= 0
        slot = tl.where(valid, slot, 0)
        k, step = _reused_k(k_codes, k_m, k_row_ptr, group_ptr, k_scale, k_mn, k_prot, k_lut, k_width, k_os, k_oi,
                            k_ov, k_most, slot, valid, hkv, d, dmask, DTYPE, HKV, D, BITS, NUQ, PROTECTED, BIAS)
        partner_step = step
        angle = step
        if ROPE:
            # rotate-half: channel d pairs with d + D/2 (mod D); angle = position * inv_freq[d mod D/2]
            partner = (d + k_len) % D
            kp, partner_step = _reused_k(k_codes, k_m, k_row_ptr, group_ptr, k_scale, k_mn, k_prot, k_lut, k_width,
                                         k_os, k_oi, k_ov, k_most, slot, valid, hkv, partner, dmask, DTYPE, HKV, D,
                                         BITS, NUQ, PROTECTED, BIAS)
            rotated = tl.where((d < k_len)[None, :], -kp, kp)
            pos = tl.load(pos_ptr + b * spb + t, mask=tmask, other=0).to(tl.float32)
            inv = tl.load(inv_freq_ptr + d % k_len, mask=dmask, other=0.0)
            angle = pos[:, None] * inv[None, :]
            cos = tl.cos(angle)
            sin = tl.sin(angle)
            if ROPE_FP32:
                k = (k * cos + rotated * sin).to(DTYPE).to(tl.float32)
            else:
                # Dream rotates in the activation dtype: every product and the sum round to it.
                cos = cos.to(DTYPE).to(tl.float32)
                sin = sin.to(DTYPE).to(tl.float32)
                first = (k * cos).to(DTYPE).to(tl.float32)
                second = (rotated * sin).to(DTYPE).to(tl.float32)
                k = (first + second).to(DTYPE).to(tl.float32)
        vmask = valid[:, None] & dmask[None, :]
        if NUQ:
            vscale = tl.load(v_scale + slot, mask=valid, other=0.0)[:, None]
            voffset = tl.load(v_mn + slot, mask=valid, other=0.0)[:, None]
            v, _, _ = _nuq_entries(v_codes, v_m, v_lut, vscale, voffset, v_os, v_oi, v_ov, v_most,
                                   slot * HKV + hkv, d, valid, vmask, D, BITS)
        else:
            code = _code(v_codes, (slot[:, None] * HKV + hkv) * D + d[None, :], v_m, vmask, BITS)
            stat = (slot[:, None] * HKV + hkv) * (D // VG) + (d // VG)[None, :]
            vscale = tl.load(v_scale + stat, mask=vmask, other=0.0).to(tl.float32)
            vmn = tl.load(v_mn + stat, mask=vmask, other=0.0).to(tl.float32)
            v = code.to(tl.float32) * vscale + vmn
        v = v.to(DTYPE)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * sm_scale
        if BIAS:  # each quantized key's expected rounding inflation off its score (exact keys: step 0)
            ka, kb = _bias_keys(tl.where(valid[:, None], step, 0.0), tl.where(valid[:, None], partner_step, 0.0),
                                angle, d, D, ROPE)
            bias = tl.dot(qa, tl.trans(ka), input_precision=PRECISION)
            if ROPE:
                bias += tl.dot(qb, tl.trans(kb), input_precision=PRECISION)
            s += bias * bias_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(out_ptr + b * sob + h * soh + qi[:, None] * sot + d[None, :], out.to(DTYPE), mask=qmask)


_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _or(tensor: torch.Tensor | None, dummy: torch.Tensor) -> torch.Tensor:
    return dummy if tensor is None else tensor


def fused_reuse_attention(
    q: torch.Tensor,
    k_fresh: torch.Tensor,
    v_fresh: torch.Tensor,
    ops: KernelOperands,
    maps: BlockMaps,
    rows: torch.Tensor,
    positions: torch.Tensor | None = None,
    inv_freq: torch.Tensor | None = None,
    rope_full_precision: bool = True,
    key_bias: bool = False,
) -> torch.Tensor:
    """Attention of the window's queries over the packed reused K/V of one layer and the fresh window K/V.

    Args:
        q: ``[B, H, Tq, D]`` post-RoPE queries (model dtype; the last dim contiguous).
        k_fresh, v_fresh: ``[B, H_kv, Tw, D]`` the window's K (post-RoPE) and V, unquantized.
        ops: the layer's packed format (`service.quant.kernels.operands`).
        maps: the block's slot maps.
        rows: int ``[B]``, the store row of each query row.
        positions: int64 ``[B, T_reused]`` RoPE positions of the reused columns (only for pre-RoPE keys, nuq).
        inv_freq: float32 ``[D / 2]``, the model's RoPE frequencies (with ``positions``).
        rope_full_precision: rotate in float32 (LLaDA) or in the model dtype (Dream).
        key_bias: subtract from each quantized key's scaled score its expected rounding inflation, the
            second-order term of `service.quant.key_bias.key_score_bias` (from the query and the key's steps:
            uniform, the group's scale; nuq, the code's bin width times the channel's half range, against the
            query rotated back by the key's angle; 0 for protected tokens and outliers; none on the window).

    Returns:
        ``[B, H, Tq, D]`` in q's dtype; scale 1/sqrt(D), no padding key gets weight.

    Raises:
        KVQuantError: a CPU tensor without Triton's interpreter, an unsupported dtype, or a layer with 2^31 or
            more codes (the kernel indexes in int32).
    """
    _check(q)
    hkv, d = k_fresh.shape[1], q.shape[3]
    n_entries = ops.num_slots * hkv * d
    if n_entries >= 2**31:
        raise KVQuantError(f"a layer of {n_entries} reused entries is too large for the kernel's int32 indices")
    rope = ops.fmt == "nuq"
    if rope and (positions is None or inv_freq is None):
        raise KVQuantError("pre-RoPE keys need the reused positions and the RoPE frequencies")
    return _launch(
        q, k_fresh, v_fresh, ops, maps.slot_of, maps.group_of_slot, rows.to(torch.int32), None, None,
        k_fresh.shape[2], maps.slot_of.shape[1], stream_bytes(k_code_count(ops, hkv, d), ops.bits),
        stream_bytes(n_entries, ops.bits), positions if rope else None, inv_freq if rope else None,
        rope_full_precision, key_bias,
    )


def fused_reuse_attention_rows(
    q: torch.Tensor,
    k_fresh: torch.Tensor,
    v_fresh: torch.Tensor,
    parts: list[tuple[KernelOperands, BlockMaps]],
    widths: list[int] | None = None,
    key_bias: bool = False,
) -> torch.Tensor:
    """:func:`fused_reuse_attention` for the rows of several stores in one launch (issue 21): ``parts`` are the
    stores, each with every row of its block, laid end to end along q's rows (`service.quant.kernels.parts`).

    Args:
        q: ``[R, H, Tq, D]`` post-RoPE queries, R the stores' rows together (model dtype).
        k_fresh, v_fresh: ``[R, H_kv, Tw, D]`` the windows' K (post-RoPE) and V, unquantized.
        parts: per store, its layer's operands and its block's maps, in row order; one uniform format (KIVI,
            dLLM-KVQ: same bits and V group size, all with protected tokens or none).
        widths: per store, the columns of its fresh window (the rest of the ``Tw`` columns, padding of a merged
            forward, get no weight); None: all ``Tw``.
        key_bias: the key-bias correction, as :func:`fused_reuse_attention` (each store's own steps).

    Returns:
        ``[R, H, Tq, D]`` in q's dtype; each row the values :func:`fused_reuse_attention` gives it from its own
        store alone with the same tiles (the kernel adds each store's offsets to its pointers; only the tile size
        under the interpreter, which follows the longest reused length, may change the summation order).

    Raises:
        KVQuantError: as :func:`fused_reuse_attention`; a KVQuant (nuq) part or parts of different formats; rows
            of q that are not the stores' rows together.
    """
    _check(q)
    hkv, d = k_fresh.shape[1], q.shape[3]
    widths = [k_fresh.shape[2]] * len(parts) if widths is None else widths
    set_ = side_by_side(parts, widths, hkv, d)
    if set_.rows.shape[0] != q.shape[0]:
        raise KVQuantError(f"q has {q.shape[0]} rows, the stores {set_.rows.shape[0]}")
    return _launch(q, k_fresh, v_fresh, set_.ops, set_.slot_of, set_.group_of_slot, set_.rows, set_.part_of_row,
                   set_.info, max(widths), set_.longest, 0, 0, None, None, True, key_bias)


def fused_reuse_attention_stores(
    q: torch.Tensor, k_fresh: torch.Tensor, v_fresh: torch.Tensor, stores: list, layer: int, widths: list[int],
    key_bias: bool = False,
) -> torch.Tensor:
    """:func:`fused_reuse_attention_rows` with the operands made straight from the stores
    (`service.quant.kernels.parts.stores_side_by_side`: once per layer for all their rows, no per-store operands
    or maps): the same operands, so the same values. Args as there, ``stores`` the
    `service.quant.store.QuantizedKVStore` of one uniform batch key in row order, ``layer`` the layer they attend.

    Raises:
        KVQuantError: as :func:`fused_reuse_attention_rows`.
    """
    _check(q)
    hkv, d = k_fresh.shape[1], q.shape[3]
    set_ = stores_side_by_side(stores, layer, widths, hkv, d)
    if set_.rows.shape[0] != q.shape[0]:
        raise KVQuantError(f"q has {q.shape[0]} rows, the stores {set_.rows.shape[0]}")
    return _launch(q, k_fresh, v_fresh, set_.ops, set_.slot_of, set_.group_of_slot, set_.rows, set_.part_of_row,
                   set_.info, max(widths), set_.longest, 0, 0, None, None, True, key_bias)


def _check(q: torch.Tensor) -> None:
    if q.device.type != "cuda" and not triton.knobs.runtime.interpret:
        raise KVQuantError("the Triton attention kernel runs on CPU tensors only under TRITON_INTERPRET=1")
    if q.dtype not in _DTYPES:
        raise KVQuantError(f"the Triton attention kernel takes {sorted(map(str, _DTYPES))}, got {q.dtype}")


def _launch(q, k_fresh, v_fresh, ops: KernelOperands, slot_of, group_of_slot, rows, part_of_row, info, tw: int,
            tr: int, k_m: int, v_m: int, positions, inv_freq, rope_full_precision: bool, key_bias: bool,
            tile: int | None = None) -> torch.Tensor:
    """The kernel's one launch: one program per (tile of queries, query row, head). ``part_of_row`` and ``info``
    (several stores, `service.quant.kernels.parts`) or None (one store, ``k_m``/``v_m`` its streams' bytes).
    ``tr`` is ``slot_of``'s row stride (the reused length); ``tile`` the reused length the interpreter's tiles are
    chosen for (None: ``tr``; a pooled launch, `service.quant.pooled.PooledPacked`, passes a stride of 1 and
    its bucket's length)."""
    b, h, tq, d = q.shape
    hkv = k_fresh.shape[1]
    q, k_fresh, v_fresh = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k_fresh, v_fresh))
    out = torch.empty_like(q)
    rope = positions is not None
    pos = positions if rope else torch.zeros(1, 1, dtype=torch.int64, device=q.device)
    inv = inv_freq if rope else torch.zeros(1, dtype=torch.float32, device=q.device)
    k_row = ops.k_row if ops.k_row is not None else group_of_slot  # unused without protected tokens
    multi = info is not None
    block_q = min(64, max(16, triton.next_power_of_2(tq)))
    block_t = BLOCK_T
    if q.device.type != "cuda":
        block_q = max(16, triton.next_power_of_2(tq))
        block_t = min(INTERPRETER_BLOCK_T, max(16, triton.next_power_of_2(max(tr if tile is None else tile, tw))))
    grid = (triton.cdiv(tq, block_q), b * h)
    _fused_reuse_attention[grid](
        out, q, k_fresh, v_fresh, rows, part_of_row if multi else rows, info if multi else rows,
        slot_of, group_of_slot,
        ops.k_codes, k_m, k_row, ops.k_scale, ops.k_mn, ops.k_protected,
        ops.k_lut, _or(ops.k_width, ops.k_lut), _or(ops.k_outlier_start, k_row), ops.k_outlier_index, ops.k_outlier_values, ops.k_outlier_most,
        ops.v_codes, v_m, ops.v_scale, ops.v_mn, ops.v_lut,
        _or(ops.v_outlier_start, k_row), ops.v_outlier_index, ops.v_outlier_values, ops.v_outlier_most,
        pos, inv,
        tq, tw, tr, 1.0 / math.sqrt(d), -1.0 / (24 * d),
        out.stride(0), out.stride(1), out.stride(2), q.stride(0), q.stride(1), q.stride(2),
        k_fresh.stride(0), k_fresh.stride(1), k_fresh.stride(2), v_fresh.stride(0), v_fresh.stride(1),
        v_fresh.stride(2), pos.stride(0),
        DTYPE=_DTYPES[q.dtype], H=h, HKV=hkv, D=d, BLOCK_D=max(16, triton.next_power_of_2(d)),
        BITS=ops.bits, NUQ=ops.fmt == "nuq", PROTECTED=ops.k_row is not None, VG=ops.v_group_size,
        ROPE=rope, ROPE_FP32=rope_full_precision, MULTI=multi, BIAS=key_bias, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        BLOCK_Q=block_q, BLOCK_T=block_t,
    )
    return out
