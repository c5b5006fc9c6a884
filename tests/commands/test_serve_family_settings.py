"""``serve`` refuses at start a decoding setting the model's family does not serve (issue 45 item 3), read from
the family's declaration (`service.engine.families`): every serve setting of `DecodeSettings` walked against
every family, and the refusal as the other start-up refusals make it (exit status 2, one line naming the flag)."""

from __future__ import annotations

import json
from typing import Literal, get_args, get_origin

import pytest

from service.commands.serve import check_family_settings, check_model_settings
from service.config import Settings
from service.engine.families import settings_rules
from service.engine.models import MODEL_CLASSES
from service.engine.params import DecodeSettings
from tests.support.cli import service_main
from tests.support.fastdllm import CKPT
from tests.support.llada2 import LLADA2_CKPT
from tests.support.paths import REPO

CHECKPOINTS = {**CKPT, "llada2": LLADA2_CKPT["llada2"],
               "diffusion_gemma": REPO / "tests" / "data" / "diffusion_gemma" / "dgemma-tiny"}


def _values(name: str) -> list:
    annotation = DecodeSettings.model_fields[name].annotation
    if annotation is bool:
        return [False, True]
    if get_origin(annotation) is Literal:
        return list(get_args(annotation))
    return []  # a bounded number: served by every family (its bounds are the engine's, per request)


def test_every_family_has_a_checkpoint_here():
    assert set(CHECKPOINTS) == set(MODEL_CLASSES)


@pytest.mark.parametrize("arch", sorted(CHECKPOINTS))
def test_every_decoding_setting_is_walked_against_the_family(arch, tmp_path):
    rules = settings_rules(arch)
    walked = refused = 0
    for name in DecodeSettings.model_fields:
        for value in _values(name):
            settings = Settings(model=str(CHECKPOINTS[arch]), store_url=str(tmp_path), **{name: value})
            line = check_family_settings(settings)
            walked += 1
            if rules[name].refuses(value):
                refused += 1
                flag = f"--{name.replace('_', '-')} / DLLM_{name.upper()}: {name} {json.dumps(value)} is not served by {arch}"
                assert line is not None and line.startswith(flag), (arch, name, value, line)
            else:
                assert line is None, (arch, name, value, line)
    assert walked and refused


def test_the_embedded_model_refuses_cache_mode_block(tmp_path):
    line = check_family_settings(Settings(store_url=str(tmp_path), cache_mode="block"))
    assert line is not None and line.startswith("--cache-mode / DLLM_CACHE_MODE: cache_mode \"block\" is not served")


def test_serve_exits_2_with_one_line_naming_the_flag(tmp_path):
    done = service_main("serve", "--model", str(CKPT["llada"]), "--port", "0", "--cache-mode", "block",
                        "--store-url", str(tmp_path / "store"))
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --cache-mode / DLLM_CACHE_MODE: cache_mode \"block\" is "
                                                   "not served by llada models"), done.stderr



def test_a_family_not_served_yet_is_refused_at_start_in_one_line(tmp_path):
    """DiffusionGemma decodes through ``generate`` only in this version: ``serve`` says so before the port is bound
    (it started, failed its readiness probe and answered 500s); the line is what ``serve`` prints after ``error:``
    with exit status 2, as for any other model setting it refuses."""
    line = check_model_settings(Settings(model=str(CHECKPOINTS["diffusion_gemma"]), store_url=str(tmp_path)))
    assert line is not None and line.startswith("--model / DLLM_MODEL: diffusion_gemma models are not served in "
                                                "this version"), line
    assert "generate --model DIR" in line
    assert check_model_settings(Settings(model=str(CHECKPOINTS["llada2"]), store_url=str(tmp_path))) is None
