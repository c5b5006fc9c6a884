"""`KVQuantState`: the fitted per-layer KVQuant calibration state, as a small safetensors file.

Paper "KIVI and KVQuant Adaptations": KVQuant loads a bit-width-specific, per-layer key/value state fitted from
Fast-dLLM cache traces. Per layer it holds (reference ``SqueezeAILab/KVQuant``,
``quant/kvquant/simquant_module_quantizer.py``, ``SimQuant.quantize`` and ``QuantLinearSim``):

* ``k_upper`` / ``k_lower`` ``[L, C]`` float16: per-channel static thresholds of the **pre-RoPE** keys (the
  ``(1 + t) / 2`` and ``(1 - t) / 2`` percentiles of calibration keys per channel, ``t`` = sparsity threshold;
  the reference casts them to fp16 in ``QuantLinearSim`` and so do we). ``C = num_kv_heads * head_dim``, column
  ``h * head_dim + d`` (the reference's k_proj output layout).
* ``k_lut`` / ``v_lut`` ``[L, 2^b]`` float32: the non-uniform codebooks (k-means centroids in the normalized
  ``[-1, 1]`` space), in the order they were fitted (ties in nearest-centroid rounding go to the earlier entry).

The metadata (model id, weights fingerprint, bits, sparsity threshold, first_few_fp16, provenance) is a JSON string
in the safetensors header. The id is derived from the file's bytes.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from service import strict_json
from service.artifacts.base import Artifact, ArtifactMismatch, Provenance, canonical_json, check_fingerprint
from service.engine.spec import ModelSpec

_META_KEY = "dllm_kvq.kvquant_state"
_TENSORS = ("k_upper", "k_lower", "k_lut", "v_lut")


class KVQuantStateMeta(BaseModel):
    """The JSON part of a KVQuant state.

    Attributes:
        model_id, weights_fingerprint: the checkpoint it was fitted on (see `PolicyTable`).
        bits: codebook bits b (``2^b`` centroids), one of 2, 4, 8.
        num_layers, channels: ``L`` and ``C = num_kv_heads * head_dim``.
        sparsity_threshold: share of each vector kept dense (paper: 0.99, i.e. 0.5% outliers in each tail).
        first_few_fp16: leading tokens kept in full precision (paper: 0; the only value the quantizer supports).
        provenance: the data and code that made it.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: Literal[1] = 1
    model_id: str
    weights_fingerprint: str = Field(min_length=1)
    bits: Literal[2, 4, 8]
    num_layers: int = Field(gt=0)
    channels: int = Field(gt=0)
    sparsity_threshold: float = Field(0.99, gt=0.0, le=1.0)
    first_few_fp16: Literal[0] = 0
    provenance: Provenance


