"""Calibration on a block-causal model (LLaDA2): what the policy search and KVQuant's fit measure there.

On a block-causal model (`service.engine.block_causal`) attention is causal across blocks, so a committed
block's K/V are exact: they are the same whatever order its tokens were revealed in, and every later forward
reads them as written. There is no stale reuse, so TRACE's reveal trajectory (which state each reused entry was
written in, issue 6) does not apply, and what a K policy changes is the quantization error of the committed
blocks alone, as the active block's queries see it.

**Diagnostics** (:func:`diagnose_block_causal`). For each block of a sample (prompt then answer, blocks at
absolute positions as the model decodes them) that has committed text before it: the committed text
``[0, start)`` is exact (the prompt and the answer's earlier blocks), the active block ``[start, end)`` holds the
prompt's tail and the answer's block, its answer tokens masked and then revealed left to right over
``steps_per_block`` states (the reveal order changes only the active block's queries: there is no trajectory to
reconstruct). One block-causal forward per state gives every layer's queries and keys; a record is (sample,
block, state, layer) and compares the active block's attention over the committed keys quantized by the baseline
(KIVI's K) and by each candidate ``(score type, p)`` against the exact keys, with the metrics and sums of the
other families' diagnostics (`calibration.metrics`, `calibration.fit.DiagnosticSums`). The committed keys are
quantized once per block, as one prefix segment (K groups from column 0: the serving path's groups, counted from
each committing chunk's first column, are the same when the group size divides the block length), and
dLLM-KVQ's attention score is the probability the block's first state's queries put on each committed column
(the serving path scores each committing chunk with the queries of the forward that commits it). The records
are filed under cache mode ``prefix``: the policy it makes is ``prefix``'s, which cache mode ``block`` serves
(`service.engine.params.configured_cache_mode`).

**KVQuant** (:func:`pre_rope_trace`): the pre-RoPE K and V of every layer of one block-causal forward over the
whole sample (all of it exact, as committed blocks are).
"""

from __future__ import annotations

import torch

from calibration.diagnose import DiagnoseSettings
from calibration.fit import DiagnosticSums
from calibration.forward import PreRopeKV
from calibration.metrics import attention_scores, behaviour_metrics, improvements
from calibration.quantize import reused_key_variants
from service.engine.kv_store import Segments
from service.engine.models.llada2 import CommittedKV, LLaDA2Model
from service.engine.scores import attention_scores as block_attention
from service.engine.spec import ModelSpec

#: The cache mode block-causal records and policies are filed under (what cache mode ``block`` serves).
MODE = "prefix"


def capture(model: LLaDA2Model, ids: torch.Tensor, block_length: int,
            ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per layer ``(q, k, v, k_pre)`` of one block-causal forward of ``ids`` (int64 ``[T]``): post-RoPE queries
    ``[1, H, T, D]``, post-RoPE keys and values ``[1, H_kv, T, D]``, pre-RoPE keys ``[1, H_kv, T, D]`` (model
    dtype)."""
    c, t = model.config, ids.numel()
    weight = model.embed.weight
    cache = CommittedKV(c.num_layers, 1, c.num_kv_heads, t, c.head_dim, weight.dtype, weight.device)
    cache.columns = t
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    cache.on_write = lambda layer, q, k_pre, k_buf, v_buf, columns: seen.append((q, k_pre))  # no score bias
    with torch.inference_mode():
        model(ids[None].to(weight.device), positions=torch.arange(t, device=weight.device)[None],
              block_length=block_length, cache=cache, logits_range=(t - 1, t))
    return [(q, cache.k[layer], cache.v[layer], k_pre) for layer, (q, k_pre) in enumerate(seen)]


def diagnose_block_causal(model: LLaDA2Model, spec: ModelSpec, prompt_ids: list[int], answer_ids: list[int],
                          sample_id: str, settings: DiagnoseSettings, block_length: int,
                          steps_per_block: int) -> DiagnosticSums:
    """The diagnostic sums of one sample on a block-causal model (module doc), under cache mode ``prefix``.

    Raises:
        ValueError: ``steps_per_block`` below 1, or an empty answer.
    """
    if steps_per_block < 1 or not answer_ids:
        raise ValueError("block-causal diagnostics need an answer and at least one state per block")
    sums = DiagnosticSums(model_id=spec.model_id, model_fingerprint=spec.fingerprint, num_layers=spec.num_layers,
                          k_group_size=settings.k_group_size, top_k=settings.top_k, samples=[sample_id])
    text = torch.tensor(list(prompt_ids) + list(answer_ids))
    prompt_length, total = len(prompt_ids), text.numel()
    candidates = [(s, p) for p in settings.budgets for s in settings.score_types]
    for block in range(prompt_length // block_length, (total - 1) // block_length + 1):
        start, end = block * block_length, min((block + 1) * block_length, total)
        if start == 0:
            continue  # nothing committed before the first block
        answer = list(range(max(start, prompt_length), end))  # the block's answer positions
        segments = Segments((0,), start, end, end, MODE)
        lengths = [b - a for a, b in segments.row_segments(0)]
        reused = torch.arange(end, device=model.embed.weight.device) < start
        variants = None
        for state in range(steps_per_block):
            ids = text[:end].clone()
            ids[answer[len(answer) * state // steps_per_block:]] = spec.mask_id
            layers = capture(model, ids, block_length)
            if variants is None:  # the committed keys (exact, the same at every state), quantized once
                variants = {}
                for layer, (q, k, v, _) in enumerate(layers):
                    scores = block_attention(q[:, :, start:end], k, None)  # float32 [1, end]
                    for bits in settings.bits:
                        variants[(layer, bits)] = reused_key_variants(spec, layer, k, v, segments, bits,
                                                                      settings.k_group_size, scores, candidates)
            for layer, (q, k, _, _) in enumerate(layers):
                queries, keys = q[0, :, start:end], k[0]
                s_ref = attention_scores(queries, keys)
                for bits in settings.bits:
                    stacked = keys.expand(len(candidates) + 1, -1, -1, -1).clone()
                    stacked[:, :, :start] = variants[(layer, bits)].to(stacked.dtype)
                    metrics = behaviour_metrics(s_ref, attention_scores(queries, stacked), reused, settings.top_k)
                    baseline = {name: value[0] for name, value in metrics.items()}
                    deltas = {candidate: {name: float(v) for name, v in improvements(
                        {name: value[i + 1] for name, value in metrics.items()}, baseline).items()}
                        for i, candidate in enumerate(candidates)}
                    sums.add_record(MODE, bits, layer, deltas, lengths)
    return sums


def pre_rope_trace(model: LLaDA2Model, prompt_ids: list[int], answer_ids: list[int],
                   block_length: int) -> list[PreRopeKV]:
    """Every layer's pre-RoPE K and V ``[H_kv, T, D]`` (float32) of one block-causal forward over the sample."""
    text = torch.tensor(list(prompt_ids) + list(answer_ids))
    return [PreRopeKV(k_pre[0].float(), v[0].float()) for _, _, v, k_pre in capture(model, text, block_length)]
