"""KVQuant's non-uniform (NUQ) quantization with dense-and-sparse outliers, and a small state fitter.

Reference: ``SqueezeAILab/KVQuant`` ``quant/kvquant/simquant_module_quantizer.py`` (``get_outliers``,
``get_outliers_dynamic``, ``quant_fn_nuq_recon``, ``SimQuant.quantize``, ``QuantLinearSim``), as deployed by the
paper ("KIVI and KVQuant Adaptations": NUQ, sparse outliers with sparsity threshold 0.99, first_few_fp16 = 0).

Both work on the reference's 2-D view of one layer: ``[N, C]`` with one row per token and column ``h * D + d``
(``C = num_kv_heads * head_dim``). All math is float32 from the input, as the reference's.

* Keys (pre-RoPE), static per-channel ranges: thresholds ``upper``/``lower`` (fp16, from the state); offset =
  (upper + lower) / 2 and range = (upper - lower) / 2 computed **in fp16** (the reference's module holds the
  thresholds in half precision); outliers are entries strictly outside ``[lower, upper]``.
* Values, dynamic per-token ranges: outliers are entries at or beyond the token's ``t`` and ``1 - t`` quantiles
  (``t = 1 - (1 - sparsity_threshold) / 2``, i.e. 0.995 for 0.99, linear interpolation); the range is the
  min/max of the token with its outliers replaced by its median (lower median).
* Non-outliers: ``u = (x - offset) / range``, the code is the index of the nearest codebook entry (ties to the
  earlier entry, as ``argmin``), dequantized ``lut[code] * range + offset``. Outliers are kept as they are.

Departures: an outlier dequantizes to its stored input value, where the reference computes ``(x - offset) +
offset`` in float32 (the same value after the module's fp16 cast); a zero range (a constant channel or token)
quantizes to code of 0.0 and dequantizes to the exact offset, where the reference divides 0 by 0 and returns
``nan_to_num`` zeros.
"""

from __future__ import annotations

import numpy as np
import torch

#: Elements per chunk of the nearest-codebook search, per device type: on a CPU its float32 work buffers (256 KiB
#: each) stay in cache (a chunk of 2^20 made the search 1.4x slower, one thread); elsewhere every chunk is ~40
#: kernel launches (a block-initial write of 32 rows is millions of entries: chunks of 2^16 made it ~2,400 launches
#: per layer, issue 41), so one chunk takes up to 2^24 entries (two 64 MiB buffers). The codes do not depend on it.
NEAREST_CHUNK = {"cpu": 2**16}
_NEAREST_CHUNK_ELSEWHERE = 2**24
#: Elements per chunk of the exhaustive search (its ``[chunk, 2^b]`` distance matrix).
_EXHAUSTIVE_CHUNK = 2**15
#: Largest codebook searched by comparisons against its entries (one pass per entry) rather than by binary search.
_COMPARE_ENTRIES = 16


