"""Block-diffusion decoding engine: LLaDA and Dream models, the KV store seam, no-cache / prefix / dual cache."""

from service.engine.engine import Engine
from service.engine.errors import EngineInputError

__all__ = ["Engine", "EngineInputError"]
