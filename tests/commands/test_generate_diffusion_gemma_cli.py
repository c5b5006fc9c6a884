"""``dllm-kvq generate`` on DiffusionGemma checkpoints with exactly the issue's flags, against the live reference
(``torch.manual_seed(S)`` then transformers' ``generate`` at batch 1).

One run starts the real console command; the others call the same ``main`` in this process (`tests.support.cli`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.support.cli import service_main
from tests.support.paths import REPO

DATA = REPO / "tests" / "data" / "diffusion_gemma"
CONSOLE = REPO / ".venv" / "bin" / "dllm-kvq"

#: (checkpoint, prompt ids, gen length, seed, {flag: value} of the renoising flags given; the others default)
RUNS = [
    ("dgemma-tiny", [498, 5, 6, 7], 20, 3, {"max-denoising-steps": 4, "entropy-bound": 0.5, "t-max": 0.9,
                                            "t-min": 0.3, "stability-threshold": 1, "confidence-threshold": 0.01}),
    ("dgemma-tiny-w8", list(range(40, 61)), 24, 11, {"max-denoising-steps": 3, "entropy-bound": 2.0, "t-max": 0.1,
                                                     "t-min": 0.01, "stability-threshold": 0,
                                                     "confidence-threshold": 3.0}),
    ("dgemma-tiny-settling", [498, 9, 9, 9, 9, 9, 9, 9], 24, 6, {"max-denoising-steps": 12, "entropy-bound": 0.1,
                                                                  "t-max": 0.1, "t-min": 0.01,
                                                                  "stability-threshold": 1,
                                                                  "confidence-threshold": 3.0}),
    ("dgemma-tiny-w8", [498, 10, 20], 64, 19, {"max-denoising-steps": 2}),  # an EOS, pad after it
    ("dgemma-tiny-w8", [7, 8], 8, 5, {}),  # every renoising flag left out: the reference's defaults (48 steps ...)
]


def argv(checkpoint: Path, prompt: list[int], gen: int, seed: int, given: dict) -> list[str]:
    flags = [f"--{name}={value}" for name, value in given.items()]
    return ["generate", "--model", str(checkpoint), "--prompt-ids", ",".join(map(str, prompt)), "--gen-length",
            str(gen), "--seed", str(seed), *flags, "--dtype", "float32", "--device", "cpu", "--json"]


def reference(checkpoint: Path, prompt: list[int], gen: int, seed: int, given: dict) -> tuple[list[int], int]:
    """The reference's new tokens and decoder passes."""
    from transformers import DiffusionGemmaForBlockDiffusion
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

    model = DiffusionGemmaForBlockDiffusion.from_pretrained(checkpoint).eval()
    kwargs = {name.replace("-", "_"): value for name, value in given.items() if name != "entropy-bound"}
    if "entropy-bound" in given:
        kwargs["sampler_config"] = EntropyBoundSamplerConfig(entropy_bound=given["entropy-bound"])
    calls = []
    forward = model.forward
    model.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
    torch.manual_seed(seed)
    out = model.generate(torch.tensor([prompt]), max_new_tokens=gen, **kwargs)
    return out.sequences[0, len(prompt):].tolist(), len(calls)


@pytest.mark.parametrize("index", range(len(RUNS)))
def test_cli_is_the_reference(index):
    name, prompt, gen, seed, given = RUNS[index]
    done = service_main(*argv(DATA / name, prompt, gen, seed, given))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    ids, passes = reference(DATA / name, prompt, gen, seed, given)
    assert report["generated_ids"] == ids and report["nfe"] == passes
    if index == 3:
        assert report["finish_reason"] == "stop" and report["generated_ids_to_eos"][-1] == 497
        assert len(report["generated_ids_to_eos"]) < len(ids)
    if index == 4:
        assert report["params"]["max_denoising_steps"] == 48 and report["params"]["confidence_threshold"] == 0.005


