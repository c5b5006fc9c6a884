"""Every family declares how it serves every decoding setting (issue 42 item 2): a `DecodeSettings` field is
honoured or refused by name on each family, so a new field cannot be dropped in silence; every family's running
batch implements the one protocol the runtime drives (`service.engine.protocol.DecodeBatch`)."""

from __future__ import annotations

import inspect
from typing import Literal, get_args, get_origin

import pytest
import torch

from service.engine import Engine, EngineInputError
from service.engine.engine import validate_request
from service.engine.families import DECODERS, capabilities_of, settings_rules
from service.engine.loading import load_checkpoint
from service.engine.models import MODEL_CLASSES
from service.engine.params import DecodeParams, DecodeSettings, RowOptions
from service.engine.protocol import DecodeBatch, FamilyDecoder, SettingRefused, check_settings
from tests.support.fastdllm import CKPT
from tests.support.llada2 import LLADA2_CKPT
from tests.support.paths import REPO

#: A checkpoint of each family.
CHECKPOINTS = {**CKPT, **LLADA2_CKPT, "diffusion_gemma": REPO / "tests" / "data" / "diffusion_gemma" / "dgemma-tiny"}


def _values(name: str) -> list:
    """Every value of a setting with a finite domain (Literal, bool), else None (bounded numbers: any is served
    or refused by the engine's bounds, not by the family)."""
    annotation = DecodeSettings.model_fields[name].annotation
    if annotation is bool:
        return [False, True]
    if get_origin(annotation) is Literal:
        return list(get_args(annotation))
    return []


@pytest.mark.parametrize("arch", list(MODEL_CLASSES))
def test_every_setting_is_declared_by_every_family(arch):
    rules = settings_rules(arch)
    assert set(rules) == set(DecodeSettings.model_fields), (arch, set(DecodeSettings.model_fields) ^ set(rules))
    for name, rule in rules.items():
        assert rule.how, (arch, name)
        default = DecodeSettings.model_fields[name].default
        assert not rule.refuses(default), f"{arch} refuses the built-in default of {name}"
        if rule.serves is not None:
            assert rule.why, (arch, name)


def test_a_setting_no_family_declares_is_refused_by_name():
    with pytest.raises(SettingRefused, match="not declared by the llada decoder") as refused:
        check_settings("llada", settings_rules("llada"), {"new_field": 1})
    assert refused.value.field == "new_field"


def _params(arch: str, **update) -> DecodeParams:
    return DecodeParams(**{"gen_length": 32, "block_length": 16, "cache_mode": "prefix", **update})


@pytest.mark.parametrize("arch", list(MODEL_CLASSES))
def test_every_refused_value_is_a_400_naming_its_field(arch):
    """Each finite-domain setting walked over all its values: served ones pass the engine's checks, refused ones
    raise `EngineInputError` whose field is the setting."""
    spec = load_checkpoint(CHECKPOINTS[arch]).spec
    rules = settings_rules(arch)
    refused = 0
    for name in DecodeSettings.model_fields:
        for value in _values(name):
            params = _params(arch, **{name: value})
            if rules[name].refuses(value):
                refused += 1
                with pytest.raises(EngineInputError) as caught:
                    validate_request(spec, [[1, 2, 3]], params, [RowOptions()])
                assert caught.value.field == name, (arch, name, value, str(caught.value))
            else:
                validate_request(spec, [[1, 2, 3]], params, [RowOptions()])
    assert refused  # every family refuses something (block on LLaDA/Dream, ignore_eos on LLaDA2 ...)


def test_ignore_eos_on_llada2_is_refused_not_dropped():
    loaded = load_checkpoint(LLADA2_CKPT["llada2"])
    engine = Engine(loaded.model, loaded.spec, None, torch.float32, torch.device("cpu"))
    with pytest.raises(EngineInputError, match="ignore_eos true is not served by llada2") as refused:
        engine.generate([[1, 2, 3]], _params("llada2", ignore_eos=True))
    assert refused.value.field == "ignore_eos"


def _protocol_members(protocol: type) -> set[str]:
    return {name for name in vars(protocol) if not name.startswith("_")} | set(
        getattr(protocol, "__annotations__", {}))


@pytest.mark.parametrize("arch", list(MODEL_CLASSES))
def test_every_family_batch_and_decoder_implement_the_protocol(arch):
    loaded = load_checkpoint(CHECKPOINTS[arch])
    engine = Engine(loaded.model, loaded.spec, None, torch.float32, torch.device("cpu"))
    batch, decoder = engine.batch(), engine.decoder
    for protocol, obj in ((DecodeBatch, batch), (FamilyDecoder, decoder)):
        missing = sorted(m for m in _protocol_members(protocol) if not hasattr(obj, m))
        assert not missing, (arch, protocol.__name__, missing)
        for name in _protocol_members(protocol):
            member = getattr(protocol, name, None)
            if inspect.isfunction(member):  # same parameters as the protocol names
                assert list(inspect.signature(getattr(obj, name)).parameters)[: len(
                    inspect.signature(member).parameters) - 1] == list(inspect.signature(member).parameters)[1:], (
                    arch, name)
    assert decoder.capabilities == capabilities_of(arch)
    assert type(loaded.model).decoder in DECODERS


def test_a_refused_cache_mode_names_only_the_served_families_that_take_it():
    """The cache-mode refusal on a bidirectional model names the families that take the mode as their
    declarations say (issue 45 review): ``block`` on the embedded model named DiffusionGemma, which declares it
    but is not served in this version. A family is named exactly when it is served and its ``cache_mode`` rule
    serves the mode."""
    from service.engine.engine import check_cache_mode

    spec = Engine.load(None).spec  # the embedded (LLaDA-layout) model
    with pytest.raises(EngineInputError) as refused:
        check_cache_mode(spec, "block")
    message = str(refused.value)
    assert refused.value.field == "cache_mode" and "llada2 (block-causal)" in message, message
    for arch in MODEL_CLASSES:
        takes = capabilities_of(arch).served and not settings_rules(arch)["cache_mode"].refuses("block")
        assert (f"{arch} (" in message) == takes, (arch, message)
    if not capabilities_of("diffusion_gemma").served:
        assert "diffusion_gemma" not in message, message
