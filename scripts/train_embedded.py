"""Train the embedded default model: a small LLaDA on the digit-ledger task (``evaluation.embedded_task``).

Objective: LLaDA's SFT loss (LLaDA paper, Appendix B.1 / ML-GSAI/LLaDA ``GUIDELINES.md``): for each sequence
draw ``t ~ U(eps, 1)``, mask every response token with probability ``t`` (the prompt is never masked), and take
the cross-entropy on the masked positions weighted by ``1 / t``, summed over the sequence and divided by the
response length. The response is the answer tokens, ``<|eot_id|>``, then ``<|endoftext|>`` padding up to
``GEN_LENGTH``, exactly what the model must produce at decoding time.

The prompt is the chat-templated user message, tokenized as the engine tokenizes it
(``apply_chat_template(..., add_generation_prompt=True)``). Sequences in a batch share one prompt length (the
stream is bucketed by length), so no padding or attention mask is needed.

Curriculum: the operation mix moves from copy-heavy (the fixed-offset attention that every operation needs) to
sum-heavy (the running total, the one that needs several decoding steps per block) over ``--ramp-tokens``; the
prompt digits start zero-heavy and become uniform over ``--zero-ramp-tokens`` (see ``digit_weights``).

Run control: seeded (model init, data stream, masks); one torch thread by default; bf16 autocast on CPU;
a checkpoint every ``--ckpt-every`` tokens, named by tokens seen (``ckpt-000012345678.pt``), holding the model,
optimizer, data-stream and RNG states, so ``--resume`` continues the same run bit-for-bit in its data order.
A log line (JSON) per ``--log-every`` steps: loss, tokens seen, tokens/s; and per ``--val-every`` tokens the
validation exact match per operation, decoded with threshold 0.9, blocks of 32, no cache.

Usage::

    python scripts/train_embedded.py --run-dir runs/embedded --d-model 192 --n-layers 6 --n-heads 6 \
        --max-minutes 120                       # new run
    python scripts/train_embedded.py --run-dir runs/embedded --resume --max-minutes 60   # next sitting
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from evaluation.embedded_task import (
    BLOCK_LENGTH,
    GEN_LENGTH,
    OPS,
    generate,
    make_question,
    response_text,
    score,
)
from service.engine.models import LLaDAModel

TOKENIZER_DIR = ROOT / "service/assets/embedded"
THRESHOLD = 0.9
MASK_EPS = 1e-3


def llada_config(tok, d_model: int, n_layers: int, n_heads: int, mlp: int, rope_theta: float) -> dict:
    """A ``config.json`` dict with LLaDA-8B-Instruct's keys (SPEC 1.1) for the given dimensions and tokenizer."""
    vocab = len(tok)
    return {
        "activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0, "architectures": ["LLaDAModelLM"],
        "attention_dropout": 0.0, "attention_layer_norm": False, "attention_layer_norm_with_affine": True,
        "auto_map": {"AutoConfig": "configuration_llada.LLaDAConfig",
                     "AutoModel": "modeling_llada.LLaDAModelLM",
                     "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM"},
        "bias_for_layer_norm": False, "block_group_size": 1, "block_type": "llama", "d_model": d_model,
        "embedding_dropout": 0.0, "embedding_size": vocab, "eos_token_id": tok.eos_token_id,
        "flash_attention": False, "include_bias": False, "include_qkv_bias": False, "init_cutoff_factor": None,
        "init_device": "meta", "init_fn": "mitchell", "init_std": 0.02, "input_emb_norm": False,
        "layer_norm_type": "rms", "layer_norm_with_affine": True, "mask_token_id": tok.mask_token_id,
        "max_sequence_length": 4096, "mlp_hidden_size": mlp, "mlp_ratio": 4, "model_type": "llada",
        "multi_query_attention": None, "n_heads": n_heads, "n_kv_heads": n_heads, "n_layers": n_layers,
        "pad_token_id": tok.pad_token_id, "precision": "amp_bf16", "residual_dropout": 0.0,
        "rms_norm_eps": 1e-05, "rope": True, "rope_full_precision": True, "rope_theta": rope_theta,
        "scale_logits": False, "use_cache": False, "vocab_size": vocab, "weight_tying": False,
    }