@pytest.mark.integration
def test_the_console_command_is_the_reference():
    name, prompt, gen, seed, given = RUNS[1]
    out = subprocess.run([str(CONSOLE), *argv(DATA / name, prompt, gen, seed, given), "--threads", "1"], check=False,
                         cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert (report["generated_ids"], report["nfe"]) == reference(DATA / name, prompt, gen, seed, given)


def test_a_checkpoint_saved_without_eos_ids_runs_every_canvas(tmp_path):
    """``save_pretrained`` of a fresh model writes a ``generation_config.json`` without EOS or pad ids: the reference
    then stops at no EOS and pads nothing, and so does the command."""
    checkpoint = tmp_path / "saved"
    shutil.copytree(DATA / "dgemma-tiny-w8", checkpoint)
    (checkpoint / "generation_config.json").write_text(json.dumps({"max_denoising_steps": 2, "t_max": 0.5,
                                                                   "t_min": 0.2}))
    prompt, gen, seed = [498, 10, 20], 64, 19
    done = service_main(*argv(checkpoint, prompt, gen, seed, {}))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["generated_ids"], report["nfe"]) == reference(checkpoint, prompt, gen, seed, {})
    assert len(report["generated_ids"]) == gen and report["params"]["max_denoising_steps"] == 2  # the checkpoint's


def test_the_other_families_flags_are_refused_in_one_line():
    done = service_main(*argv(DATA / "dgemma-tiny-w8", [1, 2], 8, 0, {}), "--steps", "4")
    assert done.returncode == 2 and "--steps is not a setting of a renoising model" in done.stderr
    done = service_main(*argv(DATA / "dgemma-tiny-w8", [1, 2], 8, 0, {"t-max": 0.3, "t-min": 0.4}))
    assert done.returncode == 2 and "--t-max must be > t_min" in done.stderr


def test_a_zero_gen_length_is_refused_naming_its_flag():
    """The reference calls it max_new_tokens; the user typed --gen-length, so the refusal names that."""
    done = service_main(*argv(DATA / "dgemma-tiny-w8", [1, 2], 0, 0, {}))
    assert done.returncode == 2 and "--gen-length must be a positive integer" in done.stderr, done.stderr
    assert "max_new_tokens" not in done.stderr


def test_kv_quant_holds_the_committed_kv_packed_and_reports_its_bits(tmp_path):
    """``--kv-quant`` as the other families take it: the JSON's ``kv`` is the store's report (KIVI 2-bit: 2 nominal
    bits), ``kv_bytes`` per layer kind fall under the unquantized run's, and a dLLM-KVQ policy ranking by attention
    is refused in one line that says why (`service.quant.canvas`)."""
    from service.engine.loading import load_checkpoint
    from tests.support.artifacts import policy_for

    name, prompt, gen, seed, given = RUNS[0]
    runs = {}
    for kv in ((), ("--kv-quant", "kivi", "--kv-bits", "2", "--kv-group-size", "8")):
        done = service_main(*argv(DATA / name, [498, *range(1, 12)], 48, seed, given), *kv)
        assert done.returncode == 0, done.stderr
        runs[bool(kv)] = json.loads(done.stdout)
    plain, quant = runs[False], runs[True]
    assert plain["kv"] is None and quant["kv"]["config"]["method"] == "kivi"
    assert quant["kv"]["k_nominal_bits"] == quant["kv"]["v_nominal_bits"] == 2.0
    assert 0 < quant["kv"]["bytes_held"] < quant["kv"]["bf16_bytes"]
    for kind, held in quant["kv_bytes"].items():
        assert 0 < held < plain["kv_bytes"][kind] / 2
    policy = policy_for(load_checkpoint(DATA / name).spec, bits=4, p=1, score_type="attention", k_group_size=8)
    path = tmp_path / "policy.json"
    path.write_text(policy.to_json())
    done = service_main(*argv(DATA / name, prompt, gen, seed, given), "--kv-quant", "dllm_kvq", "--kv-group-size",
                        "8", "--policy", str(path))
    assert done.returncode == 2 and "DiffusionGemma writes its committed K/V in the encoder pass" in done.stderr


def test_cache_mode_and_the_masked_families_settings_are_refused_not_ignored():
    """``--cache-mode`` (and any masked-family decoding flag) was silently ignored on a renoising model: refused by
    name, with what the family always does."""
    done = service_main(*argv(DATA / "dgemma-tiny-w8", [1, 2], 8, 0, {}), "--cache-mode", "none")
    assert done.returncode == 2 and "--cache-mode is not a setting of a renoising model" in done.stderr
    assert "committed canvases' cache" in done.stderr
    done = service_main(*argv(DATA / "dgemma-tiny-w8", [1, 2], 8, 0, {}), "--remasking", "random")
    assert done.returncode == 2 and "--remasking is not a setting of a renoising model" in done.stderr
    done = service_main(*argv(DATA / "dgemma-tiny-w8", [1, 2], 8, 0, {"entropy-bound": "-1"}))
    assert done.returncode == 2 and "entropy_bound" in done.stderr
