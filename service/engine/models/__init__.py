"""LLaDA, Dream, LLaDA2 and DiffusionGemma models built from the shared layers.

`MODEL_CLASSES` is the one list of supported architectures (arch name -> class); loading, the spec, the decode
loop's reveal rule (:func:`reveal_rule`), the decoder (``DiffusionLM.decoder``, `service.engine.families`), the cache modes
(:func:`family_cache_modes`) and admission's cost figures (the config's ``mlp_cost``) all come from what the class
declares (docs/extending.md "Adding a model family").
"""

from service.engine.errors import EngineInputError
from service.engine.models.diffusion_gemma import DiffusionGemmaModel
from service.engine.models.dream import DreamModel
from service.engine.models.llada import LLaDAModel
from service.engine.models.llada2 import LLaDA2Model
from service.engine.models.transformer import DiffusionLM, LayerQKV, ModelConfig, capture_qkv
from service.engine.reveal import RevealRule

MODEL_CLASSES: dict[str, type[DiffusionLM]] = {cls.arch: cls for cls in (LLaDAModel, DreamModel, LLaDA2Model,
                                                                           DiffusionGemmaModel)}


def family_cache_modes(arch: str) -> dict[str, str]:
    """The cache modes the family named ``arch`` declares (``DiffusionLM.cache_modes``: mode -> the configured
    cache mode it runs with); a name outside :data:`MODEL_CLASSES` (the tests' fake engine) has the bidirectional
    families' default."""
    return MODEL_CLASSES.get(arch, DiffusionLM).cache_modes


def configured_cache_mode(cache_mode: str, arch: str) -> str:
    """The cache mode whose KV configuration a request in ``cache_mode`` runs with on the family named ``arch``,
    as the family declares it (`service.engine.models.DiffusionLM.cache_modes`): its own for LLaDA and Dream;
    LLaDA2's ``block``, its append-only cache of committed blocks (its reused prefix; it has no suffix), runs with
    ``prefix``'s: the server's active ``prefix`` configuration, and a request's own ``kv_quant`` checked as for
    ``prefix`` (a dLLM-KVQ policy made for ``prefix``, as ``calibrate`` makes LLaDA2's). A mode the family does
    not declare is returned as is (the caller's `check_cache_mode` refuses it)."""
    return family_cache_modes(arch).get(cache_mode, cache_mode)


def reveal_rule(arch: str) -> RevealRule:
    """The reveal rule of the family named ``arch``.

    Raises:
        EngineInputError: ``arch`` is not a key of :data:`MODEL_CLASSES` (the message lists them).
    """
    if arch not in MODEL_CLASSES:
        raise EngineInputError(f"unknown architecture {arch!r}; legal: {', '.join(MODEL_CLASSES)}")
    return MODEL_CLASSES[arch].reveal_rule


__all__ = [
    "MODEL_CLASSES", "DiffusionGemmaModel", "DiffusionLM", "DreamModel", "LLaDA2Model", "LLaDAModel", "LayerQKV",
    "ModelConfig", "capture_qkv", "configured_cache_mode", "family_cache_modes", "reveal_rule",
]
