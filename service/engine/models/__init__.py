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
    "ModelConfig", "capture_qkv", "family_cache_modes", "reveal_rule",
]
