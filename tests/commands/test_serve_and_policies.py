"""The serve command's flags override the DLLM_* environment; the policies command copies between stores and
refuses an artifact whose content does not give its id."""

from __future__ import annotations

import uuid

import pytest
from pydantic import ValidationError

from service.__main__ import build_parser
from service.commands.policies import copy_artifacts
from service.commands.serve import settings_from_args
from service.engine.spec import ModelSpec
from service.quant.config import KVQuantConfig
from service.store.base import open_store
from service.store.redis_store import RedisStore
from tests.support.artifacts import policy_for
from tests.support.processes import SHARED_REDIS_URL

SPEC = ModelSpec(arch="llada", model_id="m", fingerprint="ab" * 32, num_layers=3, num_heads=2, num_kv_heads=2,
                 head_dim=16, vocab_size=100, mask_id=99, eos_ids=(1,), pad_id=0, max_length=128)


def test_serve_flags_override_environment(monkeypatch):
    monkeypatch.setenv("DLLM_PORT", "9000")
    monkeypatch.setenv("DLLM_MAX_BATCH_SIZE", "2")
    args = build_parser().parse_args(["serve", "--port", "9100", "--kv-quant", '{"method": "kivi", "bits": 2}',
                                      "--allow-unauthenticated"])
    s = settings_from_args(args)
    assert (s.port, s.max_batch_size, s.kv_quant, s.allow_unauthenticated) == (
        9100, 2, KVQuantConfig(method="kivi", bits=2), True)


def test_token_editing_is_a_serve_flag_and_a_setting(monkeypatch):
    """Issue 45 item 4: LLaDA2.1's editing settings are DLLM_* settings and serve flags, as every decoding setting."""
    monkeypatch.setenv("DLLM_EDITING_THRESHOLD", "0.7")
    monkeypatch.setenv("DLLM_MIN_TRANSFER", "3")
    s = settings_from_args(build_parser().parse_args(["serve", "--max-post-steps", "4", "--min-transfer", "2"]))
    assert (s.editing_threshold, s.max_post_steps, s.min_transfer) == (0.7, 4, 2)
    with pytest.raises(ValidationError):  # 0 could reveal nothing, forever
        settings_from_args(build_parser().parse_args(["serve", "--min-transfer", "0"]))


@pytest.mark.integration
def test_policies_export_import_round_trip(tmp_path):
    redis_store = RedisStore(SHARED_REDIS_URL, prefix=f"test-cli-{uuid.uuid4().hex[:8]}")
    try:
        tables = [policy_for(SPEC, p=p) for p in (0, 1)]
        for t in tables:
            redis_store.put("policy", t.to_json().encode(), t.id)
        out = copy_artifacts(redis_store, open_store(str(tmp_path / "export")))
        assert sorted(out.copied["policy"]) == sorted(t.id for t in tables) and not out.refused
        again = copy_artifacts(redis_store, open_store(str(tmp_path / "export")))
        assert again.copied["policy"] == [] and len(again.skipped["policy"]) == 2

        directory = open_store(str(tmp_path / "export"))
        directory.put("policy", b'{"not": "a policy"}', "policy-0000")
        target = RedisStore(SHARED_REDIS_URL, prefix=f"test-cli-{uuid.uuid4().hex[:8]}")
        try:
            result = copy_artifacts(directory, target)
            assert sorted(target.list("policy")) == sorted(t.id for t in tables)
            assert list(result.refused) == ["policy/policy-0000"]
        finally:
            target.delete_everything()
    finally:
        redis_store.delete_everything()


