"""``dllm-kvq policies list|show|activate|deactivate|diff|audit`` over a store and over a running server (issue 23
item 1): activation is validated as ``Store.set_active`` and the admin route validate it, and the server logs every
change of its active configuration with who made it, old and new. The admin-key checks run a real ``python -m
service policies`` subprocess; the other cases call the same ``main`` in this process (`tests.support.cli`), which
saves an interpreter start per call (the server they talk to is still a real process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from service.engine.loading import checkpoint_spec, load_checkpoint
from service.quant.config import KVQuantConfig
from service.store.base import open_store
from tests.support.artifacts import kvquant_state_for, policy_for
from tests.support.cli import service_main
from tests.support.processes import free_port

REPO = Path(__file__).resolve().parents[2]
ADMIN_KEY = "policies-cli-admin-key-0123"


def subprocess_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m service policies ...`` as a user runs it (a subprocess: the exit status and both streams)."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "service", "policies", *args], capture_output=True, text=True,
                          timeout=300, check=False, env=full_env, cwd=REPO)


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The same command's ``main`` in this process (``env`` set for the call)."""
    return service_main("policies", *args, env=env)


@pytest.fixture(scope="module")
def spec():
    return checkpoint_spec(None)


@pytest.fixture
def store_dir(tmp_path, spec) -> tuple[str, dict[str, str]]:
    """A directory store with two dual-cache 2-bit policies (p 0 and 1 per layer) and a 2-bit KVQuant state."""
    path = str(tmp_path / "store")
    store = open_store(path)
    ids = {}
    for p in (0, 1):
        table = policy_for(spec, cache_mode="dual", bits=2, p=p)
        ids[f"p{p}"] = store.put("policy", table.to_bytes(), table.id)
    state = kvquant_state_for(spec, bits=2)
    ids["state"] = store.put("kvquant_state", state.to_bytes(), state.id)
    return path, ids


def test_checkpoint_spec_equals_the_loaded_models_spec(spec):
    """The spec read without building the model (streamed fingerprint) is the one the server checks against."""
    assert spec == load_checkpoint(None).spec


def test_list_show_diff_over_a_store(store_dir):
    path, ids = store_dir
    listed = cli("list", "--store", path, "--json")
    assert listed.returncode == 0, listed.stderr
    rows = {r["id"]: r for r in json.loads(listed.stdout)}
    assert set(rows) == set(ids.values())
    p1 = rows[ids["p1"]]
    # Embedded model: 4 layers of G = 32, p = 1 at 2 bits -> (2 * 31 + 16) / 32 = 2.4375 nominal K bits.
    assert (p1["method"], p1["model"], p1["cache_mode"], p1["bits"], p1["configured_k_bits"]) == (
        "dllm_kvq", "embedded", "dual", 2, 2.4375)
    assert rows[ids["state"]]["method"] == "kvquant" and rows[ids["state"]]["configured_k_bits"] is None
    text = cli("list", "--store", path)
    assert text.returncode == 0 and ids["p1"] in text.stdout and "2.438" in text.stdout

    shown = cli("show", ids["p1"], "--store", path)
    assert shown.returncode == 0 and "layer   0: attention p=1" in shown.stdout

    diff = cli("diff", ids["p0"], ids["p1"], "--store", path)
    assert diff.returncode == 0, diff.stderr
    assert "layer 0: attention p=0 -> attention p=1" in diff.stdout
    assert "configured K bits: 2.000 -> 2.438" in diff.stdout
    mixed = cli("diff", ids["p0"], ids["state"], "--store", path)
    assert mixed.returncode == 2 and len(mixed.stderr.splitlines()) == 1


def test_activate_json_naming_an_id_by_prefix_over_a_store(store_dir, spec):
    """An inline JSON (or file) configuration takes an abbreviated id as an id TARGET does (it was refused as "no
    policy with id", even where the prefix starts one id), stores the full id, and lists the candidates of an
    ambiguous one."""
    path, ids = store_dir
    body = {"method": "dllm_kvq", "bits": 2, "policy_id": ids["p1"][:12]}
    done = cli("activate", "dual", json.dumps(body), "--store", path)
    assert done.returncode == 0, done.stderr
    assert open_store(path).get_active(spec.fingerprint, "dual").config.artifact_id == ids["p1"]
    store = open_store(path)
    store.put("policy", store.get("policy", ids["p1"]), ids["p1"][:12] + "twin")
    done = cli("activate", "dual", json.dumps(body), "--store", path)
    assert done.returncode != 0
    assert f"policy id '{ids['p1'][:12]}' is ambiguous: it starts 2 ids" in done.stderr


