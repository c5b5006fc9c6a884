"""The decoders by name: which `service.engine.protocol.FamilyDecoder` decodes a loaded model
(`service.engine.Engine` asks :func:`decoder_for`; the request checks and ``serve`` ask :func:`settings_rules`).

A model class names its decoder (``DiffusionLM.decoder``: ``bidirectional`` by default, LLaDA2's
``block_causal``); a family that decodes as LLaDA and Dream do (bidirectional attention, a reused K/V cache) is
its model class alone, one with a decoding algorithm of its own adds its decoder here (docs/extending.md,
"Adding a model family").
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from service.engine.bidirectional import BidirectionalDecoder, bidirectional_settings
from service.engine.block_causal_batch import SETTINGS as BLOCK_CAUSAL_SETTINGS
from service.engine.block_causal_batch import BlockCausalDecoder
from service.engine.errors import EngineInputError
from service.engine.models import MODEL_CLASSES, DiffusionLM
from service.engine.protocol import Capabilities, FamilyDecoder, SettingRefused, SettingRule, check_settings
from service.engine.renoise import CAPABILITIES as RENOISING_CAPABILITIES
from service.engine.renoise import SETTINGS as RENOISING_SETTINGS
from service.engine.renoise import RenoisingDecoder
from service.engine.spec import ModelSpec


class Family:
    """One family's decoder: how to make it for a loaded model, and its settings rules (known before loading).

    Args:
        make: ``make(model, spec) -> FamilyDecoder``.
        settings: ``settings(model_class) -> {field: SettingRule}`` (the rules :attr:`FamilyDecoder.settings`
            holds once made). capabilities: its :attr:`FamilyDecoder.capabilities`.
    """

    def __init__(self, make: Callable[[DiffusionLM, ModelSpec], FamilyDecoder],
                 settings: Callable[[type[DiffusionLM]], Mapping[str, SettingRule]],
                 capabilities: Capabilities) -> None:
        self.make, self.settings, self.capabilities = make, settings, capabilities


#: Decoder name (``DiffusionLM.decoder``) -> the decoder.
DECODERS: dict[str, Family] = {
    "bidirectional": Family(BidirectionalDecoder, bidirectional_settings, BidirectionalDecoder.capabilities),
    "block_causal": Family(BlockCausalDecoder, lambda _cls: BLOCK_CAUSAL_SETTINGS, BlockCausalDecoder.capabilities),
    "renoising": Family(RenoisingDecoder, lambda _cls: RENOISING_SETTINGS, RENOISING_CAPABILITIES),
}


def _family(arch: str) -> Family:
    if arch not in MODEL_CLASSES:
        raise EngineInputError(f"unknown architecture {arch!r}; legal: {', '.join(MODEL_CLASSES)}")
    return DECODERS[MODEL_CLASSES[arch].decoder]


def decoder_for(model: DiffusionLM, spec: ModelSpec) -> FamilyDecoder:
    """The decoder of the loaded ``model`` (its family: ``spec.arch``).

    Raises:
        EngineInputError: ``spec.arch`` has no registered family.
    """
    return _family(spec.arch).make(model, spec)


def settings_rules(arch: str) -> Mapping[str, SettingRule]:
    """The settings rules of the family named ``arch``, before any model is loaded.

    Raises:
        EngineInputError: ``arch`` has no registered family.
    """
    return _family(arch).settings(MODEL_CLASSES[arch])


def capabilities_of(arch: str) -> Capabilities:
    """The capabilities of the family named ``arch``, before any model is loaded.

    Raises:
        EngineInputError: ``arch`` has no registered family.
    """
    return _family(arch).capabilities


def families_serving(name: str, value: object) -> list[str]:
    """The families that serve ``value`` of the decoding setting ``name``, as their declarations say: the served
    ones (``Capabilities.served``) whose rule for it (:func:`settings_rules`) does not refuse it, each as
    ``arch (mask kind)`` (``llada2 (block-causal)``), in `MODEL_CLASSES` order. What a refusal names as the
    families that take the value (a family declared but not served in this version takes none)."""
    out = []
    for arch, cls in MODEL_CLASSES.items():
        family = DECODERS[cls.decoder]
        if family.capabilities.served and not family.settings(cls)[name].refuses(value):
            out.append(f"{arch} ({cls.mask_kind.replace('_', '-')})")
    return out


def check_family_settings(arch: str, values: Mapping[str, object]) -> None:
    """Refuse a decoding setting the family named ``arch`` does not serve (`protocol.check_settings`).

    Raises:
        EngineInputError: naming the field (HTTP 400).
    """
    try:
        check_settings(arch, settings_rules(arch), values)
    except SettingRefused as exc:
        raise EngineInputError(str(exc), exc.field) from None
