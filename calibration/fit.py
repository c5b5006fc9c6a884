"""Policy fit: per (cache mode, bits, layer), choose the candidate ``(score type, p)`` from diagnostic sums.

Paper, "K-Cache Policy Selection" and "Policy Diagnostics and Selection". For a layer's record set ``D`` and a
candidate ``a`` with mean signed improvements ``mean_r Delta_q(a, r)`` (:mod:`calibration.metrics`):

    W(a) = sum_q w_q * mean_r Delta_q(a, r)           w = 1.0 centered_l2, 0.001 attention_kl, 0.10 top1, 0.05 topk
    L(a) = -W(a) + lambda * (B(a) - b)                 B(a): nominal K bits averaged over the reused tokens of D

The baseline (``p = 0``, every K token quantized) has ``W = 0`` and ``B = b``, so ``L = 0``. A candidate is
accepted only if ``W(a) > 0`` (it improves the weighted score), it has at least ``min_records`` paired records, its
centered-score-distance win rate (share of records with ``Delta > 0``) is at least ``win_rate`` (0.5), and ``B(a)``
is within the K-bit cap of ``b``. The layer gets the accepted candidate of smallest ``L`` (ties: smaller ``p``,
then score-type order), or ``p = 0`` if none is accepted or none beats ``L = 0``.

Departures and choices (the paper does not state them): ``lambda`` defaults to 0.01 per nominal bit. The cap at
4 bits is the paper's 4.9; at 2 and 8 bits it is ``b + 0.9`` (2.9, 8.9), the same 0.9-bit margin, which admits
the same budgets (``p <= 2`` at ``G = 32``) at every width; the cap used is stored in the table (``k_bit_cap``).
A stored table must also satisfy :class:`service.artifacts.policy.PolicyTable`'s full-group check
``(b (G - p) + 16 p) / G <= cap``, so that is a gate too. Both matter: a short last group keeps ``min(p, len)``
tokens, a larger share, so short reused segments raise the average above the full-group figure.

Sums are stored, not records: per candidate the record count, the sum of each improvement, the count of records
where it is positive (win), and the nominal K bit total and token count. Improvements are summed as integers in
units of 1e-12 (:data:`FIXED_POINT`), so addition is exact and associative: disjoint shards merged give exactly
the sums, and hence the policy, of one run over all samples.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

from calibration.metrics import METRICS
from service.artifacts.base import Provenance
from service.artifacts.policy import SCORE_TYPES, LayerPolicy, PolicyTable, nominal_k_bits
from service.quant.accounting import policy_k_bits

#: Metric weights of the selection objective (paper, "Policy Diagnostics and Selection").
WEIGHTS: dict[str, float] = {"centered_l2": 1.0, "attention_kl": 0.001, "top1": 0.10, "topk": 0.05}
#: High-precision budgets tried (paper: {0, 1, 2, 4}; 0 is the baseline).
BUDGETS: tuple[int, ...] = (0, 1, 2, 4)
#: Integer units per 1.0 of improvement in the stored sums.
FIXED_POINT = 10**12


class FitError(ValueError):
    """Sums that cannot be fitted or merged (different settings, overlapping shards, missing layers)."""


def default_k_bit_cap(bits: int) -> float:
    """The K-bit cap: 4.9 at 4 bits (paper), ``b + 0.9`` otherwise (module docstring)."""
    return round(bits + 0.9, 6)


def nominal_k_bit_total(segment_lengths: Iterable[int], k_group_size: int, bits: int, p: int) -> int:
    """Nominal K bits summed over the reused tokens of one record (an integer).

    Each reused segment is cut into groups of ``k_group_size`` tokens (the last one may be short); a group keeps
    ``min(p, len)`` tokens at 16 bits and codes the rest at ``bits`` (the paper's accounting, scales not counted).
    """
    total = 0
    for length in segment_lengths:
        for start in range(0, length, k_group_size):
            size = min(k_group_size, length - start)
            kept = min(p, size)
            total += 16 * kept + bits * (size - kept)
    return total


class CandidateSums(BaseModel):
    """Additive statistics of one candidate over the records of one (cache mode, bits, layer)."""

    model_config = ConfigDict(extra="forbid")

    records: int = 0
    delta: dict[str, int] = Field(default_factory=lambda: dict.fromkeys(METRICS, 0))
    wins: dict[str, int] = Field(default_factory=lambda: dict.fromkeys(METRICS, 0))
    bit_total: int = 0
    tokens: int = 0

    def add(self, other: CandidateSums) -> None:
        self.records += other.records
        self.bit_total += other.bit_total
        self.tokens += other.tokens
        for name in METRICS:
            self.delta[name] += other.delta[name]
            self.wins[name] += other.wins[name]

    def mean(self, name: str) -> float:
        return self.delta[name] / FIXED_POINT / self.records if self.records else 0.0

    def win_rate(self, name: str) -> float:
        return self.wins[name] / self.records if self.records else 0.0

    @property
    def mean_bits(self) -> float:
        return self.bit_total / self.tokens if self.tokens else 0.0


def cell_key(cache_mode: str, bits: int, layer: int, score_type: str, p: int) -> str:
    return f"{cache_mode}/{bits}/{layer}/{score_type}/{p}"


class DiagnosticSums(BaseModel):
    """Everything the fit needs from one diagnose run (or a merge of runs over disjoint sample shards).

    Attributes:
        model_id, model_fingerprint, num_layers: the model diagnosed.
        k_group_size, top_k: settings the records were made with (merges must agree).
        samples: ids of the trajectories diagnosed (merges must be disjoint).
        cells: ``cell_key(mode, bits, layer, score type, p)`` -> sums; ``p = 0`` cells hold the baseline's
            token counts (its improvements are zero by definition).
    """

    model_config = ConfigDict(extra="forbid")

    model_id: str
    model_fingerprint: str
    num_layers: int
    k_group_size: int
    top_k: int
    samples: list[str] = Field(default_factory=list)
    cells: dict[str, CandidateSums] = Field(default_factory=dict)

    def add_record(self, cache_mode: str, bits: int, layer: int, deltas: Mapping[tuple[str, int], Mapping[str, float]],
                   segment_lengths: list[int]) -> None:
        """Add one record's improvements per candidate ``(score type, p)`` (``p > 0``); the baseline is implied."""
        for (score_type, p), values in [(("attention", 0), dict.fromkeys(METRICS, 0.0)), *deltas.items()]:
            cell = self.cells.setdefault(cell_key(cache_mode, bits, layer, score_type, p), CandidateSums())
            cell.records += 1
            cell.bit_total += nominal_k_bit_total(segment_lengths, self.k_group_size, bits, p)
            cell.tokens += sum(segment_lengths)
            for name in METRICS:
                cell.delta[name] += round(float(values[name]) * FIXED_POINT)
                cell.wins[name] += int(values[name] > 0)

    def merge(self, other: DiagnosticSums) -> DiagnosticSums:
        """A new object holding both runs' sums.

        Raises:
            FitError: different model or settings, or a sample in both.
        """
        for name in ("model_fingerprint", "num_layers", "k_group_size", "top_k"):
            if getattr(self, name) != getattr(other, name):
                raise FitError(f"cannot merge sums with different {name}: {getattr(self, name)} vs "
                               f"{getattr(other, name)}")
        overlap = sorted(set(self.samples) & set(other.samples))
        if overlap:
            raise FitError(f"shards must be disjoint; both hold samples {overlap[:5]}")
        merged = self.model_copy(deep=True)
        merged.samples = sorted(self.samples + other.samples)
        for key, cell in other.cells.items():
            merged.cells.setdefault(key, CandidateSums()).add(cell)
        return merged

    def modes_and_bits(self) -> list[tuple[str, int]]:
        return sorted({(key.split("/")[0], int(key.split("/")[1])) for key in self.cells})


@dataclass(frozen=True)
class FitSettings:
    """Selection settings (module docstring); ``k_bit_caps`` maps bits -> cap, default :func:`default_k_bit_cap`."""

    weights: Mapping[str, float] = field(default_factory=lambda: dict(WEIGHTS))
    bit_penalty: float = 0.01
    min_records: int = 8
    win_rate: float = 0.5
    k_bit_caps: Mapping[int, float] = field(default_factory=dict)

    def cap(self, bits: int) -> float:
        return self.k_bit_caps.get(bits, default_k_bit_cap(bits))

    def as_dict(self) -> dict:
        return {"weights": dict(self.weights), "bit_penalty": self.bit_penalty, "min_records": self.min_records,
                "win_rate": self.win_rate, "k_bit_caps": {str(b): c for b, c in sorted(self.k_bit_caps.items())}}


@dataclass(frozen=True)
class LayerFit:
    """One layer's decision: the choice, and per candidate its objective and why it was refused (if it was)."""

    layer: int
    choice: LayerPolicy
    objective: dict[str, float]
    refused: dict[str, str]


def weighted_score(cell: CandidateSums, weights: Mapping[str, float]) -> float:
    """``W(a) = sum_q w_q mean_r Delta_q(a, r)``."""
    return sum(weight * cell.mean(name) for name, weight in weights.items())


def fit_layer(sums: DiagnosticSums, cache_mode: str, bits: int, layer: int, settings: FitSettings) -> LayerFit:
    """Choose one layer's candidate (module docstring); raises :class:`FitError` if the layer has no records."""
    baseline = sums.cells.get(cell_key(cache_mode, bits, layer, "attention", 0))
    if baseline is None or not baseline.records:
        raise FitError(f"no diagnostic records for cache mode {cache_mode}, {bits} bits, layer {layer}")
    cap = settings.cap(bits)
    best, best_objective = LayerPolicy(score_type="attention", p=0), 0.0
    objective, refused = {}, {}
    for p in BUDGETS[1:]:
        for score_type in SCORE_TYPES:
            name = f"{score_type}/p{p}"
            cell = sums.cells.get(cell_key(cache_mode, bits, layer, score_type, p))
            if cell is None:
                continue
            score = weighted_score(cell, settings.weights)
            objective[name] = -score + settings.bit_penalty * (cell.mean_bits - bits)
            if score <= 0:
                refused[name] = f"weighted improvement {score:.4g} <= 0"
            elif cell.records < settings.min_records:
                refused[name] = f"{cell.records} records < {settings.min_records}"
            elif cell.win_rate("centered_l2") < settings.win_rate:
                refused[name] = f"centered_l2 win rate {cell.win_rate('centered_l2'):.3f} < {settings.win_rate}"
            elif cell.mean_bits > cap + 1e-9 or nominal_k_bits(bits, sums.k_group_size, p) > cap + 1e-9:
                refused[name] = f"nominal K bits {max(cell.mean_bits, nominal_k_bits(bits, sums.k_group_size, p)):.3f}" \
                                f" > cap {cap}"
            elif objective[name] < best_objective:
                best, best_objective = LayerPolicy(score_type=score_type, p=p), objective[name]
    return LayerFit(layer, best, objective, refused)


def fit_policy(sums: DiagnosticSums, cache_mode: str, bits: int, settings: FitSettings, provenance: Provenance,
               v_group_size: int) -> tuple[PolicyTable, list[LayerFit]]:
    """The policy table of one (cache mode, bits) and the per-layer decisions behind it."""
    fits = [fit_layer(sums, cache_mode, bits, layer, settings) for layer in range(sums.num_layers)]
    details = dict(provenance.details)
    details.update(settings.as_dict(), samples=len(sums.samples))
    table = PolicyTable(
        model_id=sums.model_id, weights_fingerprint=sums.model_fingerprint, cache_mode=cache_mode, bits=bits,
        k_group_size=sums.k_group_size, v_group_size=v_group_size, k_bit_cap=settings.cap(bits),
        layers=[fit.choice for fit in fits], provenance=provenance.model_copy(update={"details": details}),
    )
    return table, fits


def table4(sums: DiagnosticSums, table: PolicyTable) -> dict[str, float]:
    """The paper's Table 4 for one policy: win rate (%) per metric over the records of the layers it protects
    (``p > 0``), the policy's configured K bits (``configured_k_bits``, `service.quant.accounting.policy_k_bits`:
    the figure every report of the policy shows), the nominal K bits measured over every layer's reused tokens of
    the calibration records (``effective_k_bits``; partial groups make it larger), and the protected-layer count."""
    wins = dict.fromkeys(METRICS, 0)
    records = bit_total = tokens = 0
    for layer, choice in enumerate(table.layers):
        cell = sums.cells[cell_key(table.cache_mode, table.bits, layer, choice.score_type, choice.p)]
        bit_total += cell.bit_total
        tokens += cell.tokens
        if choice.p:
            records += cell.records
            for name in METRICS:
                wins[name] += cell.wins[name]
    row = {name: 100.0 * wins[name] / records if records else 0.0 for name in METRICS}
    row.update(configured_k_bits=policy_k_bits(table), effective_k_bits=bit_total / tokens,
               protected_layers=sum(1 for c in table.layers if c.p))
    return row
