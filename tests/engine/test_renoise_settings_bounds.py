"""`RenoiseParams` refuses what the float32 schedule and sampler cannot run, naming the field and the legal range:
temperatures float32 cannot hold (a review's ``t_max`` 1e308 was a 200 of sixteen id-0 tokens: NaN probabilities)
and a non-finite ``entropy_bound`` / ``confidence_threshold`` (a ``generation_config.json`` may hold ``Infinity``)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from service.engine.errors import EngineInputError
from service.engine.renoise import temperature
from service.engine.renoise_settings import T_FLOOR, T_MAX_CEILING, RenoiseParams


@pytest.mark.parametrize(("given", "field", "says"), [
    ({"t_max": 1e308}, "t_max", "at most 10000"), ({"t_max": math.inf}, "t_max", "at most 10000"),
    ({"t_min": 1e308, "t_max": 1.7e308}, "t_max", "at most 10000"),
    ({"t_min": 1e-300, "t_max": 1e-299}, "t_min", "0 or at least 1e-06"),
    ({"t_min": 0.0, "t_max": 1e-5}, "t_max", "smallest temperature"),
    ({"entropy_bound": math.inf}, "entropy_bound", "finite"), ({"entropy_bound": math.nan}, "entropy_bound", "finite"),
    ({"confidence_threshold": math.inf}, "confidence_threshold", "finite"),
])
def test_values_float32_cannot_run_are_refused_naming_the_field(given, field, says):
    with pytest.raises(EngineInputError) as caught:
        RenoiseParams(**given)
    assert caught.value.field == field and says in str(caught.value)


def test_a_checkpoints_infinite_entropy_bound_is_refused(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"sampler_config": {"entropy_bound": math.inf}}))
    with pytest.raises(EngineInputError) as caught:
        RenoiseParams.for_checkpoint(tmp_path)
    assert caught.value.field == "entropy_bound"


@pytest.mark.parametrize(("t_min", "t_max", "steps"), [(0.0, T_MAX_CEILING, 1), (T_FLOOR, 2 * T_FLOOR, 48),
                                                       (0.0, T_FLOOR * 48, 48)])
def test_the_legal_ends_keep_every_scheduled_temperature_and_division_finite(t_min, t_max, steps):
    """At the bounds, every step's float32 temperature is positive and finite, and soft-capped logits (|x| <= 30)
    divided by it stay finite: the probabilities are numbers."""
    params = RenoiseParams(t_min=t_min, t_max=t_max, max_denoising_steps=steps)
    logits = torch.tensor([-30.0, 0.0, 30.0])
    for step in range(steps, 0, -1):
        t = temperature(step, params)
        assert t.dtype == torch.float32 and 0 < t.item() < math.inf
        assert torch.isfinite(torch.softmax(logits / t, dim=-1)).all()
