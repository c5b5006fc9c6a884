"""The embedded model's training script: the SFT objective, resumable runs, optimizer-state reordering."""

import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from service.engine.models import LLaDAModel
from service.engine.prompts import token_ids  # a list in transformers 4, a mapping in 5
from tests.support.paths import REPO

SCRIPT = REPO / "scripts/train_embedded.py"
TINY = ["--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--batch", "4", "--ckpt-every", "10000000",
        "--val-every", "10000000", "--log-every", "1", "--warmup-steps", "2"]


def load_script():
    spec = importlib.util.spec_from_file_location("train_embedded", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def train():
    return load_script()


def tiny_model(train):
    tok = AutoTokenizer.from_pretrained(train.TOKENIZER_DIR)
    config = train.llada_config(tok, 32, 1, 2, 64, 10000.0)
    model = LLaDAModel(LLaDAModel.config_from_hf(config))
    train.init_weights(model, 1, seed=0)
    return tok, config, model


class Recorder(torch.nn.Module):
    """Wraps the model and keeps the noisy input and the logits of the last call."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, **kwargs):
        self.ids = ids.clone()
        self.logits = self.model(ids, **kwargs)
        return self.logits


def test_sft_loss_masks_only_the_response_and_weights_by_one_over_t(train):
    tok, config, model = tiny_model(train)
    stream = train.Stream(tok, seed=3)
    ids, plen = stream.batch(4, [1.0, 1.0, 1.0])
    mask_id = config["mask_token_id"]
    rec = Recorder(model)
    gen = torch.Generator().manual_seed(5)
    loss = train.sft_loss(rec, ids, plen, mask_id, gen)
    assert torch.equal(rec.ids[:, :plen], ids[:, :plen])  # the prompt is never masked
    masked = rec.ids == mask_id
    assert masked[:, plen:].any() and not masked[:, :plen].any()
    assert torch.equal(rec.ids[~masked], ids[~masked])
    # the same draws by hand: t per row, then the loss on masked positions weighted by 1/t over the response length
    gen = torch.Generator().manual_seed(5)
    t = (1 - train.MASK_EPS) * torch.rand(4, 1, generator=gen) + train.MASK_EPS
    expected = 0.0
    for b in range(4):
        cols = masked[b, plen:].nonzero()[:, 0]
        ce = F.cross_entropy(rec.logits[b, cols].float(), ids[b, plen + cols], reduction="sum")
        expected += ce.item() / t[b, 0].item()
    assert math.isclose(loss.item(), expected / (4 * train.GEN_LENGTH), rel_tol=1e-5)


def test_response_is_answer_eot_then_eos_padding(train):
    tok, _, _ = tiny_model(train)
    stream = train.Stream(tok, seed=0)
    prompt, response = stream.encode("copy: 1 2", "1 2")
    assert len(response) == train.GEN_LENGTH
    assert tok.decode(response[:2]) == " 1 2"  # every digit the " d" token, as in the prompt
    assert response[2] == tok.convert_tokens_to_ids("<|eot_id|>")
    assert set(response[3:]) == {tok.eos_token_id}
    assert prompt == token_ids(tok.apply_chat_template([{"role": "user", "content": "copy: 1 2"}],
                                                       add_generation_prompt=True))


def test_reorder_optimizer_state(train):
    state = {"state": {0: {"step": 1}, 1: {"step": 2}}, "param_groups": [{"params": [0, 1]}]}
    out = train.reorder_optimizer_state(state, ["a", "b"], ["b", "a"])
    assert out["state"] == {0: {"step": 2}, 1: {"step": 1}}
    with pytest.raises(ValueError, match="differ"):
        train.reorder_optimizer_state(state, ["a", "b"], ["a", "c"])


def test_resumed_run_equals_straight_run(train, tmp_path):
    """Two sittings (stop, --resume) give bit-identical weights to one sitting over the same tokens."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    train.main(TINY + ["--run-dir", str(straight), "--max-tokens", "3000"])
    train.main(TINY + ["--run-dir", str(split), "--max-tokens", "1500"])
    train.main(TINY + ["--run-dir", str(split), "--max-tokens", "3000", "--resume"])
    a = torch.load(max(straight.glob("ckpt-*.pt")), weights_only=False)
    b = torch.load(max(split.glob("ckpt-*.pt")), weights_only=False)
    assert a["tokens"] == b["tokens"] >= 3000
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name


def test_digit_curriculum_ends_uniform(train):
    assert train.digit_weights(0, 0.6, 100) == pytest.approx([0.6] + [0.4 / 9] * 9)
    assert train.digit_weights(50, 0.6, 100)[0] == pytest.approx(0.35)
    assert train.digit_weights(100, 0.6, 100) is None
    assert train.digit_weights(150, 0.9, 100, ramp_from=100)[0] == pytest.approx(0.5)
    assert train.digit_weights(50, 0.9, 100, ramp_from=100)[0] == pytest.approx(0.9)
    assert train.op_weights(0, 10) == [2, 1, 1] and train.op_weights(10, 10) == [1, 1, 3]
    assert train.op_weights(10, 10, final_sum=6) == [1, 1, 6]
