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