def test_cli_help_lists_serve_and_policies(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    out = capsys.readouterr().out
    assert "serve" in out and "policies" in out


def test_a_bad_setting_is_named_without_echoing_any_secret(monkeypatch, capsys):
    """pydantic's message repeats every input, keys included; the serve command must not print them."""
    from service.commands.serve import run

    admin_key, api_key = "S3cretAdmin!xyz", "apikey-secret-1"  # admin key too short: start-up refused
    monkeypatch.setenv("DLLM_ADMIN_KEY", admin_key)
    monkeypatch.setenv("DLLM_API_KEYS", api_key)
    assert run(build_parser().parse_args(["serve", "--port", "18433"])) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("error: bad setting: --admin-key / DLLM_ADMIN_KEY: must have at least 16 characters (or be "
                           "empty to close admin)")
    for secret in (admin_key, api_key):
        for cut in range(len(secret) - 4):  # no 5-character piece of a key either
            assert secret[cut:cut + 5] not in err


@pytest.mark.parametrize("variable, line", [
    ("DLLM_ADMIN_KEY", ("error: bad setting: --admin-key / DLLM_ADMIN_KEY: is the example's placeholder: make your "
                       "own (openssl rand -hex 32), or leave it empty to close admin")),
    ("DLLM_API_KEYS", ("error: bad setting: --api-keys / DLLM_API_KEYS: holds the example's placeholder: make your "
                      "own keys (openssl rand -hex 32)")),
])
def test_a_placeholder_key_of_the_examples_is_one_line_at_start_up(monkeypatch, capsys, variable, line):
    """A copied .env.example (or the Kubernetes secret as shipped) would be an open admin or API endpoint: each of
    its placeholder keys stops the server with one line, before the port is bound."""
    from service.commands.serve import run
    from tests.deploy.test_compose import _env_example

    monkeypatch.setenv(variable, _env_example()[variable])
    assert run(build_parser().parse_args(["serve", "--port", "18434"])) == 2
    assert capsys.readouterr().err.splitlines() == [line]


def test_a_structured_flag_that_is_not_json_names_the_setting(capsys):
    from service.commands.serve import run

    assert run(build_parser().parse_args(["serve", "--kv-quant", "notjson"])) == 2
    assert "--kv-quant / DLLM_KV_QUANT: not valid JSON" in capsys.readouterr().err


@pytest.mark.parametrize("source", ["flag", "environment"])
def test_a_method_name_where_kv_quant_wants_json_is_one_line_with_an_example(monkeypatch, capsys, source):
    """``generate --kv-quant kivi`` takes a method name; ``serve`` takes a KVQuantConfig as JSON. The name given to
    serve, by the flag or by DLLM_KV_QUANT (which pydantic-settings parses: its message named neither the
    variable nor the reason), is one line naming both and showing the JSON form."""
    from service.commands.serve import run

    args = ["serve", "--port", "18435"]
    if source == "flag":
        args += ["--kv-quant", "kivi"]
    else:
        monkeypatch.setenv("DLLM_KV_QUANT", "kivi")
    assert run(build_parser().parse_args(args)) == 2
    assert capsys.readouterr().err.splitlines() == [(
        "error: bad setting: --kv-quant / DLLM_KV_QUANT: not valid JSON (Expecting value at char 0); it is a JSON "
        "object, e.g. '{\"method\": \"kivi\", \"bits\": 4}'")]


def test_a_busy_port_is_one_line_before_the_model_loads(monkeypatch, capsys):
    """The port is bound before the model loads: a busy one is exit 3 with one line naming the flag and the address
    (it used to log that the server was ready, then fail to bind)."""
    import socket

    from service.commands.serve import STARTUP_FAILED, run

    monkeypatch.delenv("DLLM_ADMIN_KEY", raising=False)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert run(build_parser().parse_args(["serve", "--port", str(port), "--model", "/nonexistent"])) == STARTUP_FAILED
    err = capsys.readouterr().err
    assert err.splitlines() == [(f"error: --port / DLLM_PORT: cannot listen on 127.0.0.1:{port} (Address already in "
                                "use); stop what is using it or choose another --port")]


def test_a_budget_below_the_forward_reserve_ends_with_one_line_naming_both(monkeypatch, capsys, tmp_path):
    """Issue 36: ``--kv-budget-bytes 17000000`` with the default ``--max-batched-tokens`` (a ~172 MB forward
    reserve on the embedded model) is refused at start-up, exit 2 (a bad setting, as `serve --help` says; issue 45),
    its last line naming both flags (it used to start, stay not ready and blame every prompt)."""
    from service.commands.serve import BAD_SETTING, run
    from tests.support.processes import free_port

    monkeypatch.delenv("DLLM_ADMIN_KEY", raising=False)
    args = ["serve", "--port", str(free_port()), "--kv-budget-bytes", "17000000", "--store-url", str(tmp_path)]
    assert run(build_parser().parse_args(args)) == BAD_SETTING  # `serve --help`: 2 for a bad setting
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: --kv-budget-bytes / DLLM_KV_BUDGET_BYTES of 17,000,000 bytes") and \
        "--max-batched-tokens / DLLM_MAX_BATCHED_TOKENS 16,384" in last, last


def test_policies_with_a_store_that_does_not_answer_is_one_line_on_stderr(tmp_path, capsys):
    from tests.support.processes import free_port

    url = f"redis://127.0.0.1:{free_port()}/0"
    args = build_parser().parse_args(["policies", "export", str(tmp_path / "out"), "--store", url])
    assert args.func(args) == 1
    out = capsys.readouterr()
    assert out.out == "" and f": error: --store {url}" in out.err and len(out.err.splitlines()) == 1


def test_a_store_directory_that_does_not_exist_is_one_line_unless_asked_to_create(tmp_path, monkeypatch, capsys):
    """A typo in --store-url used to start a new, empty store and serve without the operator's artifacts: it is
    refused before the model loads, naming the directory; --create-store starts a new store there; the default
    store is created as before (the README's first command runs on a fresh clone)."""
    from service.commands.serve import missing_store_directory, run

    monkeypatch.delenv("DLLM_ADMIN_KEY", raising=False)
    monkeypatch.delenv("DLLM_STORE_URL", raising=False)
    monkeypatch.delenv("DLLM_CREATE_STORE", raising=False)
    missing = tmp_path / "no-such-store"
    assert run(build_parser().parse_args(["serve", "--port", "0", "--store-url", str(missing)])) == 2
    assert capsys.readouterr().err.splitlines() == [
        (f"error: --store-url / DLLM_STORE_URL: no store directory {missing}; name an existing store, or add "
        "--create-store (DLLM_CREATE_STORE=true) to start a new, empty one there")]
    assert not missing.exists()
    args = build_parser().parse_args(["serve", "--store-url", str(missing), "--create-store"])
    assert missing_store_directory(settings_from_args(args)) is None
    assert missing_store_directory(settings_from_args(build_parser().parse_args(["serve"]))) is None
    missing.mkdir()
    args = build_parser().parse_args(["serve", "--store-url", f"file://{missing}"])
    assert missing_store_directory(settings_from_args(args)) is None


def test_a_kv_quant_artifact_the_store_lacks_is_one_line_at_start_up(tmp_path, monkeypatch, capsys):
    """--kv-quant naming a policy id the store does not hold used to load the model and leave a server that never
    turned ready: it is one line naming the id and the store, before the model loads."""
    from service.commands.serve import resolve_kv_quant_artifact, run

    monkeypatch.delenv("DLLM_ADMIN_KEY", raising=False)
    store = open_store(str(tmp_path))
    table = policy_for(SPEC, cache_mode="dual", bits=2)
    absent = "0" * 40
    argv = ["serve", "--port", "0", "--store-url", str(tmp_path), "--kv-quant"]
    assert run(build_parser().parse_args([*argv, f'{{"method": "dllm_kvq", "bits": 2, "policy_id": "{absent}"}}'])) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: --kv-quant / DLLM_KV_QUANT: no policy with policy_id '{absent}' in the store "
                           f"{tmp_path}; ") and line.endswith(" policies list` shows what it holds")
    stored = store.put("policy", table.to_bytes(), table.id)
    for typed in (stored, stored[:8]):  # the id in full, or an unambiguous prefix of it, stored in full
        args = build_parser().parse_args([*argv, f'{{"method": "dllm_kvq", "bits": 2, "policy_id": "{typed}"}}'])
        settings, problem = resolve_kv_quant_artifact(settings_from_args(args))
        assert problem is None and settings.kv_quant.artifact_id == stored
    other = policy_for(SPEC, cache_mode="dual", bits=2, p=1)
    store.put("policy", other.to_bytes(), stored[:1] + "f" * 39 if stored[1] != "f" else stored[:1] + "e" * 39)
    args = build_parser().parse_args([*argv, f'{{"method": "dllm_kvq", "bits": 2, "policy_id": "{stored[:1]}"}}'])
    problem = resolve_kv_quant_artifact(settings_from_args(args))[1]
    assert problem.startswith(f"--kv-quant / DLLM_KV_QUANT: policy id '{stored[:1]}' is ambiguous: it starts 2 ids (")
    args = build_parser().parse_args([*argv, '{"method": "kvquant", "bits": 2, "kvquant_state_file": "nope.st"}'])
    assert resolve_kv_quant_artifact(settings_from_args(args))[1] == (
        "--kv-quant / DLLM_KV_QUANT: kvquant_state_file 'nope.st' is not a file")
