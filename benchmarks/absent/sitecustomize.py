"""Packages the GPU device's image lacks, refused on import (the dry run of ``benchmarks/gpu_check.sh``).

The dry run puts this folder first on ``PYTHONPATH`` with ``DLLM_ABSENT`` naming top-level packages
(comma-separated); any import of one of them then fails as it would on the device, so a step of the check that
starts needing fastapi, uvicorn, pydantic-settings, redis or opentelemetry fails on the CPU first. Code that
imports one of them optionally (TorchInductor's remote cache tries ``redis``) sees it missing, as there.
"""

import os
import sys


class _Absent:
    """A meta-path finder that refuses the named top-level packages."""

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {name!r} (absent on the GPU device: benchmarks/gpu_check.sh)",
                                      name=name)


_names = {n.strip() for n in os.environ.get("DLLM_ABSENT", "").split(",") if n.strip()}
if _names:
    sys.meta_path.insert(0, _Absent(_names))
