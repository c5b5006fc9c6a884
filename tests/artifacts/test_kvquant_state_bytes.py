"""`KVQuantState.from_bytes` judges a file by its header before reading a tensor: a header that declares more
than the file holds, or tensors the metadata does not describe, is a ValueError (no allocation, no 500)."""

from __future__ import annotations

import json
import struct

import pytest

from service.artifacts.kvquant_state import KVQuantState
from service.engine.spec import ModelSpec
from tests.support.artifacts import kvquant_state_for

SPEC = ModelSpec(arch="llada", model_id="m", fingerprint="ab" * 32, num_layers=2, num_heads=2, num_kv_heads=2,
                 head_dim=8, vocab_size=64, mask_id=63, eos_ids=(1,), pad_id=0, max_length=128)


def _file(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


def _header(state: KVQuantState) -> tuple[dict, bytes]:
    raw = state.to_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n:]


def test_a_state_round_trips():
    state = kvquant_state_for(SPEC)
    assert KVQuantState.from_bytes(state.to_bytes()).id == state.id


def test_a_header_that_declares_more_than_the_file_holds_is_refused():
    header, data = _header(kvquant_state_for(SPEC))
    meta = json.loads(header["__metadata__"]["dllm_kvq.kvquant_state"]) | {"channels": 10**9}
    header["__metadata__"]["dllm_kvq.kvquant_state"] = json.dumps(meta)
    for name in ("k_upper", "k_lower"):
        header[name] |= {"shape": [2, 10**9], "data_offsets": [0, 4 * 10**9]}
    with pytest.raises(ValueError, match=r"k_upper: F16 \[2, 1000000000\] takes 4,000,000,000 bytes"):
        KVQuantState.from_bytes(_file(header, data))


@pytest.mark.parametrize(("change", "says"), [
    (lambda h: h.pop("v_lut"), "the file holds tensors"),
    (lambda h: h["k_lut"].update(dtype="F16"), "k_lut: expected F32"),
    (lambda h: h["k_lut"].update(data_offsets=[0, 10**12]), "k_lut: F32"),
])
def test_tensors_the_metadata_does_not_describe_are_refused(change, says):
    header, data = _header(kvquant_state_for(SPEC))
    change(header)
    with pytest.raises(ValueError, match=says):
        KVQuantState.from_bytes(_file(header, data))


@pytest.mark.parametrize("data", [struct.pack("<Q", 1 << 63) + b"{}", b"\x05\x00", struct.pack("<Q", 2) + b"[]",
                                  struct.pack("<Q", 200_008) + b"[" * 100_000 + b"]" * 100_000 + b"\0" * 8])
def test_garbage_is_a_value_error(data):
    with pytest.raises(ValueError):
        KVQuantState.from_bytes(data)
