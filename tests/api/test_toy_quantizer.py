"""A quantizer added through the registry alone (nothing else in the tree changed) is served by the real app.

The toy method applies a small fitted artifact (a JSON table naming the weights it was fitted on and its bits) on
top of KIVI's formats. It is registered from this test, so the server runs in-process (TestClient over the real
app factory with the embedded model): a uvicorn subprocess would not see a method registered here.
"""

from __future__ import annotations

import hashlib
from typing import ClassVar

import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel, ConfigDict

from service.artifacts.base import Artifact, canonical_json, check_fingerprint
from service.config import Settings
from service.main import create_app
from service.quant.base import KVQuantizer
from service.quant.registry import QuantMethod, register, same, unregister


class ToyTable(BaseModel, Artifact):
    """The toy's fitted artifact."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    KIND: ClassVar[str] = "toy_table"
    LABEL: ClassVar[str] = "toy table"
    PLURAL: ClassVar[str] = "toy_tables"
    cache_mode: ClassVar[None] = None

    weights_fingerprint: str
    bits: int

    @property
    def id(self) -> str:
        return "toy-" + hashlib.sha256(self.to_bytes()).hexdigest()[:16]

    def to_bytes(self) -> bytes:
        return canonical_json(self.model_dump(mode="json"))

    def summary(self) -> dict:
        return self.model_dump(mode="json")

    @classmethod
    def from_bytes(cls, data: bytes) -> ToyTable:
        return cls.model_validate_json(data)

    def validate_for(self, spec) -> None:
        check_fingerprint(self.weights_fingerprint, spec)


class ToyQuantizer(KVQuantizer):
    """KIVI's formats, holding the table it was built with."""

    def __init__(self, config, spec, table: ToyTable) -> None:
        super().__init__(config, spec)
        self.table = table


def _check(table: ToyTable, config, v_group_size: int, cache_mode: str | None) -> None:
    same("bits", table.bits, config.bits)


@pytest.fixture
def toy_method():
    register(QuantMethod("toy", quantizer=ToyQuantizer, artifact=ToyTable, check=_check))
    yield
    unregister("toy")


def test_a_registered_quantizer_is_served_with_its_artifact(tmp_path, toy_method):
    admin = {"Authorization": "Bearer toy-admin-key-0123456789"}
    settings = Settings(store_url=str(tmp_path / "store"), threads=1,
                        admin_key="toy-admin-key-0123456789")
    with TestClient(create_app(settings)) as client:
        spec = client.app.state.engine.spec
        table, wrong_bits = ToyTable(weights_fingerprint=spec.fingerprint, bits=4), ToyTable(
            weights_fingerprint=spec.fingerprint, bits=2)
        # The admin API takes the registered artifact type with no code of its own: upload, list, read back.
        for t in (table, wrong_bits):
            r = client.post("/admin/toy_tables", content=t.to_bytes(), headers=admin)
            assert r.status_code == 201 and r.json() == {"kind": "toy_table", "id": t.id}, r.text
        assert {a["id"] for a in client.get("/admin/toy_tables", headers=admin).json()["data"]} == {
            table.id, wrong_bits.id}
        assert client.get(f"/admin/toy_tables/{table.id}", headers=admin).json() == {**table.summary(), "id": table.id}
        r = client.post("/admin/toy_tables", content=b'{"weights_fingerprint": "0", "bits": 4}', headers=admin)
        assert r.status_code == 422 and r.json()["error"]["param"] == "weights_fingerprint", r.text
        body = {"prompt": "2+3=", "max_tokens": 32, "cache_mode": "dual"}

        r = client.post("/generate", json={**body, "kv_quant": {"method": "toy", "bits": 4, "artifact_id": table.id}})
        assert r.status_code == 200, r.text
        kv = r.json()["kv"]
        assert kv["artifact_id"] == table.id and kv["config"]["method"] == "toy"
        assert kv["k_nominal_bits"] == kv["v_nominal_bits"] == 4  # quantized with the 4-bit codes it asked for

        r = client.post("/generate", json={**body, "kv_quant": {"method": "toy", "bits": 4, "artifact_id": wrong_bits.id}})
        # The stored artifact does not fit the configuration: rejected (422), as on an activation.
        assert r.status_code == 422 and r.json()["error"]["param"] == "kv_quant.bits", r.text
        r = client.post("/generate", json={**body, "kv_quant": {"method": "toy", "bits": 4}})
        assert r.status_code == 400 and "needs exactly one of artifact_id or artifact_file" in r.text

        models = client.get("/openapi.json").json()["components"]["schemas"]["KVQuantConfig"]
        assert "toy" in models["properties"]["method"]["enum"]
