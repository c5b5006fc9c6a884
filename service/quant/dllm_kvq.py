"""dLLM-KVQ's online K quantization: per layer, keep the top-p tokens of each K group in the model dtype.

Paper sections "Online dLLM-KVQ Quantization" and "Online Quantization Details". For each layer the policy table
gives a score type and a high-precision budget p. Within each K group (KIVI's per-channel groups of G tokens, cut
inside one reused segment of one row, see `service.quant.layout`), tokens are ranked by the score, the top p are
kept unquantized and excluded from the group's min/max, and the rest get min-max QDQ over their own range. V takes
the standard per-token QDQ path (the base's). With p = 0 a layer is exactly KIVI's K.

Scores, per slot (real reused token):

* ``attention``: the block-initial attention probability that active-block queries put on the token, averaged over
  query heads and queries (computed by the engine, ``KVStore.needs_scores``);
* ``qerror``: the token's squared reconstruction error under plain p = 0 QDQ, summed over kv heads and channels
  (float64 sum of the model-dtype dequantized values' errors);
* ``hybrid``: the product of the two, each normalized by its mean over the token's K group (a score whose group
  mean is 0 normalizes to 0). Scaling by a positive per-group constant does not change the ranking inside the
  group, so the hybrid ranks tokens exactly as the raw product attention x qerror would; the normalization makes
  the value scale-free (comparable across groups, layers and models for diagnostics).

Ties are broken by position (the earlier token wins), so the choice is deterministic and does not depend on the
batch.
"""

from __future__ import annotations

import torch

from service.artifacts.policy import PolicyTable
from service.engine.spec import ModelSpec
from service.quant.base import KVQuantizer, QuantSettings
from service.quant.errors import KVQuantError
from service.quant.kivi import UNIFORM_ROWS
from service.quant.layout import SlotLayout
from service.quant.plugin import CalibrationStep, QuantMethod, same
from service.quant.uniform import dequantize_codes, k_group_stats, quantize_k_slots


class DLLMKVQQuantizer(KVQuantizer):
    """dLLM-KVQ: the base's formats plus per-layer protected K tokens chosen by the policy table.

    Args:
        config: method ``dllm_kvq``; bits and group sizes must equal the table's.
        spec: the loaded model.
        policy: the table (already validated against ``spec`` by the factory).
    """


    def __init__(self, config: QuantSettings, spec: ModelSpec, policy: PolicyTable) -> None:
        super().__init__(config, spec)
        self.policy = policy
        # The engine computes block-initial attention scores only when some layer ranks by them.
        self.needs_scores = self.quantizes_k and any(e.p > 0 and e.score_type != "qerror" for e in policy.layers)

    def protect(self, layer, x, layout, scores):
        entry = self.policy.layers[layer]
        if entry.p == 0 or layout.num_slots == 0:
            return None
        if entry.score_type != "qerror" and scores is None:
            raise KVQuantError(f"layer {layer}: score type {entry.score_type!r} needs block-initial attention scores")
        if entry.score_type == "attention":
            score = scores.double()
        elif entry.score_type == "qerror":
            score = self.qerror(x, layout)
        else:
            score = normalize_per_group(scores.double(), layout) * normalize_per_group(self.qerror(x, layout), layout)
        return top_p_per_group(score, layout, entry.p)

    def artifact_key(self):
        """The policy table decides each layer's protected tokens: stores of one policy write together."""
        return self.policy.id

    def protected_count(self, layer, layout):
        """``min(p, size)`` per K group (:func:`top_p_per_group`), summed, from the layout's host-side runs."""
        entry = self.policy.layers[layer]
        if entry.p == 0 or layout.num_slots == 0:
            return 0
        return sum(n_groups * min(entry.p, size) for _, _, _, n_groups, size, _ in layout.parts())

    def qerror(self, x: torch.Tensor, layout: SlotLayout) -> torch.Tensor:
        """float64 ``[N]``: squared error of each token under plain (p = 0) K QDQ, summed over heads and channels."""
        stats = k_group_stats(x, layout, self.bits)
        groups = layout.group_of_slot
        codes = quantize_k_slots(x, layout, stats, self.bits)
        deq = dequantize_codes(codes, stats.scale[groups], stats.mn[groups], x.dtype)
        return (x.double() - deq.double()).square().sum((1, 2))


def normalize_per_group(score: torch.Tensor, layout: SlotLayout) -> torch.Tensor:
    """``score`` ``[N]`` divided by its mean over each token's K group (0 where that mean is 0)."""
    padded = torch.cat([score, score.new_zeros(1)])[layout.group_slots]  # [Ng, G]
    mean = padded.sum(1) / layout.group_valid.sum(1)
    mean = mean[layout.group_of_slot]
    return torch.where(mean > 0, score / torch.where(mean > 0, mean, 1.0), 0.0)


def top_p_per_group(score: torch.Tensor, layout: SlotLayout, p: int) -> torch.Tensor:
    """bool ``[N]``: the ``p`` highest-scoring tokens of each K group (all of a group with at most p tokens).

    Stable descending sort: equal scores keep the earlier token.
    """
    padded = torch.cat([score, score.new_full((1,), float("-inf"))])[layout.group_slots]  # [Ng, G]
    order = torch.sort(padded, dim=1, descending=True, stable=True).indices[:, :p]
    chosen = layout.group_slots.gather(1, order).flatten()
    # A short group's padding (slot N) sorts last and is chosen only where the group has at most p tokens: it
    # marks a spare last entry, dropped (no host read of how many were chosen).
    protected = torch.zeros(layout.num_slots + 1, dtype=torch.bool, device=score.device)
    protected[chosen] = True
    return protected[: layout.num_slots]


def _check_policy(policy: PolicyTable, config: QuantSettings, v_group_size: int, cache_mode: str | None) -> None:
    if cache_mode is not None:
        same("cache_mode", policy.cache_mode, cache_mode)
    same("bits", policy.bits, config.bits)
    same("k_group_size", policy.k_group_size, config.k_group_size)
    same("v_group_size", policy.v_group_size, v_group_size)


def _policy_bits(config: QuantSettings, policy: PolicyTable | None) -> dict[str, float] | None:
    """Configured bits (`QuantMethod.configured_bits`): K at the policy's ``(b (G - p) + 16 p) / G`` averaged over
    layers (`PolicyTable.mean_k_bits`), V at ``bits``; None without a policy table."""
    if not isinstance(policy, PolicyTable):
        return None
    return {"k": policy.mean_k_bits(), "v": float(config.bits)}


#: dLLM-KVQ's plug-in (`service.quant.plugin`): a fitted policy table per cache mode and bit width, KIVI's formats
#: with protected K tokens (read pooled with them, `service.quant.rows`), fitted by ``calibrate fit`` from the
#: diagnostic sums.
METHOD = QuantMethod(
    "dllm_kvq", quantizer=DLLMKVQQuantizer, artifact=PolicyTable, check=_check_policy,
    spellings={"artifact_id": "policy_id", "artifact_file": "policy_file"}, label="dLLM-KVQ", pooled=UNIFORM_ROWS,
    configured_bits=_policy_bits, fused_rows=True,
    calibration=CalibrationStep(
        "fit", "a dLLM-KVQ policy per cache mode and bit width from the diagnostic sums",
        "calibration.dllm_kvq_fit:fit_policies", flags="calibration.dllm_kvq_fit:fit_flags"),
)
