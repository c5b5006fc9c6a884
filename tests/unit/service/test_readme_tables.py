"""The README's settings and metrics tables list every setting and every metric the code defines."""

from pathlib import Path

from service.config import Settings
from service.telemetry import Telemetry

README = (Path(__file__).resolve().parents[3] / "README.md").read_text()


def test_every_setting_is_in_the_readme():
    missing = [n for n in Settings.model_fields if f"`DLLM_{n.upper()}`" not in README]
    assert missing == []


def test_every_metric_is_in_the_readme():
    names = {m.name for m in Telemetry().registry.collect()}
    missing = [n for n in names if f"`{n}" not in README]
    assert names and missing == []
