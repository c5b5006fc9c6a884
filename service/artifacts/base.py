"""What every fitted artifact shares: the mismatch error, provenance, the weights-fingerprint check, canonical JSON
(for content ids) and the V group-size rule that artifacts and quantizers both check.

This package sits below `service.quant`, which applies the artifacts, and above `service.engine` (it reads only
`ModelSpec`); it imports neither FastAPI nor the stores (DESIGN.md, "Arrows point one way").
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from service.engine.spec import ModelSpec

#: How a store kind and an admin URL segment are spelled (the store's id rule for kinds).
NAME_PATTERN = re.compile(r"[a-z][a-z0-9_]*")


class Artifact(ABC):
    """The base class of every fitted artifact a quantization method applies (`PolicyTable`, `KVQuantState`, and
    any type a plug-in registers, `service.quant.plugin.QuantMethod`): what the store, the admin API, the
    ``policies`` command, calibration and the result matrix read from it, so none of them names a type.

    A subclass sets three class attributes (checked when the class is made: ``TypeError`` if one is missing or
    badly spelled): ``KIND`` the store kind it is kept under, ``PLURAL`` the admin URL segment
    (``/admin/<PLURAL>``), both ``[a-z][a-z0-9_]*``; ``LABEL`` how messages name it ("policy table"). It also
    offers ``weights_fingerprint`` (`ModelSpec.fingerprint` of the weights it was fitted on), ``bits`` and
    ``cache_mode`` (the cache mode it was fitted for, None for every mode) as fields or properties (a pydantic
    model declares them as fields, so they are not declared here).
    """

    KIND: ClassVar[str]
    PLURAL: ClassVar[str]
    LABEL: ClassVar[str]

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        for name in ("KIND", "PLURAL", "LABEL"):
            value = getattr(cls, name, None)
            if not isinstance(value, str) or not value or (name != "LABEL" and not NAME_PATTERN.fullmatch(value)):
                raise TypeError(f"{cls.__name__}.{name} must be a name ([a-z][a-z0-9_]* for KIND and PLURAL), "
                                f"got {value!r}")

    @property
    @abstractmethod
    def id(self) -> str:
        """The content-derived id (equal content, equal id): ``<prefix>-<hex digits>``."""

    @abstractmethod
    def to_bytes(self) -> bytes:
        """The bytes a store holds; :meth:`from_bytes` gives back an equal artifact with the same id."""

    @classmethod
    @abstractmethod
    def from_bytes(cls, data: bytes) -> Artifact:
        """Parse stored or uploaded bytes (``ValueError``, naming the field where one is at fault, if not one)."""

    @abstractmethod
    def summary(self) -> dict:
        """JSON values that describe it (``GET /admin/<PLURAL>/{id}``, ``policies show``): at least
        ``weights_fingerprint`` and ``bits``."""

    @abstractmethod
    def validate_for(self, spec: ModelSpec) -> None:
        """Check it against a loaded model (raise `ArtifactMismatch` naming the field; `check_fingerprint` does the
        weights)."""

    @classmethod
    def configured_k_bits(cls, summary: dict) -> float | None:
        """The configured K bits an artifact's :meth:`summary` fixes (docs/glossary.md, "Effective bits"), for
        ``policies list``; None (this default) where its ``bits`` is the figure."""
        return None

    @classmethod
    def activation_fields(cls) -> tuple[str, ...]:
        """The `KVQuantConfig` fields its summary fixes when it is activated by id (``bits`` and, for an artifact
        fitted for group sizes, those)."""
        return ("bits",)


class ArtifactMismatch(ValueError):
    """A policy table or KVQuant state does not fit the loaded model or the requested configuration.

    ``field`` names the offending field (``weights_fingerprint``, ``layers``, ``bits`` ...), ``detail`` says
    why; the message is ``"<field>: <detail>"``.
    """

    def __init__(self, field: str, detail: str) -> None:
        super().__init__(f"{field}: {detail}")
        self.field, self.detail = field, detail


#: Most bytes of an artifact's provenance as canonical JSON: a record of data, code and settings, never a payload.
MAX_PROVENANCE_BYTES = 64 << 10


class Provenance(BaseModel):
    """What made an artifact: the calibration data and the code, so a result can be traced and remade.

    Attributes:
        data: the calibration data (corpus loader, number of samples, trajectory ids ...).
        code: the code (package version or git commit) and the command that ran.
        created_at: ISO-8601 UTC time of creation, if the maker records it.
        details: anything else worth keeping (objective weights, win-rate gate, seed ...), JSON values only.

    Raises (at construction): ``pydantic.ValidationError`` when the whole is over `MAX_PROVENANCE_BYTES` of JSON.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    data: str
    code: str
    created_at: str | None = None
    details: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _bounded(self) -> Provenance:
        size = len(canonical_json(self.model_dump(mode="json")))
        if size > MAX_PROVENANCE_BYTES:
            raise ValueError(f"{size:,} bytes of JSON, over the {MAX_PROVENANCE_BYTES:,} a provenance may hold")
        return self


def check_fingerprint(fingerprint: str, spec: ModelSpec) -> None:
    """Raise :class:`ArtifactMismatch` (field ``weights_fingerprint``) unless it equals ``spec.fingerprint``."""
    if fingerprint != spec.fingerprint:
        raise ArtifactMismatch(
            # No model path: this answers clients too (issue 22), and the fingerprints say which weights.
            "weights_fingerprint", f"the artifact was fitted on weights {fingerprint[:16]}..., the loaded model "
            f"has {spec.fingerprint[:16]}... (a different or retrained checkpoint)"
        )


def canonical_json(obj: Any) -> bytes:
    """JSON with sorted keys and no spaces, UTF-8: equal content gives equal bytes (and equal default ids)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def legal_v_group_sizes(head_dim: int) -> list[int]:
    """The V group sizes (channels) that divide ``head_dim``."""
    return [g for g in range(1, head_dim + 1) if head_dim % g == 0]


def default_v_group_size(head_dim: int) -> int:
    """The V group size (channels) when none is given: min(32, head_dim) (KIVI's group of 32, DESIGN.md "QDQ")."""
    return min(32, head_dim)