def test_activate_by_id_file_and_json_then_deactivate_over_a_store(store_dir, spec, tmp_path):
    path, ids = store_dir
    done = cli("activate", "dual", ids["p1"], "--store", path)
    assert done.returncode == 0, done.stderr
    store = open_store(path)
    entry = store.get_active(spec.fingerprint, "dual")
    assert entry.config == KVQuantConfig(method="dllm_kvq", bits=2, k_group_size=32, v_group_size=32,
                                         policy_id=ids["p1"])  # the group sizes the policy was fitted for
    assert entry.key_id.startswith("cli:")

    body = tmp_path / "kivi.json"
    body.write_text('{"method": "kivi", "bits": 2}')
    assert cli("activate", "dual", str(body), "--store", path).returncode == 0
    assert store.get_active(spec.fingerprint, "dual").config == KVQuantConfig(method="kivi", bits=2)
    assert cli("activate", "prefix", ids["state"], "--store", path).returncode == 0
    assert store.get_active(spec.fingerprint, "prefix").config.artifact_id == ids["state"]
    assert cli("activate", "dual", '{"method": "kivi", "bits": 4}', "--store", path).returncode == 0

    listed = {r["id"]: r for r in json.loads(cli("list", "--store", path, "--json").stdout)}
    assert listed[ids["state"]]["active_for"] == ["prefix"]

    assert cli("deactivate", "dual", "--store", path).returncode == 0
    assert store.get_active(spec.fingerprint, "dual").config == KVQuantConfig()
    audit = json.loads(cli("audit", "--store", path, "--json", "--limit", "2").stdout)
    assert [e["new"]["method"] for e in audit] == ["none", "kivi"]
    text = cli("audit", "--store", path).stdout.splitlines()
    assert text[0].endswith("kivi 4-bit -> none (unquantized)")
    # Already unquantized: nothing is written, so the audit log gets no "none -> none" entry (issue 45 item 6).
    again = cli("deactivate", "dual", "--store", path)
    assert again.returncode == 0 and "dual: already unquantized (none)" in again.stdout, again.stdout
    assert json.loads(cli("audit", "--store", path, "--json", "--limit", "2").stdout) == audit


