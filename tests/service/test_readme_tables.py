"""The settings and metrics tables (docs/settings.md, docs/metrics.md) list every setting and every metric the code
defines."""


from service.config import Settings
from service.engine.params import DecodeSettings
from service.engine.prefix_cache import PrefixCache
from service.telemetry import Telemetry
from tests.support.paths import REPO

DOCS = REPO / "docs"
SETTINGS = (DOCS / "settings.md").read_text()
METRICS = (DOCS / "metrics.md").read_text()


def test_every_setting_is_in_the_settings_page():
    # Decoding settings are declared once (DecodeSettings, with their help text); the table has one row for all
    # of them, so adding one does not touch the page.
    missing = [n for n in Settings.model_fields
               if n not in DecodeSettings.model_fields and f"`DLLM_{n.upper()}`" not in SETTINGS]
    assert missing == []
    assert "every other field of `DecodeSettings` | `DLLM_<NAME>`" in SETTINGS


def test_every_metric_is_in_the_metrics_page():
    telemetry = Telemetry()
    telemetry.watch_prefix_cache(PrefixCache(1))  # its series exist only on a server with a prefix cache
    names = {m.name for m in telemetry.registry.collect()}
    missing = [n for n in names if f"`{n}" not in METRICS]
    assert names and missing == []


def test_the_api_keys_row_lists_exactly_the_routes_the_key_protects():
    """The row said /v1 and /generate; /tokenize, /detokenize and /tokenizer_info need the key too."""
    from service.api.deps import require_api_key
    from service.main import ROUTERS, create_app

    row = next(line for line in SETTINGS.splitlines() if line.startswith("| `api_keys`"))
    protected, _, open_part = row.partition("never")
    keyed = {r.path for router in ROUTERS for r in router.routes
             if any(d.dependency is require_api_key for d in router.dependencies)}
    app = create_app(Settings())
    unkeyed = {r.path for r in app.routes if getattr(r, "path", None)} | {
        r.path for router in ROUTERS for r in router.routes} - keyed
    for path in keyed:  # /v1/... routes are covered by "everything under /v1" or named
        assert f"`{path}`" in protected or (path.startswith("/v1/") and "everything under /v1" in protected), path
    for path in unkeyed - {p for p in unkeyed if p.startswith(("/admin", "/docs/"))}:
        assert f"`{path}`" not in protected, path
        assert f"`{path}`" in open_part, path