@dataclass(frozen=True, eq=False)
class KVQuantState(Artifact):
    """A fitted KVQuant state (metadata + the four per-layer tensors described in the module docstring).

    Raises (at construction): ``ValueError`` naming the tensor whose shape or dtype does not fit the metadata.
    """

    #: The store kind KVQuant states are kept under.
    KIND: ClassVar[str] = "kvquant_state"
    LABEL: ClassVar[str] = "KVQuant state"
    #: The admin API's URL segment (``/admin/kvquant_states``).
    PLURAL: ClassVar[str] = "kvquant_states"

    meta: KVQuantStateMeta
    k_upper: torch.Tensor
    k_lower: torch.Tensor
    k_lut: torch.Tensor
    v_lut: torch.Tensor

    def __post_init__(self) -> None:
        m = self.meta
        expected = {
            "k_upper": ((m.num_layers, m.channels), torch.float16),
            "k_lower": ((m.num_layers, m.channels), torch.float16),
            "k_lut": ((m.num_layers, 2**m.bits), torch.float32),
            "v_lut": ((m.num_layers, 2**m.bits), torch.float32),
        }
        for name, (shape, dtype) in expected.items():
            t = getattr(self, name)
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise ValueError(f"{name}: expected {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}")
            if not torch.isfinite(t).all():
                raise ValueError(f"{name}: holds NaN or inf")
        if (self.k_upper.float() < self.k_lower.float()).any():
            raise ValueError("k_upper: below k_lower for some channel")

    def summary(self) -> dict:
        """What ``GET /admin/kvquant_states/{id}`` shows: the metadata (the tensors are binary: ``.../raw``)."""
        return self.meta.model_dump(mode="json")

    def to_bytes(self) -> bytes:
        """The safetensors file (metadata JSON in the header); deterministic for equal content."""
        tensors = {name: getattr(self, name).contiguous() for name in _TENSORS}
        return save_tensors(tensors, metadata={_META_KEY: canonical_json(self.meta.model_dump(mode="json")).decode()})

    @classmethod
    def from_bytes(cls, data: bytes) -> KVQuantState:
        """Parse a file made by :meth:`to_bytes`. The header is checked against the metadata and the bytes that
        follow it before any tensor is read, so a file that declares more than it holds costs nothing.

        Raises:
            ValueError: not a safetensors file, no KVQuant metadata (or metadata nested too deep, or with
                NaN/Infinity: `service.strict_json`), tensors that do not fit the metadata, or tensor sizes and
                offsets that do not fit the file.
            pydantic.ValidationError (a ValueError): metadata that is not a `KVQuantStateMeta`.
        """
        try:
            (header_len,) = struct.unpack("<Q", data[:8])
            if header_len > len(data) - 8:
                raise ValueError(f"the header length {header_len:,} is over the {len(data) - 8:,} bytes that follow")
            header = strict_json.loads(data[8 : 8 + header_len])
            meta_json = header["__metadata__"][_META_KEY]
            if not isinstance(meta_json, str):
                raise TypeError(f"{_META_KEY} is {type(meta_json).__name__}, not a JSON string")
            meta = strict_json.loads(meta_json)
        except (struct.error, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"not a KVQuant state file (safetensors with {_META_KEY!r} metadata): {exc}") from exc
        meta = KVQuantStateMeta.model_validate(meta)
        _check_layout(header, meta, len(data) - 8 - header_len)
        try:
            tensors = load_tensors(data)
        except SafetensorError as exc:  # not a ValueError
            raise ValueError(f"not a safetensors file: {exc}") from None
        return cls(meta, **{n: tensors[n] for n in _TENSORS})

    def save(self, path: str | Path) -> None:
        """Write :meth:`to_bytes` to ``path``."""
        Path(path).write_bytes(self.to_bytes())

    @classmethod
    def load(cls, path: str | Path) -> KVQuantState:
        """Read a state file (``ValueError`` if it is not one, ``OSError`` if unreadable)."""
        return cls.from_bytes(Path(path).read_bytes())

    @property
    def id(self) -> str:
        """Content-derived id: ``kvqstate-`` + the first 32 hex digits of SHA-256 over the file bytes."""
        return "kvqstate-" + hashlib.sha256(self.to_bytes()).hexdigest()[:32]

    @property
    def bits(self) -> int:
        return self.meta.bits

    @property
    def weights_fingerprint(self) -> str:
        return self.meta.weights_fingerprint

    @property
    def cache_mode(self) -> None:
        """None: a state is fitted once and serves every cache mode."""
        return None

    def validate_for(self, spec: ModelSpec) -> None:
        """Check the state against a loaded model.

        Raises:
            ArtifactMismatch: ``weights_fingerprint`` differs; ``num_layers`` or ``channels``
                (``num_kv_heads * head_dim``) do not match the model.
        """
        check_fingerprint(self.meta.weights_fingerprint, spec)
        if self.meta.num_layers != spec.num_layers:
            raise ArtifactMismatch(
                "num_layers", f"the state has {self.meta.num_layers} layers, the model has {spec.num_layers}"
            )
        channels = spec.num_kv_heads * spec.head_dim
        if self.meta.channels != channels:
            raise ArtifactMismatch(
                "channels", f"the state has {self.meta.channels} key/value channels per token, the model has "
                f"num_kv_heads * head_dim = {spec.num_kv_heads} * {spec.head_dim} = {channels}"
            )


# safetensors dtype names -> bytes per element (https://github.com/huggingface/safetensors, format spec).
_ITEM_BYTES = {"F16": 2, "F32": 4}


def _check_layout(header: dict, meta: KVQuantStateMeta, data_bytes: int) -> None:
    """Each of the four tensors declared with the dtype and shape the metadata implies, at offsets inside the
    ``data_bytes`` that follow the header, and nothing else.

    Raises:
        ValueError: naming the tensor that is missing, extra, of another dtype or shape, or outside the data.
    """
    expected = {"k_upper": ("F16", [meta.num_layers, meta.channels]), "k_lower": ("F16", [meta.num_layers, meta.channels]),
                "k_lut": ("F32", [meta.num_layers, 2**meta.bits]), "v_lut": ("F32", [meta.num_layers, 2**meta.bits])}
    declared = {k: v for k, v in header.items() if k != "__metadata__"}
    if set(declared) != set(expected):
        raise ValueError(f"the file holds tensors {sorted(declared)}, a KVQuant state holds {sorted(expected)}")
    for name, (dtype, shape) in expected.items():
        entry = declared[name]
        if not isinstance(entry, dict) or entry.get("dtype") != dtype or entry.get("shape") != shape:
            raise ValueError(f"{name}: expected {dtype} {shape} (the metadata's num_layers, channels and bits), "
                             f"the header declares {entry!r}"[:300])
        offsets = entry.get("data_offsets")
        size = _ITEM_BYTES[dtype] * shape[0] * shape[1]
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or offsets[1] - offsets[0] != size or not 0 <= offsets[0] <= offsets[1] <= data_bytes):
            raise ValueError(f"{name}: {dtype} {shape} takes {size:,} bytes; the header places it at {offsets!r}, "
                             f"and the file holds {data_bytes:,} bytes of tensor data")
