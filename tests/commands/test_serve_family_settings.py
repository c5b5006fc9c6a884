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


def test_diffusion_gemma_is_served_and_the_renoising_settings_are_its_own(tmp_path):
    """DiffusionGemma is served in this version (its running batch: `service.engine.renoise.RenoisingBatch`): no
    start-up refusal of the model; a masked family's schedule on it, and its renoising settings on another family,
    are refused in one line naming the flag."""
    dgemma = str(CHECKPOINTS["diffusion_gemma"])
    assert check_model_settings(Settings(model=dgemma, store_url=str(tmp_path))) is None
    line = check_model_settings(Settings(model=dgemma, store_url=str(tmp_path), steps=32))
    assert line is not None and line.startswith("--steps / DLLM_STEPS: steps 32 is not served by diffusion_gemma"), \
        line
    assert check_model_settings(Settings(model=dgemma, store_url=str(tmp_path), max_denoising_steps=8,
                                         t_max=0.5, t_min=0.1)) is None
    line = check_model_settings(Settings(model=str(CHECKPOINTS["llada"]), store_url=str(tmp_path),
                                         max_denoising_steps=8))
    assert line is not None and line.startswith("--max-denoising-steps / DLLM_MAX_DENOISING_STEPS: "
                                                "max_denoising_steps 8 is not served by llada"), line


def test_diffusion_gemma_renoising_defaults_are_checked_against_the_checkpoint_at_start(tmp_path):
    """``--t-max 0.3`` under the reference's t_min 0.4 started "ready" and refused every request naming a field
    the client never sent: exit 2 in one line, as ``--steps 4`` is; so is a temperature float32 cannot hold, and a
    block length the operator set to another value than the checkpoint's canvas (16). The built-in block length
    (32, not set) starts."""
    dgemma = str(CHECKPOINTS["diffusion_gemma"])
    done = service_main("serve", "--model", dgemma, "--port", "0", "--t-max", "0.3",
                        "--store-url", str(tmp_path / "store"))
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --t-max / DLLM_T_MAX: t_max must be > t_min (0.4), got "
                                                   "0.3"), done.stderr
    line = check_model_settings(Settings(model=dgemma, store_url=str(tmp_path), t_max=1e308))
    assert line is not None and line.startswith("--t-max / DLLM_T_MAX: t_max must be at most 10000"), line
    line = check_model_settings(Settings(model=dgemma, store_url=str(tmp_path), block_length=64))
    assert line is not None and line.startswith("--block-length / DLLM_BLOCK_LENGTH: block_length 64 is not served "
                                                "by this model: its block is the checkpoint's canvas of 16"), line
    assert check_model_settings(Settings(model=dgemma, store_url=str(tmp_path), block_length=16)) is None
