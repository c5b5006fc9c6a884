"""Fixed K rules for the paper's Table 3 controls: one (score type, p) on every layer, as an ordinary policy table.

Paper, "Task-level K-policy controls": with K/V quantization active, the K policy is (a) none (KIVI K/V, every K
token low-bit), (b) a fixed attention rule with the same p on every layer, (c) likewise a fixed q-error rule, or
(d) the fitted per-layer policy. (b) and (c) are `PolicyTable`\\ s built here and put in the store, so a control row
goes through the same store, validation and quantizer (`service.quant.dllm_kvq`) as a fitted policy, and a user
can serve one with ``{"method": "dllm_kvq", "policy_id": ...}``.

A rule is written ``<score type>:<p>`` (``attention:2``). Its table records ``k_bit_cap`` = the rule's own
full-group nominal K bits ``(b (G - p) + 16 p) / G``: nothing was fitted under a cap, and a rule may spend more K
precision than the fit's cap allows (``attention:4`` at 2 bits is 3.75 bits), which is what the control measures.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from service.artifacts.base import Provenance
from service.artifacts.policy import SCORE_TYPES, LayerPolicy, PolicyTable, nominal_k_bits
from service.engine.spec import ModelSpec

if TYPE_CHECKING:  # the store module imports torch; `evaluate matrix --help` reads DEFAULT_RULES from here
    from service.store.base import Store

#: The paper's fixed rules (Table 3 shows attention p = 2, 4; q-error and p = 1 complete the grid).
DEFAULT_RULES: tuple[str, ...] = ("attention:1", "attention:2", "attention:4", "qerror:1", "qerror:2", "qerror:4")
RULE_LABELS = {"attention": "Attention", "qerror": "Q-error", "hybrid": "Hybrid"}
#: ``provenance.code`` of a fixed-rule table: how `is_fixed_rule` tells it from a fitted policy in the store.
FIXED_RULE_CODE = "evaluation.controls.fixed_rule_table"


def parse_rule(rule: str) -> tuple[str, int]:
    """``"attention:2"`` -> ``("attention", 2)``.

    Raises:
        ValueError: not ``<score type>:<p>`` with a legal score type (listed) and an integer p >= 1.
    """
    score_type, sep, p = rule.partition(":")
    if not sep or score_type not in SCORE_TYPES or not p.isdigit() or int(p) < 1:
        raise ValueError(f"bad K rule {rule!r}: expected <score type>:<p> with score type one of "
                         f"{', '.join(SCORE_TYPES)} and p >= 1, e.g. attention:2")
    return score_type, int(p)


def rule_label(rule: str) -> str:
    """``"attention:2"`` -> ``"Attention, p = 2"`` (the paper's column text)."""
    score_type, p = parse_rule(rule)
    return f"{RULE_LABELS[score_type]}, p = {p}"


def fixed_rule_table(spec: ModelSpec, cache_mode: str, bits: int, rule: str, k_group_size: int = 32,
                     v_group_size: int | None = None) -> PolicyTable:
    """The policy table applying ``rule`` on every layer of the model ``spec``.

    Args:
        cache_mode: ``prefix`` or ``dual``; bits: 2, 4 or 8.
        v_group_size: None = min(32, head_dim), what a `KVQuantConfig` without one resolves to.

    Raises:
        ValueError: a bad rule (`parse_rule`), or p not below ``k_group_size`` (`PolicyTable`'s check).
    """
    score_type, p = parse_rule(rule)
    return PolicyTable(
        model_id=spec.model_id, weights_fingerprint=spec.fingerprint, cache_mode=cache_mode, bits=bits,
        k_group_size=k_group_size, v_group_size=v_group_size or min(32, spec.head_dim),
        k_bit_cap=nominal_k_bits(bits, k_group_size, p),
        layers=[LayerPolicy(score_type=score_type, p=p)] * spec.num_layers,
        provenance=Provenance(data=f"fixed K rule {rule} on every layer (Table 3 control); not fitted",
                              code=FIXED_RULE_CODE),
    )


def is_fixed_rule(artifact: object) -> bool:
    """Whether ``artifact`` is a policy table made by `fixed_rule_table` (not fitted): the matrix's fitted rows
    never pick one. Any other artifact (a KVQuant state, a fitted table) is not."""
    return isinstance(artifact, PolicyTable) and artifact.provenance.code == FIXED_RULE_CODE


def store_fixed_rule(store: Store, spec: ModelSpec, cache_mode: str, bits: int, rule: str) -> str:
    """Put `fixed_rule_table` in ``store`` (content id: storing it again is a no-op) and return its id."""
    table = fixed_rule_table(spec, cache_mode, bits, rule)
    if not store.exists(PolicyTable.KIND, table.id):
        store.put_model(PolicyTable.KIND, table)
    return table.id