@pytest.mark.parametrize(("args", "says"), [
    # A dual-cache policy for the prefix cache: Store.set_active's check refuses it, naming the field.
    (["activate", "prefix", "{p1}"], "kv_quant.cache_mode: the artifact has 'dual'"),
    (["activate", "dual", "policy-0000"], "no KVQuant state or policy table with id 'policy-0000'"),
    (["activate", "dual", "runs/none.json"], "runs/none.json: no such file"),
    (["activate", "dual", '{"method": "kivi", "bits": 3}'], "bits"),
    (["activate", "none", '{"method": "kivi", "bits": 2}'], "cache mode 'none' reuses nothing"),
    (["activate", "dual", "{p1}", "--model", "/nonexistent/model"], "/nonexistent/model does not exist"),
    (["show", "nope"], "no KVQuant state or policy table with id 'nope'"),
    (["import", "/nonexistent/folder"], "/nonexistent/folder: no such directory"),
])
def test_bad_input_is_one_line_exit_2_and_changes_nothing(store_dir, spec, args, says):
    path, ids = store_dir
    args = [a.replace("{p1}", ids["p1"]) for a in args]
    result = cli(*args, "--store", path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert len(result.stderr.splitlines()) == 1 and "Traceback" not in result.stderr, result.stderr
    assert says in result.stderr, result.stderr
    assert open_store(path).audit() == []


@pytest.mark.integration  # the real subprocess of `policies`
def test_server_path_needs_the_admin_key_in_one_line(store_dir):
    result = subprocess_cli("list", "--server", "http://127.0.0.1:9", env={"DLLM_ADMIN_KEY": ""})
    assert result.returncode == 2
    assert result.stderr.strip().endswith("--server http://127.0.0.1:9 needs the server's admin key in "
                                          "DLLM_ADMIN_KEY (export DLLM_ADMIN_KEY=...; the server must have been "
                                          "started with it)")
    down = cli("list", "--server", f"http://127.0.0.1:{free_port()}", env={"DLLM_ADMIN_KEY": ADMIN_KEY})
    assert down.returncode == 1 and "cannot reach it" in down.stderr and len(down.stderr.splitlines()) == 1


@pytest.mark.integration
def test_over_a_running_server_and_the_server_logs_every_change(store_dir, spec, tmp_path):
    """Activation through ``--server`` goes through ``PUT /admin/active``; one written into the store directly
    reaches the server by its store event; the server's log names who, old and new for both."""
    from service.config import key_id

    path, ids = store_dir
    port = free_port()
    log_path = tmp_path / "server.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DLLM_ADMIN_KEY": ADMIN_KEY, "DLLM_STORE_URL": path,
           "DLLM_STORE_CHECK_INTERVAL_S": "0.2"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "service", "serve", "--port", str(port), "--threads", "1",
                                 "--log-level", "info"], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, proc, log_path)
        admin = {"DLLM_ADMIN_KEY": ADMIN_KEY}
        done = cli("activate", "dual", ids["p1"], "--server", url, env=admin)
        assert done.returncode == 0, done.stderr
        view = httpx.get(f"{url}/admin/active", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()
        assert view["serving"]["dual"]["kv_quant"]["policy_id"] == ids["p1"]
        listed = json.loads(cli("list", "--server", url, "--json", env=admin).stdout)
        assert {r["id"]: r["active_for"] for r in listed}[ids["p1"]] == ["dual"]
        shown = cli("show", ids["p1"], "--server", url, "--json", env=admin)
        assert json.loads(shown.stdout)["cache_mode"] == "dual"

        refused = cli("activate", "prefix", ids["p1"], "--server", url, env=admin)
        assert refused.returncode == 2 and "cache_mode" in refused.stderr and len(refused.stderr.splitlines()) == 1
        wrong_key = cli("audit", "--server", url, env={"DLLM_ADMIN_KEY": "another-key-0123456789"})
        assert wrong_key.returncode == 2 and "DLLM_ADMIN_KEY must hold the server's admin key" in wrong_key.stderr

        # Straight into the store: the server follows the event and logs the change as made by the CLI user.
        assert cli("activate", "dual", '{"method": "kivi", "bits": 2}', "--store", path).returncode == 0
        _wait_for(lambda: httpx.get(f"{url}/admin/active", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
                  .json()["serving"]["dual"]["kv_quant"]["method"] == "kivi", log_path)
        audit = cli("audit", "--server", url, "--json", env=admin)
        entries = json.loads(audit.stdout)
        assert entries[0]["key_id"].startswith("cli:") and entries[1]["key_id"] == key_id(ADMIN_KEY)

        log = log_path.read_text()
        assert f"listening on {url} (OpenAI base URL {url}/v1)" in log, log[-3000:]  # serve says where it answers
        changes = [line for line in log.splitlines() if "active configuration changed" in line]
        assert len(changes) == 2, log[-3000:]
        assert f"by {key_id(ADMIN_KEY)}:" in changes[0] and ids["p1"] in changes[0]
        assert "'method': 'none'" in changes[0].split(" -> ")[0]  # old: what the server served before
        assert "by cli:" in changes[1] and "'method': 'kivi'" in changes[1].split(" -> ")[1]

        # Deactivating writes once; deactivating what is already unquantized writes nothing (issue 45 item 6).
        for _ in range(2):
            assert cli("deactivate", "dual", "--server", url, env=admin).returncode == 0
        entries = json.loads(cli("audit", "--server", url, "--json", env=admin).stdout)
        assert [((e["old"] or {}).get("method"), e["new"]["method"]) for e in entries] == [
            ("kivi", "none"), ("dllm_kvq", "kivi"), (None, "dllm_kvq")], entries
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_an_unmanaged_server_says_how_to_set_the_admin_key(monkeypatch):
    """``serve`` without DLLM_ADMIN_KEY says at start that admin is closed, how to open it, and that the store still
    changes what it serves (``test_over_a_running_server_and_the_server_logs_every_change`` shows a store write
    reaching a running server)."""
    from service.commands.serve import admin_note
    from service.config import Settings

    monkeypatch.delenv("DLLM_ADMIN_KEY", raising=False)
    note = admin_note(Settings())
    assert "DLLM_ADMIN_KEY is not set" in note and "export DLLM_ADMIN_KEY=" in note
    assert "cannot be changed" not in note and "still follows the store .dllm-kvq/store" in note
    assert admin_note(Settings(admin_key=ADMIN_KEY)) is None


def _wait_ready(url: str, proc: subprocess.Popen, log_path: Path, timeout_s: float = 300) -> None:
    _wait_for(lambda: httpx.get(f"{url}/health/ready", timeout=2).status_code == 200, log_path, timeout_s, proc)


def _wait_for(condition, log_path: Path, timeout_s: float = 60, proc: subprocess.Popen | None = None) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"server exited {proc.returncode}: {log_path.read_text()[-3000:]}")
        try:
            if condition():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"condition not met in {timeout_s} s; log: {log_path.read_text()[-3000:]}")