def nearest_code(u: torch.Tensor, lut: torch.Tensor, increasing: bool | None = None) -> torch.Tensor:
    """Index (uint8) of the nearest ``lut`` entry to each element of ``u`` (ties: the earlier entry).

    The reference's ``argmin`` over ``|u - c|`` (the first minimum wins). A strictly increasing codebook (what
    :func:`fit_layer` makes) takes a fast path: the nearest entry is one of the two neighbours of ``u``, the entry
    ``r`` = the number of entries below ``u`` (``searchsorted``, clamped to ``[1, 2^b - 1]``) and ``r - 1``, and
    the same ``|u - c|`` comparison between them picks it (a tie keeps the lower, earlier one). For up to 16
    entries ``r`` is counted with one vectorized comparison per entry (``1 + #{0 < j < 2^b - 1: lut[j] < u}``,
    the same integer as the binary search, several times faster on a CPU); larger codebooks use ``searchsorted``.
    Any other codebook (the reference's k-means order) is searched exhaustively, in chunks of elements so the
    ``[chunk, 2^b]`` distance matrix stays small. ``u`` holds no NaN (callers normalize finite values by finite
    ranges; +/-inf sorts past every entry either way). ``increasing``: whether ``lut`` is strictly increasing, when
    the caller knows (a state's codebooks are fixed, `KVQuantQuantizer`), so that it is not read from the device
    at every call; None checks.
    """
    flat = u.reshape(-1)
    n = lut.numel()
    code = torch.empty(flat.numel(), dtype=torch.uint8, device=u.device)
    if increasing is None:
        increasing = n >= 2 and bool((lut[1:] > lut[:-1]).all())
    if n < 2 or not increasing:
        for i in range(0, flat.numel(), _EXHAUSTIVE_CHUNK):
            part = flat[i : i + _EXHAUSTIVE_CHUNK]
            code[i : i + _EXHAUSTIVE_CHUNK] = (part[:, None] - lut).abs_().argmin(-1)
        return code.view(u.shape)
    inner = lut[1:-1].unbind() if n <= _COMPARE_ENTRIES else None  # 0-dim float32 entries
    # The count is kept in float32 (small integers, exact): comparisons written as float are several times faster
    # on a CPU than bool ones.
    chunk = NEAREST_CHUNK.get(u.device.type, _NEAREST_CHUNK_ELSEWHERE)
    work = torch.empty(2, min(flat.numel(), chunk), dtype=torch.float32, device=u.device)
    for i in range(0, flat.numel(), chunk):
        part = flat[i : i + chunk]
        count, hit = work[0, : part.numel()], work[1, : part.numel()]
        if inner is not None:
            count.fill_(1)
            for entry in inner:
                count.add_(torch.gt(part, entry, out=hit))
            index = count.to(torch.int32)
        else:
            index = torch.searchsorted(lut, part, out_int32=True).clamp_(1, n - 1)
            count.copy_(index)
        d_right = (part - lut.index_select(0, index)).abs_()
        d_left = (part - lut.index_select(0, index - 1)).abs_()
        count.sub_(torch.ge(d_right, d_left, out=hit))  # the earlier entry unless the later one is strictly closer
        code[i : i + chunk] = count
    return code.view(u.shape)


