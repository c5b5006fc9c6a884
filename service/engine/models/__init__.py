"""LLaDA and Dream models built from the shared layers; `MODEL_CLASSES` maps an arch name to its class."""

from service.engine.models.dream import DreamModel
from service.engine.models.llada import LLaDAModel
from service.engine.models.transformer import DiffusionLM, LayerQKV, ModelConfig, capture_qkv

MODEL_CLASSES: dict[str, type[DiffusionLM]] = {"llada": LLaDAModel, "dream": DreamModel}

__all__ = ["MODEL_CLASSES", "DiffusionLM", "DreamModel", "LLaDAModel", "LayerQKV", "ModelConfig", "capture_qkv"]
