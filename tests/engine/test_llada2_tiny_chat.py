"""The shipped tiny LLaDA2 chat checkpoint (tests/data/llada2/llada2-tiny-chat) is what its script writes, and
it loads as a LLaDA2 model with a tokenizer and chat template."""

from __future__ import annotations

import importlib.util

from service.engine.loading import load_checkpoint
from tests.support.llada2 import LLADA2_CHAT
from tests.support.paths import REPO


def test_shipped_copy_is_what_the_script_writes(tmp_path):
    spec = importlib.util.spec_from_file_location("make_llada2_tiny_chat", REPO / "scripts" / "make_llada2_tiny_chat.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    fresh = script.write(tmp_path / "llada2-tiny-chat")
    names = sorted(p.name for p in LLADA2_CHAT.iterdir())
    assert names == sorted(p.name for p in fresh.iterdir())
    for name in names:
        assert (LLADA2_CHAT / name).read_bytes() == (fresh / name).read_bytes(), name


def test_it_loads_with_its_tokenizer_and_template():
    loaded = load_checkpoint(LLADA2_CHAT)
    assert loaded.spec.arch != "llada" and loaded.spec.mask_id == 500
    ids = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "w5 w6"}], add_generation_prompt=True)
    words = loaded.tokenizer.decode(ids).split()  # byte-level: any text reads back as written
    assert words[:6] == ["<|start_header_id|>", "user", "<|end_header_id|>", "w5", "w6", "<|eot_id|>"]
