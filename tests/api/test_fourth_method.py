"""A fourth quantization method added from this file alone (issue 33): one plug-in, nothing else in the tree touched.

``clipped`` quantizes K and V in KIVI's formats after clipping each token's entries at a per-layer ratio of its
largest magnitude; the ratios are its fitted artifact (`ClipTable`), fitted by its own calibration step
(``calibrate clipfit``: per layer, the ratio of a small grid that quantizes the calibration samples' keys with
the least squared error). Registered here, the method is accepted by the API schema and ``generate --kv-quant``,
served in a running batch beside KIVI, KVQuant and dLLM-KVQ (its stores read together through the pooled reader
it declares), fitted by ``calibrate``, listed by ``policies list``, reported in the KV report (under its own
spelling ``clip_table_id``) and in the metrics, and a row of the result matrix (its label ``Clipped``).

Everything runs in this process (in-process TestClient, `tests.support.cli.console_main`): a subprocess would not
see a method registered here. The matrix part runs lm-eval, which starts pip (its environment report), so it is
marked integration.
"""

from __future__ import annotations

import hashlib
import json
from typing import ClassVar, Literal

import pytest
import torch
from fastapi.testclient import TestClient
from pydantic import BaseModel, ConfigDict, Field

from service.artifacts.base import Artifact, ArtifactMismatch, canonical_json, check_fingerprint
from service.quant.base import KVQuantizer
from service.quant.kivi import UNIFORM_ROWS
from service.quant.plugin import code_bits
from service.quant.registry import CalibrationStep, PooledReader, QuantMethod, register, same, unregister
from tests.support.cli import console_main

#: The ratios the calibration step chooses among (1.0: no clipping, KIVI's codes).
GRID = (1.0, 0.9, 0.8, 0.7)


class ClipTable(BaseModel, Artifact):
    """Per-layer clipping ratios of one model and bit width."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    KIND: ClassVar[str] = "clip_table"
    PLURAL: ClassVar[str] = "clip_tables"
    LABEL: ClassVar[str] = "clipping table"
    cache_mode: ClassVar[None] = None  # fits every cache mode

    weights_fingerprint: str
    bits: Literal[2, 4, 8]
    ratios: list[float] = Field(min_length=1)

    @property
    def id(self) -> str:
        return "clip-" + hashlib.sha256(self.to_bytes()).hexdigest()[:24]

    def to_bytes(self) -> bytes:
        return canonical_json(self.model_dump(mode="json"))

    @classmethod
    def from_bytes(cls, data: bytes) -> ClipTable:
        return cls.model_validate_json(data)

    def summary(self) -> dict:
        return self.model_dump(mode="json")

    def validate_for(self, spec) -> None:
        check_fingerprint(self.weights_fingerprint, spec)
        if len(self.ratios) != spec.num_layers:
            raise ArtifactMismatch("ratios", f"{len(self.ratios)} ratios for {spec.num_layers} layers")


def clip(x: torch.Tensor, ratio: float) -> torch.Tensor:
    """Each token's entries (``x`` ``[N, H, D]``) clipped at ``ratio`` x its largest magnitude."""
    if ratio >= 1.0:
        return x
    bound = x.abs().amax(dim=(-2, -1), keepdim=True) * ratio
    return torch.maximum(torch.minimum(x, bound), -bound)


class ClipQuantizer(KVQuantizer):
    """KIVI's formats after the table's clipping (so KIVI's pooled reader reads its stores)."""

    def __init__(self, config, spec, table: ClipTable) -> None:
        super().__init__(config, spec)
        self.ratios = table.ratios

    def quantize_k(self, layer, x, layout, scores):
        return super().quantize_k(layer, clip(x, self.ratios[layer]), layout, scores)

    def quantize_v(self, layer, x):
        return super().quantize_v(layer, clip(x, self.ratios[layer]))


def _check(table: ClipTable, config, v_group_size: int, cache_mode: str | None) -> None:
    same("bits", table.bits, config.bits)


def fit_clip_tables(job, args=None) -> dict[str, ClipTable]:
    """The calibration step: per bit width of the run (``--bits``), per layer the ratio of `GRID` that quantizes
    the samples' block-initial keys (per token, min-max, at those bits) with the least squared error."""
    traces = job.cache_traces(job.trace())
    tables = {}
    for bits in job.settings.bits:
        levels = 2**bits - 1
        ratios = []
        for layer in range(job.spec.num_layers):
            k = torch.cat([t[layer].k.transpose(0, 1) for t in traces])  # [N, H, D]

            def error(ratio: float, k=k, levels=levels) -> float:
                x = clip(k, ratio)
                mn, mx = x.amin(dim=(-2, -1), keepdim=True), x.amax(dim=(-2, -1), keepdim=True)
                scale = (mx - mn).clamp_min(1e-8) / levels
                return float(((((x - mn) / scale).round() * scale + mn - k) ** 2).sum())

            ratios.append(min(GRID, key=error))
        table = ClipTable(weights_fingerprint=job.spec.fingerprint, bits=bits, ratios=ratios)
        if not job.store.exists(table.KIND, table.id):
            job.store.put(table.KIND, table.to_bytes(), table.id)
        tables[str(bits)] = table
    return tables


