"""benchmarks/diffusion_gemma_prefix_split.py's finding, on which DiffusionGemma's prefix-cache refusal rests
(`Capabilities.prefix_cache`, docs/diffusion_gemma.md): a prompt whose first canvas is encoded in a pass of its own
holds other K/V, bit for bit, than the same prompt encoded in one pass. If a torch or kernel change makes them equal,
this fails, and the refusal is worth measuring again."""

from __future__ import annotations

import torch

from benchmarks.diffusion_gemma_prefix_split import DATA, encoded_cache, first_difference, split_cases
from service.engine.loading import load_checkpoint


def test_leading_tokens_encoded_apart_hold_other_kv():
    torch.set_num_threads(1)
    model = load_checkpoint(DATA / "dgemma-tiny").model.float().eval()
    with torch.inference_mode():
        equal, total = split_cases(model, [(37, 16), (48, 32)])
        assert (equal, total) == (0, 2)
        # the prefix positions themselves differ, from the first layer on
        assert first_difference(model, 37, 16).startswith("layer 0 ")
        # the same passes twice hold the same K/V bit for bit: the difference is the split, not noise
        ids = list(range(37))
        one, again = encoded_cache(model, [ids[:16], ids[16:]]), encoded_cache(model, [ids[:16], ids[16:]])
        assert all(torch.equal(one.k[layer][0], again.k[layer][0]) for layer in range(model.config.num_layers))
