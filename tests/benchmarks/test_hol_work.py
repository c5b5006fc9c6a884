"""`benchmarks/hol_work.py` counts the work a short request waits on beside a long one: with the head-of-line rule
(`service.runtime.scheduler.first_passes_first`) it waits on its own forwards only, without it on the long one's
too, and its tokens are those it decodes alone either way."""

from __future__ import annotations

import pytest
import torch

from benchmarks import hol_work
from service.engine import Engine


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    return Engine.load(None, threads=1)


def test_with_the_rule_a_short_request_waits_on_its_own_work_only(engine):
    ids = hol_work.prompt_ids(engine)
    forwards, work, alone = hol_work.alone_counts(engine, ids)
    without, _ = hol_work.run(engine, ids, 7, rule=False)
    with_rule, _ = hol_work.run(engine, ids, 7, rule=True)
    assert without and with_rule
    assert all(tokens == alone for _, _, tokens in [*without, *with_rule])
    assert max(f for f, _, _ in without) > forwards and max(w for _, w, _ in without) > work
    assert all((f, w) == (forwards, work) for f, w, _ in with_rule)