def _lookup(lut: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """``lut[codes]`` with an int32 index (a quarter of the int64 index's memory traffic)."""
    return lut.index_select(0, codes.reshape(-1).int()).view(codes.shape)


def _normalized(x: torch.Tensor, offset: torch.Tensor, half_range: torch.Tensor) -> torch.Tensor:
    # A zero range (constant channel or token) gives 0/0: its entries normalize to 0. The fill is unconditional:
    # asking whether any range is zero would read the device at every call, and filling nothing changes nothing.
    return (x - offset).div_(half_range).masked_fill_(half_range == 0, 0)


def key_offset_range(upper: torch.Tensor, lower: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Offset and half range of static key thresholds, fp16 math as in ``QuantLinearSim`` -> float32 ``[C]``."""
    upper, lower = upper.to(torch.float16), lower.to(torch.float16)
    return ((upper + lower) / 2).float(), ((upper - lower) / 2).float()


def quantize_keys(x: torch.Tensor, upper: torch.Tensor, lower: torch.Tensor, lut: torch.Tensor, sparse: bool = True,
                  increasing: bool | None = None):
    """Per-channel static NUQ of pre-RoPE keys.

    Args:
        x: ``[N, C]`` keys (any float dtype).
        upper, lower: ``[C]`` per-channel thresholds (fp16 in the state).
        lut: ``[2^b]`` float32 codebook.
        sparse: keep outliers (strictly outside ``[lower, upper]``) in full precision.
        increasing: passed to :func:`nearest_code`.

    Returns:
        ``(codes, outliers)``: uint8 ``[N, C]`` and bool ``[N, C]``.
    """
    xf = x.float()
    offset, half_range = key_offset_range(upper, lower)
    if sparse:
        up, lo = upper.to(torch.float16).float(), lower.to(torch.float16).float()
        outliers = (xf < lo) | (xf > up)
    else:
        outliers = torch.zeros(xf.shape, dtype=torch.bool, device=x.device)
    return nearest_code(_normalized(xf, offset, half_range), lut, increasing), outliers


def dequantize_keys(codes: torch.Tensor, upper: torch.Tensor, lower: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """float32 ``[N, C]``: ``lut[code] * range + offset`` (outliers are filled in by the caller)."""
    offset, half_range = key_offset_range(upper, lower)
    return _lookup(lut, codes) * half_range + offset


def tail_quantiles(x: torch.Tensor, t: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``x`` ``[N, C]`` (float32), the ``t`` and ``1 - t`` quantiles (``t`` near 1), each ``[N, 1]``.

    Exactly ``torch.quantile(x, [t, 1 - t], dim=-1)`` (linear interpolation: rank ``q (C - 1)`` in float32,
    ``lerp`` of the order statistics below and above it, as the reference's ``get_outliers_dynamic`` computes),
    but the few order statistics in each tail come from ``topk`` instead of a full sort of every row (about 30x
    faster at head_dim 128 x 32 heads).
    """
    n = x.shape[-1]
    key = (t, n, x.device)
    if key not in _RANKS:  # made once per (t, C, device), on the host (numpy float32: torch's float32 ranks)
        ranks = np.array([t, 1 - t], dtype=np.float32) * np.float32(n - 1)
        below, above = ranks.astype(np.int64), np.ceil(ranks).astype(np.int64)
        weights = torch.from_numpy(ranks - below.astype(np.float32)).to(x.device)
        _RANKS[key] = (*map(int, below), *map(int, above), weights)
    below0, below1, above0, above1, weights = _RANKS[key]
    largest = x.topk(n - below0, dim=-1, largest=True, sorted=True).values  # [:, j] = sorted[n - 1 - j]
    smallest = x.topk(above1 + 1, dim=-1, largest=False, sorted=True).values  # [:, j] = sorted[j]
    upper = largest[:, n - 1 - below0].lerp(largest[:, n - 1 - above0], weights[0])
    lower = smallest[:, below1].lerp(smallest[:, above1], weights[1])
    return upper[:, None], lower[:, None]


#: Per (t, C, device) of :func:`tail_quantiles`: the ranks' order statistics (host ints, below and above, for t
#: and 1 - t) and the float32 interpolation weights on the device.
_RANKS: dict[tuple[float, int, torch.device], tuple] = {}


def value_outliers(x: torch.Tensor, sparsity_threshold: float) -> torch.Tensor:
    """bool ``[N, C]``: entries at or beyond each token's ``t`` / ``1 - t`` quantiles (``get_outliers_dynamic``)."""
    t = 1 - (1 - sparsity_threshold) / 2
    xf = x.float()
    if xf.shape[0] == 0:
        return torch.zeros(xf.shape, dtype=torch.bool, device=x.device)
    upper, lower = tail_quantiles(xf, t)
    return (xf <= lower) | (xf >= upper)


def midpoint_and_half_range(mx: torch.Tensor, mn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mx + mn) / 2`` and ``(mx - mn) / 2`` (float32), the reference's formulas, which overflow to inf for
    finite values near the dtype's limit (a token constant at 3e38, or +/-3e38 in one token when no outliers are
    kept). Where they do, the halves are taken first (``mx / 2 +/- mn / 2``, finite for any finite input);
    elsewhere the result is the reference's, bit for bit.
    """
    offset, half_range = (mx + mn) / 2, (mx - mn) / 2
    offset = torch.where(torch.isfinite(offset), offset, mx / 2 + mn / 2)
    half_range = torch.where(torch.isfinite(half_range), half_range, mx / 2 - mn / 2)
    return offset, half_range


def quantize_values(
    x: torch.Tensor, lut: torch.Tensor, sparse: bool = True, sparsity_threshold: float = 0.99,
    increasing: bool | None = None,
):
    """Per-token dynamic NUQ of values.

    Args:
        x: ``[N, C]`` values.
        lut: ``[2^b]`` float32 codebook.
        sparse: keep per-token quantile outliers in full precision.
        sparsity_threshold: share of each token kept dense (0.99: 0.5% in each tail).
        increasing: passed to :func:`nearest_code`.

    Returns:
        ``(codes, offset, half_range, outliers)``: uint8 ``[N, C]``, float32 ``[N]`` twice, bool ``[N, C]``.

    :func:`value_candidates` and :func:`quantize_values_of` are its two halves, for a caller that finds the rows
    needing a median (`dense_range`) with one read of its own.
    """
    xf, outliers, mx, mn, need = value_candidates(x, sparse, sparsity_threshold)
    rows = None if need is None else need.nonzero().squeeze(1)
    return quantize_values_of(xf, outliers, mx, mn, rows, lut, increasing)


def value_candidates(x: torch.Tensor, sparse: bool, sparsity_threshold: float):
    """The first half of :func:`quantize_values`, reading nothing from the device: ``(xf, outliers, mx, mn,
    need)``, float32 ``x``, its bool outliers, the extremes of each token's non-outliers and bool ``[N]`` the
    tokens whose median is needed (`dense_range_candidates`; None without sparse outliers)."""
    xf = x.float()
    if sparse:
        outliers = value_outliers(xf, sparsity_threshold)
        return xf, outliers, *dense_range_candidates(xf, outliers)
    outliers = torch.zeros(xf.shape, dtype=torch.bool, device=x.device)
    return xf, outliers, xf.amax(-1), xf.amin(-1), None


def quantize_values_of(xf, outliers, mx, mn, rows, lut, increasing=None):
    """The second half of :func:`quantize_values`: ``rows`` (int64, the needed tokens of
    :func:`value_candidates`, None without sparse outliers) get the median's extremes, then the codes."""
    if rows is not None:
        mx, mn = dense_range_fix(xf, outliers, mx, mn, rows)
    offset, half_range = midpoint_and_half_range(mx, mn)
    codes = nearest_code(_normalized(xf, offset[:, None], half_range[:, None]), lut, increasing)
    return codes, offset, half_range, outliers


def dense_range(x: torch.Tensor, outliers: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``x`` ``[N, C]`` (float32, finite), the max and min (``[N]`` each) of the row with its
    ``outliers`` replaced by its lower median, as ``where(outliers, median(x), x).amax / .amin`` (the reference).

    The median is rarely needed: it is the row's order statistic ``k = (C - 1) // 2``, and where the row's
    entries strictly below the largest non-outlier number more than ``k``, and those strictly above the smallest
    number at least ``C - k``, it lies strictly between the two, so the extremes of the row with outliers
    replaced are those of its non-outliers (the same values, and the same entry wins every comparison of the
    reduction, so even the sign of a zero agrees). Only the other rows (no non-outlier, or ties at the middle)
    compute the median, as the reference does; on real K/V rows that is none of them, and ``torch.median`` was
    the dearest step of a block-initial KVQuant write. (:func:`dense_range_candidates` and
    :func:`dense_range_fix` are its two halves, for a caller that finds the rows with one read of its own.)
    """
    mx, mn, need = dense_range_candidates(x, outliers)
    return dense_range_fix(x, outliers, mx, mn, need.nonzero().squeeze(1))


def dense_range_candidates(x: torch.Tensor, outliers: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first half of :func:`dense_range`: the extremes of each row's non-outliers (``[N]`` each) and bool
    ``[N]``, the rows whose median is needed (nothing is read from the device)."""
    n = x.shape[-1]
    k = (n - 1) // 2
    mx = x.masked_fill(outliers, float("-inf")).amax(-1)
    mn = x.masked_fill(outliers, float("inf")).amin(-1)
    hit = torch.empty_like(x)  # float comparisons: several times faster than bool ones on a CPU
    below = torch.lt(x, mx[:, None], out=hit).sum(-1)
    above = torch.gt(x, mn[:, None], out=hit).sum(-1)
    return mx, mn, (below <= k) | (above < n - k)


def dense_range_fix(
    x: torch.Tensor, outliers: torch.Tensor, mx: torch.Tensor, mn: torch.Tensor, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The second half of :func:`dense_range`: ``mx``, ``mn`` with the rows ``rows`` (int64, the needed ones of
    :func:`dense_range_candidates`) computed with the median, as the reference does."""
    if rows.numel():
        part = x.index_select(0, rows)
        median = torch.median(part, dim=-1, keepdim=True).values
        dense = torch.where(outliers.index_select(0, rows), median, part)
        mx.index_copy_(0, rows, dense.amax(-1))
        mn.index_copy_(0, rows, dense.amin(-1))
    return mx, mn


def dequantize_values(codes, offset, half_range, lut) -> torch.Tensor:
    """float32 ``[N, C]``: ``lut[code] * range + offset`` per token (outliers are filled in by the caller)."""
    return _lookup(lut, codes) * half_range[:, None] + offset[:, None]


def fit_layer(
    keys: torch.Tensor,
    values: torch.Tensor,
    bits: int,
    sparsity_threshold: float = 0.99,
    key_fisher: torch.Tensor | None = None,
    value_fisher: torch.Tensor | None = None,
):
    """Fit one layer's KVQuant state from calibration activations (``SimQuant.quantize`` with ``nuq=True``).

    Keys: per-channel percentiles ``t`` / ``1 - t`` over the calibration tokens (numpy ``percentile``, linear)
    are the static thresholds; entries normalized by them into ``[-1, 1]`` (outliers beyond left out) are
    clustered by k-means into ``2^b`` centroids (scikit-learn, ``random_state=0``, ``n_init="auto"``,
    ``max_iter=50``, optionally weighted by Fisher information, on one thread so that the codebook does not
    depend on the machine's thread count). Values: the same per token (the reference's
    ``perchannel=True, qchannel=-1`` calibration), keeping only the codebook. Centroids are returned sorted
    (k-means order is arbitrary; sorting only renames codes).

    Args:
        keys, values: ``[N, C]`` calibration keys (pre-RoPE) and values.
        bits: 2, 4 or 8.
        sparsity_threshold: 0.99 in the paper; 1.0 means plain min/max ranges.
        key_fisher, value_fisher: optional ``[N, C]`` non-negative sample weights.

    Returns:
        ``(k_upper fp16 [C], k_lower fp16 [C], k_lut float32 [2^b], v_lut float32 [2^b])``.
    """
    t = 1 - (1 - sparsity_threshold) / 2
    k = keys.float().cpu().numpy()
    k_upper = np.percentile(k, t * 100, axis=0)
    k_lower = np.percentile(k, (1 - t) * 100, axis=0)
    k_lut = _fit_codebook(k, k_upper[None, :], k_lower[None, :], bits, key_fisher)
    v = values.float().cpu().numpy()
    v_upper = np.percentile(v, t * 100, axis=1)[:, None]
    v_lower = np.percentile(v, (1 - t) * 100, axis=1)[:, None]
    v_lut = _fit_codebook(v, v_upper, v_lower, bits, value_fisher)
    return (
        torch.from_numpy(k_upper).half(),
        torch.from_numpy(k_lower).half(),
        torch.from_numpy(k_lut),
        torch.from_numpy(v_lut),
    )


def _fit_codebook(data: np.ndarray, upper: np.ndarray, lower: np.ndarray, bits: int, fisher) -> np.ndarray:
    # imported here: only fitting needs scikit-learn (and its thread pools)
    from sklearn.cluster import KMeans
    from threadpoolctl import threadpool_limits

    half_range = (upper - lower) / 2
    half_range = np.where(half_range == 0, 1.0, half_range)
    # float64 normalization and outlier test, float32 samples: the reference's promotions.
    normalized = (data - (upper + lower) / 2) / half_range
    inside = (normalized <= 1) & (normalized >= -1)
    samples = normalized[inside].astype(np.float32).reshape(-1, 1)
    weights = None if fisher is None else fisher.float().cpu().numpy().reshape(data.shape)[inside]
    kmeans = KMeans(n_clusters=2**bits, random_state=0, n_init="auto", max_iter=50)
    # scikit-learn's Lloyd iterations add per-thread partial sums of the centres in whatever order the OpenMP
    # threads finish, so the codebook depends on the thread count (up to 1e-3 between 1 and 2 threads): one
    # thread for the fit makes a state byte-identical on every machine.
    with threadpool_limits(limits=1):
        kmeans.fit(samples, sample_weight=weights)
    return np.sort(kmeans.cluster_centers_.reshape(-1).astype(np.float32))
