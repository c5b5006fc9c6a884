"""Block-diffusion decoding engine: LLaDA and Dream models, the KV store seam, no-cache / prefix / dual cache.

`Engine` is imported on first use (PEP 562), so that the light modules (``params``, ``errors``, ``spec``) load
without torch: the command line's ``--help`` builds its flags from them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from service.engine.errors import EngineInputError

if TYPE_CHECKING:
    from service.engine.engine import Engine

__all__ = ["Engine", "EngineInputError"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from service.engine.engine import Engine

        return Engine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