def init_weights(model: LLaDAModel, n_layers: int, seed: int) -> None:
    """Normal(0, 0.02) for matrices, with output projections scaled by 1/sqrt(2 n_layers) (GPT-2 style); norms 1.

    Draws follow the checkpoint's tensor names in order, so the same seed gives the same weights.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.checkpoint_state_dict().items():  # tensors share storage with the parameters
        if p.dim() == 1:
            torch.nn.init.ones_(p)
            continue
        residual_out = ".blocks." in name and name.endswith(("attn_out.weight", "ff_out.weight"))
        std = 0.02 / math.sqrt(2 * n_layers) if residual_out else 0.02
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=gen) * std)


class Stream:
    """Seeded stream of tokenized training questions, bucketed into batches of equal prompt length.

    Each item is (prompt ids, response ids of ``GEN_LENGTH``). The state (RNG, partly filled buckets, counter)
    is saved in checkpoints so a resumed run sees the same data.
    """

    def __init__(self, tok, seed: int):
        self.tok = tok
        self.rng = random.Random(seed)
        self.buckets: dict[int, list] = defaultdict(list)
        self.count = 0
        self.eot = tok.convert_tokens_to_ids("<|eot_id|>")

    def encode(self, prompt: str, answer: str | None) -> tuple[list[int], list[int] | None]:
        """Prompt ids (chat template + generation prompt) and response ids (answer, eot, EOS padding)."""
        text = self.tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                            tokenize=False)
        p = self.tok.encode(text, add_special_tokens=False)
        if answer is None:
            return p, None
        r = self.tok.encode(response_text(answer), add_special_tokens=False) + [self.eot]
        assert len(r) <= GEN_LENGTH, "answer longer than GEN_LENGTH"
        return p, r + [self.tok.eos_token_id] * (GEN_LENGTH - len(r))

    def batch(self, size: int, op_weights: list[float],
              digit_weights: list[float] | None = None) -> tuple[torch.Tensor, int]:
        """The next batch: ids [size, prompt_len + GEN_LENGTH] (int64) and the prompt length."""
        while True:
            q = make_question(self.rng, f"train-{self.count}", op_weights, digit_weights)
            self.count += 1
            p, r = self.encode(q.prompt, q.answer)
            bucket = self.buckets[len(p)]
            bucket.append(p + r)
            if len(bucket) == size:
                del self.buckets[len(p)]
                return torch.tensor(bucket), len(p)

    def state(self) -> dict:
        return {"rng": self.rng.getstate(), "buckets": dict(self.buckets), "count": self.count}

    def load(self, state: dict) -> None:
        self.rng.setstate(state["rng"])
        self.buckets = defaultdict(list, state["buckets"])
        self.count = state["count"]


def op_weights(tokens: int, ramp_tokens: int, final_sum: float = 3.0) -> list[float]:
    """Curriculum over ``OPS`` = (copy, next, sum): from (2, 1, 1) at 0 tokens to (1, 1, final_sum) at
    ``ramp_tokens``."""
    f = min(1.0, tokens / max(ramp_tokens, 1))
    return [2 - f, 1.0, 1 + (final_sum - 1) * f]


def digit_weights(tokens: int, zero_start: float, ramp_tokens: int, ramp_from: int = 0) -> list[float] | None:
    """Curriculum over the prompt digits: P(0) falls linearly from ``zero_start`` at ``ramp_from`` tokens (and
    before) to uniform (0.1) at ``ramp_from + ramp_tokens``; the other nine digits share the rest equally. None once
    uniform.

    Why: in ``sum`` the answer digit is independent of the previous answer digit alone and of the prompt digit
    alone (addition mod 10 is uniform given either), so gradient descent has no first-order signal and stalls
    on a plateau (measured: no progress on ``sum`` in the first 4M tokens while copy/next were solved). With
    many zeros, ``a[j] = a[j-1]`` often, which teaches the model to read the previous answer digit first.
    """
    p0 = zero_start + (0.1 - zero_start) * min(1.0, max(0, tokens - ramp_from) / max(ramp_tokens, 1))
    if p0 <= 0.1 + 1e-9:
        return None
    return [p0] + [(1 - p0) / 9] * 9


def sft_loss(model, ids: torch.Tensor, prompt_len: int, mask_id: int, gen: torch.Generator) -> torch.Tensor:
    """LLaDA SFT loss on a batch ``ids`` [B, T] whose last ``T - prompt_len`` positions are the response."""
    B, T = ids.shape
    t = (1 - MASK_EPS) * torch.rand(B, 1, generator=gen) + MASK_EPS
    resp = torch.zeros(B, T, dtype=torch.bool)
    resp[:, prompt_len:] = True
    masked = (torch.rand(B, T, generator=gen) < t) & resp
    noisy = torch.where(masked, torch.full_like(ids, mask_id), ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(noisy, logits_range=(prompt_len, T))  # the LM head only where the loss is taken
    ce = F.cross_entropy(logits[masked[:, prompt_len:]].float(), ids[masked], reduction="none")
    weights = (1.0 / t).expand(B, T)[masked]
    return (ce * weights).sum() / (B * (T - prompt_len))


@torch.no_grad()
def decode_none(model, prompts: torch.Tensor, mask_id: int) -> tuple[torch.Tensor, list[float]]:
    """Threshold decoding without cache (SPEC 3.2 rule: reveal every masked position of the active block with
    confidence >= THRESHOLD, at least the most confident one). ``prompts`` [B, P] share one length.

    Returns the response ids [B, GEN_LENGTH] and the confidence of every revealed token.
    """
    B, P = prompts.shape
    x = torch.cat([prompts, torch.full((B, GEN_LENGTH), mask_id)], 1)
    confs: list[float] = []
    for start in range(P, P + GEN_LENGTH, BLOCK_LENGTH):
        while (x[:, start:start + BLOCK_LENGTH] == mask_id).any():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(x, logits_range=(start, start + BLOCK_LENGTH)).float()
            logits[..., mask_id] = -float("inf")
            prob = logits.softmax(-1)
            conf, pred = prob.max(-1)
            still = x[:, start:start + BLOCK_LENGTH] == mask_id
            conf = torch.where(still, conf, torch.full_like(conf, -1.0))
            reveal = conf >= THRESHOLD
            best = conf.argmax(-1)
            reveal[torch.arange(B), best] |= still[torch.arange(B), best]
            block = x[:, start:start + BLOCK_LENGTH]
            block[reveal] = pred[reveal]
            confs += conf[reveal].tolist()
    return x[:, P:], confs


def validate(model, stream: Stream, questions, mask_id: int) -> dict:
    """Exact match per op and overall on ``questions`` with ``decode_none``, plus the share of confident reveals."""
    model.eval()
    groups = defaultdict(list)
    for q in questions:
        groups[len(stream.encode(q.prompt, None)[0])].append(q)
    hits, totals, confs = defaultdict(int), defaultdict(int), []
    stop = {stream.eot, stream.tok.eos_token_id}
    for qs in groups.values():
        prompts = torch.tensor([stream.encode(q.prompt, None)[0] for q in qs])
        out, c = decode_none(model, prompts, mask_id)
        confs += c
        for q, row in zip(qs, out.tolist()):
            cut = next((i for i, v in enumerate(row) if v in stop), len(row))
            totals[q.op] += 1
            hits[q.op] += score(stream.tok.decode(row[:cut]), q.answer)
    model.train()
    res = {f"em_{op}": hits[op] / max(totals[op], 1) for op in OPS}
    res["em"] = sum(hits.values()) / max(sum(totals.values()), 1)
    res["confident_share"] = sum(c >= THRESHOLD for c in confs) / max(len(confs), 1)
    return res


def reorder_optimizer_state(opt_state: dict, saved_names: list[str], names: list[str]) -> dict:
    """An optimizer ``state_dict`` saved for parameters ``saved_names`` (in that order) re-indexed for ``names``.

    Raises:
        ValueError: the two name sets differ.
    """
    if sorted(saved_names) != sorted(names):
        raise ValueError(f"checkpoint parameters differ from the model's: {sorted(set(saved_names) ^ set(names))[:5]}")
    old_index = {name: i for i, name in enumerate(saved_names)}
    state = {i: opt_state["state"][old_index[n]] for i, n in enumerate(names) if old_index[n] in opt_state["state"]}
    return {"state": state, "param_groups": opt_state["param_groups"]}


def save_ckpt(run_dir: Path, state: dict, keep: int = 3) -> Path:
    """Write ``ckpt-{tokens:012d}.pt`` atomically and keep only the newest ``keep`` (plus ``best.pt``)."""
    path = run_dir / f"ckpt-{state['tokens']:012d}.pt"
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.rename(path)
    for old in sorted(run_dir.glob("ckpt-*.pt"))[:-keep]:
        old.unlink()
    return path


def main(argv: list[str] | None = None) -> None:
    """CLI entry: new run or ``--resume``; stops at ``--max-tokens`` or after ``--max-minutes`` of this sitting."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", type=Path, default=ROOT / "runs/embedded")
    ap.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --run-dir")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--n-layers", type=int, default=4)
    ap.add_argument("--n-heads", type=int, default=4)
    ap.add_argument("--mlp", type=int, default=0, help="MLP hidden size (0: 8/3 d_model rounded to 32)")
    ap.add_argument("--rope-theta", type=float, default=10000.0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup-steps", type=int, default=200)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--ramp-tokens", type=int, default=20_000_000)
    ap.add_argument("--zero-start", type=float, default=0.6, help="P(digit 0) at 0 tokens (curriculum)")
    ap.add_argument("--zero-ramp-tokens", type=int, default=16_000_000)
    ap.add_argument("--zero-ramp-from", type=int, default=0, help="tokens seen when P(0) starts to fall")
    ap.add_argument("--final-sum-weight", type=float, default=3.0, help="weight of sum (copy, next: 1) after the ramp")
    ap.add_argument("--max-tokens", type=int, default=500_000_000)
    ap.add_argument("--max-minutes", type=float, default=float("inf"))
    ap.add_argument("--ckpt-every", type=int, default=2_000_000)
    ap.add_argument("--val-every", type=int, default=4_000_000)
    ap.add_argument("--val-size", type=int, default=48)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    args.run_dir.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(TOKENIZER_DIR, trust_remote_code=False)
    stream = Stream(tok, args.seed)
    ckpts = sorted(args.run_dir.glob("ckpt-*.pt"))
    if args.resume and ckpts:
        state = torch.load(ckpts[-1], weights_only=False)
        config = state["config"]
    else:
        state = None
        mlp = args.mlp or 32 * round(8 * args.d_model / 3 / 32)
        config = llada_config(tok, args.d_model, args.n_layers, args.n_heads, mlp, args.rope_theta)
    model = LLaDAModel(LLaDAModel.config_from_hf(config))
    if state is not None:
        model.load_checkpoint_tensors(state["model"])  # replaces the parameters: build the optimizer after
    param_names = [name for name, _ in model.named_parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=args.weight_decay)
    gen = torch.Generator().manual_seed(args.seed + 1)
    tokens, step, elapsed, best = 0, 0, 0.0, -1.0
    if state is not None:
        opt.load_state_dict(reorder_optimizer_state(state["optimizer"], state["param_names"], param_names))
        for g in opt.param_groups:
            g["lr"] = args.lr
        stream.load(state["stream"])
        gen.set_state(state["mask_rng"])
        tokens, step, elapsed, best = state["tokens"], state["step"], state["elapsed_s"], state["best_em"]
    else:
        init_weights(model, config["n_layers"], args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    val_questions = list(generate("validation", args.val_size))
    log = (args.run_dir / "log.jsonl").open("a")
    print(json.dumps({"event": "start", "params": n_params, "tokens": tokens, "config": config,
                      "args": {k: str(v) for k, v in vars(args).items()}}), file=log, flush=True)

    def checkpoint(val: dict | None) -> None:
        nonlocal best
        st = {"model": model.checkpoint_state_dict(), "optimizer": opt.state_dict(), "param_names": param_names,
              "stream": stream.state(),
              "mask_rng": gen.get_state(), "tokens": tokens, "step": step, "elapsed_s": elapsed,
              "config": config, "seed": args.seed, "params": n_params, "val": val, "best_em": best}
        if val is not None and val["em"] > best:
            best = val["em"]
            st["best_em"] = best
            torch.save(st, args.run_dir / "best.pt")
        save_ckpt(args.run_dir, st)

    model.train()
    t_start = time.time()
    sitting_start, next_ckpt, next_val = time.time(), tokens + args.ckpt_every, tokens + args.val_every
    bar = tqdm(total=args.max_tokens, initial=tokens, unit="tok", unit_scale=True, mininterval=30)
    window_tokens, window_start, losses = 0, time.time(), []
    while tokens < args.max_tokens and (time.time() - sitting_start) / 60 < args.max_minutes:
        ids, plen = stream.batch(args.batch, op_weights(tokens, args.ramp_tokens, args.final_sum_weight),
                                 digit_weights(tokens, args.zero_start, args.zero_ramp_tokens, args.zero_ramp_from))
        lr = args.lr * min(1.0, (step + 1) / args.warmup_steps)
        for g in opt.param_groups:
            g["lr"] = lr
        loss = sft_loss(model, ids, plen, config["mask_token_id"], gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += ids.numel()
        window_tokens += ids.numel()
        losses.append(loss.item())
        bar.update(ids.numel())
        if step % args.log_every == 0:
            now = time.time()
            elapsed += now - t_start
            t_start = now
            print(json.dumps({"step": step, "tokens": tokens, "loss": sum(losses) / len(losses), "lr": lr,
                              "tok_per_s": window_tokens / (now - window_start), "elapsed_s": round(elapsed)}),
                  file=log, flush=True)
            window_tokens, window_start, losses = 0, now, []
        if tokens >= next_val or tokens >= next_ckpt:
            val = None
            if tokens >= next_val:
                t0 = time.time()
                val = validate(model, stream, val_questions, config["mask_token_id"])
                val.update(tokens=tokens, step=step, val_s=round(time.time() - t0, 1))
                print(json.dumps({"event": "val", **val}), file=log, flush=True)
                next_val += args.val_every
            elapsed += time.time() - t_start
            t_start = time.time()
            checkpoint(val)
            next_ckpt = tokens + args.ckpt_every
            window_start, window_tokens = time.time(), 0
    elapsed += time.time() - t_start
    checkpoint(None)
    bar.close()
    print(json.dumps({"event": "stop", "tokens": tokens, "elapsed_s": round(elapsed)}), file=log, flush=True)
    log.close()


if __name__ == "__main__":
    main()
