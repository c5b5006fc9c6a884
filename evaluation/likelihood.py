"""Log-likelihood of a continuation under a masked diffusion model: the LLaDA authors' Monte-Carlo estimate.

A diffusion LM has no left-to-right factorisation, so ``log p(continuation | context)`` is estimated by the
model's ELBO (LLaDA paper, Eq. 6; ``ML-GSAI/LLaDA`` ``eval_llada.py``, ``get_loglikelihood``). Each Monte-Carlo
sample draws a mask count ``l`` in ``1..L`` (``L`` = continuation tokens), masks ``l`` continuation positions
uniformly at random (the context is never masked), runs one full forward pass and adds the cross-entropy of
the masked positions weighted by ``L / l``. The estimate is minus the mean over ``mc_num`` samples. As in the
reference, the ``l`` of the samples in one forward batch are stratified: ``l_j = ((k + j * L / b) - 1) mod L + 1``
for a random start ``k`` (lower variance than independent draws).

Departures from the reference, on purpose:
- Randomness comes from a ``torch.Generator`` seeded by ``seed`` and the request's tokens, so a request's
  estimate does not depend on which other requests are scored with it, on the batch size or on the order.
- ``is_greedy`` (``greedy_check``) reveals the masked continuation one most-confident token per forward pass, as
  the reference's ``suffix_greedy_prediction``; it costs ``L`` forward passes and is off by default, as the
  reference recommends.
- A single forward pass has no reused K/V, so cache mode and KV quantization do not apply to likelihoods.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
import torch.nn.functional as F

#: ``logits_fn(ids)``: ids ``[B, T]`` int64 -> logits ``[B, T, V]`` float where ``logits[:, i]`` scores the token
#: at position ``i`` (the engine aligns Dream's shifted logits).
LogitsFn = Callable[[torch.Tensor], torch.Tensor]


def request_generator(seed: int, context: list[int], continuation: list[int]) -> torch.Generator:
    """A CPU generator seeded by ``seed`` and the request's tokens (order- and batch-independent)."""
    digest = hashlib.sha256(repr((seed, list(context), list(continuation))).encode()).digest()
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return gen


def _masked_batch(seq: torch.Tensor, prompt_len: int, mask_id: int, gen: torch.Generator
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """One stratified noising of ``b`` copies of ``seq`` ``[b, T]``: (noisy ``[b, T]``, mask ratio ``[b]``)."""
    b, total = seq.shape
    target_len = total - prompt_len
    k = int(torch.randint(1, target_len + 1, (), generator=gen))
    counts = torch.round(torch.linspace(float(k), k + (b - 1) * (target_len / b), steps=b)).long()
    counts = ((counts - 1) % target_len) + 1                                   # [b], each in 1..L
    is_mask = torch.zeros(b, total, dtype=torch.bool)
    for i in range(b):
        chosen = torch.randperm(target_len, generator=gen)[: int(counts[i])]
        is_mask[i, prompt_len + chosen] = True
    noisy = torch.where(is_mask, torch.full_like(seq, mask_id), seq)
    return noisy, counts.to(torch.float64) / target_len


@torch.no_grad()
def mc_loglikelihood(logits_fn: LogitsFn, context: list[int], continuation: list[int], *, mask_id: int,
                     mc_num: int = 128, mc_batch_size: int = 32, seed: int = 1234,
                     device: torch.device | str = "cpu") -> float:
    """Monte-Carlo ELBO estimate of ``log p(continuation | context)`` in nats (module docstring).

    Args:
        logits_fn: full forward without cache (see `LogitsFn`).
        context, continuation: token ids; ``continuation`` must be non-empty.
        mask_id: the model's ``<mask>`` id.
        mc_num: Monte-Carlo samples (the reference's default 128); must be a multiple of ``mc_batch_size``.
        mc_batch_size: samples per forward pass.
        seed: base seed (see `request_generator`).

    Raises:
        ValueError: empty continuation, or ``mc_num`` not a positive multiple of ``mc_batch_size``.
    """
    if not continuation:
        raise ValueError("continuation must contain at least one token")
    if mc_batch_size < 1 or mc_num < 1 or mc_num % mc_batch_size:
        raise ValueError(f"mc_num ({mc_num}) must be a positive multiple of mc_batch_size ({mc_batch_size})")
    gen = request_generator(seed, context, continuation)
    seq = torch.tensor([list(context) + list(continuation)], dtype=torch.long).repeat(mc_batch_size, 1)
    losses = []
    for _ in range(mc_num // mc_batch_size):
        noisy, ratio = _masked_batch(seq, len(context), mask_id, gen)
        masked = noisy == mask_id
        logits = logits_fn(noisy.to(device)).float().cpu()                       # [b, T, V]
        ce = F.cross_entropy(logits[masked], seq[masked], reduction="none").double()
        weights = ratio.unsqueeze(1).expand_as(masked)[masked]
        losses.append(float((ce / weights).sum()) / mc_batch_size)
    return -sum(losses) / len(losses)


@torch.no_grad()
def greedy_check(logits_fn: LogitsFn, context: list[int], continuation: list[int], *, mask_id: int,
                 device: torch.device | str = "cpu") -> bool:
    """Whether confidence-ordered greedy unmasking (one token per forward) reproduces ``continuation``."""
    seq = torch.tensor([list(context) + [mask_id] * len(continuation)], dtype=torch.long)
    for _ in range(len(continuation)):
        masked = seq[0] == mask_id
        logits = logits_fn(seq.to(device)).float().cpu()[0, masked]               # [m, V]
        probs = torch.softmax(logits, dim=-1)
        conf, tokens = probs.max(dim=-1)
        best = int(conf.argmax())
        positions = masked.nonzero().squeeze(1)
        seq[0, positions[best]] = tokens[best]
    return seq[0, len(context):].tolist() == list(continuation)