#: Calls of the pooled reader, by how many stores each read.
POOLED_READS: list[int] = []


def _read(stores, *args):
    POOLED_READS.append(len(stores))
    return UNIFORM_ROWS.read(stores, *args)


METHOD = QuantMethod(
    "clipped", quantizer=ClipQuantizer, artifact=ClipTable, check=_check, label="Clipped",
    spellings={"artifact_id": "clip_table_id", "artifact_file": "clip_table_file"},
    pooled=PooledReader(key=UNIFORM_ROWS.key, read=_read, forget=UNIFORM_ROWS.forget),
    calibration=CalibrationStep("clipfit", "per-layer clipping ratios of the clipped method", fit_clip_tables),
    # Clipping changes no code width: every element a code at ``bits`` (KIVI's figure), and KIVI's kernel operands.
    configured_bits=code_bits, fused_rows=True,
)


@pytest.fixture
def clipped():
    register(METHOD)
    yield METHOD
    unregister(METHOD.name)


ADMIN = {"Authorization": "Bearer clip-admin-key-0123456789"}


def test_a_fourth_method_registered_from_a_test_is_served_fitted_listed_and_reported(tmp_path, clipped):
    from service.config import Settings
    from service.main import create_app

    store = str(tmp_path / "store")
    # Fitted by `calibrate` (its own verb), on the embedded model: one 8-bit table.
    done = console_main("calibrate", "clipfit", "--samples", "1", "--rounds", "1", "--bits", "8", "--store", store,
                        "--no-progress")
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(x for x in done.stdout.splitlines() if x.strip().startswith("clip_table 8: "))
    table_id = line.split(": ")[1].strip()

    # Listed by `policies list`, with its method.
    listed = console_main("policies", "list", "--store", store, "--json")
    assert listed.returncode == 0, listed.stderr
    rows = json.loads(listed.stdout)
    assert [(r["id"], r["kind"], r["method"], r["bits"]) for r in rows] == [(table_id, "clip_table", "clipped", 8)]

    settings = Settings(store_url=store, threads=1, admin_key=ADMIN["Authorization"].split()[1])
    with TestClient(create_app(settings)) as client:
        engine = client.app.state.engine
        table = ClipTable.from_bytes((tmp_path / "store" / "artifacts" / "clip_table" / table_id).read_bytes())
        assert table.weights_fingerprint == engine.spec.fingerprint and table.id == table_id
        # The API schema takes it: the method's name and its spellings.
        schema = client.get("/openapi.json").json()["components"]["schemas"]["KVQuantConfig"]
        assert "clipped" in schema["properties"]["method"]["enum"] and "clip_table_id" in schema["properties"]

        body = {"prompt": "2+3=", "max_tokens": 32, "cache_mode": "dual",
                "kv_quant": {"method": "clipped", "bits": 8, "clip_table_id": table_id}}
        r = client.post("/generate", json=body)
        assert r.status_code == 200, r.text
        kv = r.json()["kv"]
        # The KV report: its id under its own spelling, the other methods' spellings null, its bits.
        assert kv["clip_table_id"] == table_id and kv["policy_id"] is None and kv["kvquant_state_id"] is None
        assert kv["config"] == {**kv["config"], "method": "clipped", "clip_table_id": table_id}
        assert kv["k_nominal_bits"] == kv["v_nominal_bits"] == 8
        # Its configured bits, as its plug-in declares them (`QuantMethod.configured_bits`).
        assert r.json()["kv_config"]["configured_bits"] == {"k": 8.0, "v": 8.0}
        r = client.post("/generate", json={**body, "kv_quant": {"method": "clipped", "bits": 4,
                                                                 "clip_table_id": table_id}})
        assert r.status_code == 422 and r.json()["error"]["param"] == "kv_quant.bits", r.text
        # The metrics: its effective bits under its method and artifact.
        metrics = [x for x in client.get("/metrics").text.splitlines() if x.startswith("dllm_kv_effective_bits{")]
        assert any('method="clipped"' in x and f'policy="{table_id}"' in x for x in metrics), metrics

        _served_in_a_running_batch_beside_the_others(engine, table)

    # `generate --kv-quant` from the artifact's file.
    path = tmp_path / "clip.json"
    path.write_bytes(table.to_bytes())
    out = console_main("generate", "--prompt", "2+3=", "--gen-length", "32", "--cache-mode", "dual",
                       "--kv-quant", "clipped", "--kv-bits", "8", "--kv-artifact", str(path), "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["kv"]["clip_table_id"] == table_id


def _served_in_a_running_batch_beside_the_others(engine, table: ClipTable) -> None:
    """Two ``clipped`` requests in one running batch with KIVI, KVQuant and dLLM-KVQ ones: the two read their
    reused K/V together through the method's pooled reader, and every request decodes token for token as alone."""
    from service.engine.params import DecodeParams
    from service.quant.config import KVQuantConfig
    from service.quant.store import make_kv_store
    from service.runtime.scheduler import forward_plan
    from tests.support.artifacts import kvquant_state_for, policy_for

    policy, state = policy_for(engine.spec, "dual", 4), kvquant_state_for(engine.spec, 4)
    configs = [
        (KVQuantConfig(method="clipped", bits=8, artifact_id=table.id), table),
        (KVQuantConfig(method="kivi", bits=4), None),
        (KVQuantConfig(method="kvquant", bits=4, kvquant_state_id=state.id), state),
        (KVQuantConfig(method="dllm_kvq", bits=4, policy_id=policy.id), policy),
        (KVQuantConfig(method="clipped", bits=8, artifact_id=table.id), table),
    ]
    prompts = [engine.encode_prompt(text, chat=False) for text in ("2+3=", "7+1=", "12+30=", "9+9=", "100+23=")]
    assert len({len(p) for p in prompts}) > 1  # different lengths
    params = DecodeParams(gen_length=64, block_length=32, cache_mode="dual", threshold=None, steps=8, ignore_eos=True)
    POOLED_READS.clear()
    batch = engine.batch(forward_plan())
    cohorts = [engine.cohort([p], params, None, make_kv_store(c, engine.spec, a))
               for p, (c, a) in zip(prompts, configs, strict=True)]
    with torch.inference_mode():
        for cohort in cohorts:
            batch.join(cohort)
        while batch.cohorts:
            batch.step()
    assert POOLED_READS and set(POOLED_READS) == {2}  # the two clipped stores, read together
    for prompt, cohort, (config, artifact) in zip(prompts, cohorts, configs, strict=True):
        alone = engine.generate([prompt], params, kv_store=make_kv_store(config, engine.spec, artifact))
        got = engine.report(cohort)
        assert got.rows[0].generated_ids == alone.rows[0].generated_ids, config.method
        assert got.kv.config["method"] == config.method


@pytest.mark.integration  # lm-eval's evaluate reports its environment: torch's collect_env runs pip as a process
def test_the_fourth_method_is_a_row_of_the_matrix(tmp_path, clipped):
    from evaluation.matrix import MatrixSettings, find_artifacts, plan_cells, run_matrix, write_outputs
    from service.engine import Engine
    from service.store.base import open_store
    from tests.evaluation.conftest import direct_answers, write_echo_task
    from tests.support.fastdllm import llada_with_tokenizer

    torch.set_num_threads(1)
    engine = Engine.load(llada_with_tokenizer(tmp_path / "ckpt"))
    table = ClipTable(weights_fingerprint=engine.spec.fingerprint, bits=8, ratios=[0.9] * engine.spec.num_layers)
    url = str(tmp_path / "store")
    open_store(url).put(table.KIND, table.to_bytes(), table.id)
    assert find_artifacts(open_store(url), engine.spec.fingerprint) == {
        ("clipped", "prefix", 8): table.id, ("clipped", "dual", 8): table.id}
    task_dir = write_echo_task(tmp_path / "tasks", direct_answers(engine))
    settings = MatrixSettings(tasks=["tiny_echo"], batch_size=2, store_url=url, include_path=str(task_dir))
    cells = plan_cells(["tiny"], ["dual"], [8], ["clipped"])
    result = run_matrix(cells, settings, tmp_path / "matrix", lambda name: engine)
    assert [r["cell"] for r in result["ran"]] == ["none", "dual-none", "dual-clipped-8"] and not result["skipped"]
    paths = write_outputs(tmp_path / "matrix", ["tiny_echo"], files=result["files"])
    assert "| Clipped (8-bit) |" in paths["md"].read_text()
    rows = {r["method"]: r for r in json.loads(paths["json"].read_text())["blocks"][0]["rows"]}
    assert rows["clipped"]["configured_bits"] == {"k": 8.0, "v": 8.0}  # its plug-in's figure
    assert rows["none"]["configured_bits"] is None


def test_the_fourth_method_declares_its_configured_bits(clipped):
    """`configured_bits` reads the plug-in: the clipped method's codes at ``bits``, 16 on a side left alone."""
    from service.quant.accounting import configured_bits
    from service.quant.config import KVQuantConfig

    table = ClipTable(weights_fingerprint="f" * 64, bits=2, ratios=[0.9])
    assert configured_bits(KVQuantConfig(method="clipped", bits=2, artifact_id=table.id), table) == {"k": 2.0, "v": 2.0}
    assert configured_bits(KVQuantConfig(method="clipped", bits=2, sides="k", artifact_id=table.id), table) == {
        "k": 2.0, "v": 16.0}


def test_no_file_of_the_tree_names_the_fourth_method():
    """The method lives in this file alone: no module of the server, calibration or evaluation knows it."""
    from tests.support.paths import REPO

    sources = [p for package in ("service", "calibration", "evaluation", "dllm_kvq") for p in (REPO / package).rglob("*.py")]
    assert len(sources) > 100
    naming = [str(p.relative_to(REPO)) for p in sources if "clip_table" in (text := p.read_text())
              or '"clipped"' in text or "ClipTable" in text]
    assert naming == []