def test_export_to_a_directory_that_cannot_be_made_is_one_line(store_dir, tmp_path):
    """``policies export`` into a folder under a file (or /proc, or a read-only disk): one line naming the folder,
    exit 2, no traceback (was a StoreUnavailable traceback)."""
    path, _ = store_dir
    (tmp_path / "a-file").write_text("")
    target = str(tmp_path / "a-file" / "backup")
    result = cli("export", target, "--store", path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert len(result.stderr.splitlines()) == 1 and "Traceback" not in result.stderr, result.stderr
    assert target in result.stderr and "cannot" in result.stderr, result.stderr


@pytest.mark.parametrize("verb", [["list"], ["audit"], ["show", "policy-x"], ["export", "runs/never-written"]])
def test_reading_a_store_directory_that_does_not_exist_is_refused_and_makes_nothing(tmp_path, verb):
    """A mistyped ``--store`` path for a verb that only reads: one line naming it, exit 2, and no directory made
    (was: the folders created at the typo and "no policies ..." with exit 0)."""
    typo = tmp_path / "no" / "such" / "store"
    result = cli(*verb, "--store", str(typo))
    assert result.returncode == 2, result.stdout + result.stderr
    assert len(result.stderr.splitlines()) == 1 and str(typo) in result.stderr, result.stderr
    assert not (tmp_path / "no").exists() and not (REPO / "runs" / "never-written").exists()


@pytest.mark.parametrize(("limit", "says"), [("-1", "expected 1 to 10000 entries, got -1"),
                                             ("0", "expected 1 to 10000 entries, got 0"),
                                             ("10001", "expected 1 to 10000 entries, got 10001"),
                                             ("x", "expected a whole number of entries, got 'x'")])
def test_an_audit_limit_out_of_range_is_a_usage_error(store_dir, limit, says):
    """``audit --limit -1`` was accepted (the store read every entry); the bounds are the server's
    ``GET /admin/audit?limit=`` bounds, refused by argparse (exit 2) before the store is opened."""
    path, _ = store_dir
    result = cli("audit", "--store", path, "--limit", limit)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1].endswith(f"error: argument --limit: {says}"), result.stderr
    assert cli("audit", "--store", path, "--limit", "10000").returncode == 0


def test_ids_are_taken_by_unique_prefix_and_an_ambiguous_one_lists_the_candidates(store_dir, spec):
    """As ``git`` and ``docker`` do, an id may be typed by a prefix that starts no other stored id: ``show``,
    ``diff`` and ``activate`` name the artifact by its full id; a prefix that starts several is refused with one
    line listing them."""
    path, ids = store_dir
    short = ids["p1"][:8]
    shown = cli("show", short, "--store", path, "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["id"] == ids["p1"]
    diff = cli("diff", ids["p0"][:8], short, "--store", path)
    assert diff.returncode == 0 and diff.stdout.startswith(f"--- {ids['p0']}\n+++ {ids['p1']}\n"), diff.stderr
    done = cli("activate", "dual", short, "--store", path, "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["new"]["policy_id"] == ids["p1"]  # stored in full

    twin = ids["p1"][:8] + "twin"  # a second id that the same prefix starts
    open_store(path).put("policy", open_store(path).get("policy", ids["p0"]), twin)
    refused = cli("show", short, "--store", path)
    assert refused.returncode != 0
    (line,) = refused.stderr.splitlines()
    assert f"KVQuant state or policy table id '{short}' is ambiguous: it starts 2 ids ({ids['p1']}, {twin})" in line
