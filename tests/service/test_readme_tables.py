"""The README's settings and metrics tables list every setting and every metric the code defines."""


from service.config import Settings
from service.engine.params import DecodeSettings
from service.telemetry import Telemetry
from tests.support.paths import REPO

README = (REPO / "README.md").read_text()


def test_every_setting_is_in_the_readme():
    # Decoding settings are declared once (DecodeSettings, with their help text); the table has one row for all
    # of them, so adding one does not touch the README.
    missing = [n for n in Settings.model_fields
               if n not in DecodeSettings.model_fields and f"`DLLM_{n.upper()}`" not in README]
    assert missing == []
    assert "every other field of `DecodeSettings` | `DLLM_<NAME>`" in README


def test_every_metric_is_in_the_readme():
    names = {m.name for m in Telemetry().registry.collect()}
    missing = [n for n in names if f"`{n}" not in README]
    assert names and missing == []
