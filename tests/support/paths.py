"""Where the tests find the repository and its shipped data, wherever a test module sits in the tree."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "tests" / "data"
CKPT = DATA / "fastdllm" / "ckpt"
EMBEDDED = REPO / "service" / "assets" / "embedded"
