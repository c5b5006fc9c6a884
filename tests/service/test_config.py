"""Settings: environment parsing with the DLLM_ prefix and the refusal of unsafe values."""

import pytest
from pydantic import ValidationError

from service.config import Settings, key_id
from service.quant.config import KVQuantConfig
from service.store.base import InvalidName, open_store


def test_environment_is_read_with_prefix(monkeypatch):
    monkeypatch.setenv("DLLM_MAX_BATCH_SIZE", "3")
    monkeypatch.setenv("DLLM_API_KEYS", "k1, k2")
    monkeypatch.setenv("DLLM_KV_QUANT", '{"method": "kivi", "bits": 2}')
    monkeypatch.setenv("DLLM_MODEL", "")
    s = Settings()
    assert s.max_batch_size == 3
    assert [k.get_secret_value() for k in s.api_keys] == ["k1", "k2"]
    assert s.kv_quant == KVQuantConfig(method="kivi", bits=2)
    assert s.model is None


def test_an_environment_still_naming_the_removed_scheduler_settings_starts(monkeypatch):
    # DLLM_SCHEDULER and DLLM_BATCH_WAIT_MS chose and tuned the legacy batch worker (gone, issue 21): an env file
    # copied from an older .env.example must not stop the server (docs/settings.md, "Removed settings").
    monkeypatch.setenv("DLLM_SCHEDULER", "batch")
    monkeypatch.setenv("DLLM_BATCH_WAIT_MS", "5")
    s = Settings(max_batch_size=4)
    assert s.max_batch_size == 4 and "scheduler" not in Settings.model_fields and not hasattr(s, "batch_wait_ms")


def test_arguments_override_environment(monkeypatch):
    monkeypatch.setenv("DLLM_PORT", "9000")
    assert Settings(port=9100).port == 9100


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"admin_key": "short"}, "admin_key"),
        ({"admin_key": "replace-with-a-long-random-admin-key"}, "admin_key"),
        ({"api_keys": ["a-key-of-my-own-0123", "replace-with-an-api-key"]}, "api_keys"),
        ({"host": "0.0.0.0"}, "api_keys"),
        ({"cache_mode": "triple"}, "cache_mode"),
        ({"shadow_rate": 1.5}, "shadow_rate"),
        ({"max_queue": 0}, "max_queue"),
        ({"unknown_setting": 1}, "unknown_setting"),
        ({"kv_quant": {"method": "kivi", "bits": 3}}, "bits"),
    ],
)
def test_unsafe_or_illegal_values_are_refused(kwargs, field):
    with pytest.raises(ValidationError, match=field):
        Settings(**kwargs)


def test_non_local_host_allowed_with_keys_or_explicit_opt_out():
    assert Settings(host="0.0.0.0", api_keys=["k"]).host == "0.0.0.0"
    assert Settings(host="0.0.0.0", allow_unauthenticated=True).allow_unauthenticated


def test_key_id_is_short_and_not_the_key():
    assert len(key_id("secret-admin-key-123")) == 12 and "secret" not in key_id("secret-admin-key-123")


@pytest.mark.parametrize("url", ["dir:///x", "redis:/127.0.0.1:6379/9", "http://127.0.0.1:6379", "file://s3://b",
                                 "", "file://"])
def test_a_store_url_of_unknown_scheme_is_refused_naming_the_setting(url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValidationError, match="store_url") as refused:
        Settings(store_url=url)
    if url:
        assert "unknown scheme" in str(refused.value) or url == "file://"
    with pytest.raises(InvalidName):
        open_store(url)
    assert list(tmp_path.iterdir()) == []  # no folder named like the URL


@pytest.mark.parametrize(("url", "backend"), [
    ("redis://127.0.0.1:6379/9", "RedisStore"), ("rediss://h:6380/0", "RedisStore"),
    ("unix:///run/redis.sock", "RedisStore"), ("file://{tmp}/a", "DirectoryStore"), ("{tmp}/b", "DirectoryStore"),
    ("relative/store", "DirectoryStore"),
])
def test_known_store_urls_are_accepted(url, backend, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    url = url.format(tmp=tmp_path)
    assert Settings(store_url=url).store_url == url
    assert type(open_store(url)).__name__ == backend
