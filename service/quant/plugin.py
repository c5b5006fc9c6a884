"""`QuantMethod`: one quantization method as a plug-in, everything a consumer needs to know of it in one object.

A plug-in declares its name, its quantizer class, its fitted artifact type (a `service.artifacts.base.Artifact`
subclass, or none), the artifact's check against a configuration, the public spellings of the artifact reference
(``policy_id`` ...), how the result matrix labels it, its pooled reader (how the later steps of many requests'
stores of its format are read in one set of tensor operations, `service.quant.rows`), and its calibration step
(the ``calibrate`` verb that fits its artifact). `service.quant.registry` holds the registered plug-ins; the
config, the stores, the KV report, the server's resolver, the ``policies`` and ``calibrate`` commands,
evaluation and the matrix read them and name no method (docs/extending.md, "Adding a quantizer").

This module sits at the bottom of `service.quant` (it imports no quantizer and no configuration), so a quantizer
module declares its own plug-in beside its class, and the registry imports the declarations.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from service.artifacts.base import ArtifactMismatch

#: The generic fields of an artifact reference in `KVQuantConfig`.
REFERENCE_FIELDS = ("artifact_id", "artifact_file")

#: ``check(artifact, config, v_group_size, cache_mode)``: raise `ArtifactMismatch` (message starting with the field
#: name) where the artifact does not fit the configuration; ``cache_mode`` is None where it is not known (CLI).
Check = Callable[[Any, Any, int, "str | None"], None]


@dataclass(frozen=True)
class PooledReader:
    """How the later steps of several stores of one format read their reused K/V together
    (`service.quant.store.QuantizedKVStore.batch_key` / ``window_kv_batch``).

    Attributes:
        key: ``key(store, packed_layer) -> Hashable``: what must agree for two stores' layers to be read together
            (never None).
        read: ``read(stores, layer, key_len, positions, rope) -> (k, v)``, each ``[R, H_kv, key_len, D]`` in the
            model dtype, post-RoPE, zeros where a row has no reused token (`KVStore.window_kv_batch`).
        forget: ``forget(layout)``: drop what was kept for a cleared store's block layout.
        read_steps: ``read_steps(stores, layer, key_len, positions, rope) -> (k, v, steps, cos, sin)``: ``read``
            plus each reused key's rounding steps for the key-bias correction (`service.quant.key_bias`), float32
            ``[R, H_kv, key_len, D]``, and for pre-RoPE keys the columns' cos and sin ``[R, 1, key_len, D]``
            (None for post-RoPE keys); None when the method's reader gives no steps (corrected stores then attend
            one at a time).
    """

    key: Callable[[Any, Any], Hashable]
    read: Callable[..., tuple[Any, Any]]
    forget: Callable[[Any], None]
    read_steps: Callable[..., tuple[Any, ...]] | None = None


@dataclass(frozen=True)
class CalibrationStep:
    """The ``calibrate`` verb that fits a method's artifacts (`calibration.cli`, `calibration.job`).

    Attributes:
        verb: the ``calibrate`` verb (``fit``, ``kvquant`` ...).
        help: its one-line help.
        fit: ``fit(job) -> {key: artifact}``: fits, stores (``job.store``) and returns the artifacts of a run, by a
            key naming what each was fitted for (``"dual/4"``, ``"2"``); either the function or its
            ``"module:qualified.name"`` (the server never imports calibration: the calibration job resolves
            the name, `calibration.job.resolve`). Called as ``fit(job, args)``, ``args`` the verb's parsed flags
            (None when ``report`` or ``all`` runs it).
        flags: ``flags(parser)`` adds the verb's own flags to its argparse parser beyond the common settings (a
            function or its name, as ``fit``), or None.
    """

    verb: str
    help: str
    fit: Callable[..., dict[str, Any]] | str
    flags: Callable[[Any], None] | str | None = None


@dataclass(frozen=True)
class QuantMethod:
    """One quantization method.

    Attributes:
        name: the ``method`` value (``[a-z][a-z0-9_]*``).
        quantizer: builds the quantizer: ``quantizer(config, spec)``, or ``quantizer(config, spec, artifact)`` when
            ``artifact`` is set; None for the unquantized cache (method none).
        artifact: the fitted artifact type the method applies (an `Artifact` subclass), or None.
        check: the artifact's check against a configuration (beyond its own ``validate_for`` against the model).
        spellings: public names of the reference fields, e.g. ``{"artifact_id": "policy_id"}``; a name given here
            is accepted on input, written on output (the KV report included) and used in messages in place of the
            generic one.
        label: how the result matrix and reports name it (``"KIVI"``); the name where not given.
        pooled: its pooled reader, or None (each store reads alone).
        calibration: its calibration step, or None (nothing to fit).
        configured_bits: how its configured bits follow from the configuration and its artifact, known before any
            data: ``configured_bits(config, artifact) -> {"k": bits, "v": bits}``, the nominal bits per element
            its codes set on full groups (float; a protected token counts 16) or None where the artifact it needs
            is missing; `service.quant.accounting.configured_bits` puts 16 on a side ``sides`` leaves alone.
            `code_bits` for codes at the configuration's ``bits`` (KIVI's formats). None (the default): no figure
            follows from the configuration (KVQuant: its outliers are counted as the data has them), so its
            reports and matrix rows show none.
        fused_rows: its stores hold the kernel operands of the uniform formats (`KVQuantizer.kernel_operands`, not
            overridden) with post-RoPE keys, so on the fused kernel's path the stores of one format in a running
            batch attend in one launch (`service.quant.store.QuantizedKVStore.attend_batch`,
            ``fused_reuse_attention_rows``, keyed by `service.quant.rows.batch_key`). False (the default): each
            store launches the kernel alone (KVQuant: its non-uniform codes and pre-RoPE keys).
    """

    name: str
    quantizer: Callable[..., Any] | None
    artifact: type | None = None
    check: Check | None = None
    spellings: dict[str, str] = field(default_factory=dict)
    label: str | None = None
    pooled: PooledReader | None = None
    calibration: CalibrationStep | None = None
    configured_bits: Callable[[Any, Any], dict[str, float] | None] | None = None
    fused_rows: bool = False

    @property
    def store_kind(self) -> str | None:
        """The store kind of the method's artifact (None without one)."""
        return self.artifact.KIND if self.artifact is not None else None

    @property
    def title(self) -> str:
        """:attr:`label`, or the name."""
        return self.label or self.name

    def spelling(self, generic: str) -> str:
        """The public name of ``artifact_id`` / ``artifact_file`` for this method."""
        return self.spellings.get(generic, generic)


def code_bits(config: Any, artifact: Any = None) -> dict[str, float]:
    """`QuantMethod.configured_bits` of a method whose every element is a code at the configuration's ``bits``
    (KIVI's formats): ``{"k": bits, "v": bits}``, float bits per element; the artifact is not read."""
    return {"k": float(config.bits), "v": float(config.bits)}


def same(field_name: str, artifact_value: Any, config_value: Any) -> None:
    """Raise `ArtifactMismatch` (starting with ``field_name``) unless the artifact's value is the config's."""
    if artifact_value != config_value:
        raise ArtifactMismatch(
            field_name, f"the artifact has {artifact_value!r}, the configuration asks for {config_value!r}"
        )
