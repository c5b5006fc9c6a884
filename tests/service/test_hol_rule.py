"""The head-of-line rule (issue 34, `service.runtime.scheduler.first_passes_first`): a request's first pass runs in
an iteration without the running requests' passes, and a running request waits at most one iteration in a row;
a wide block-initial pass runs piece by piece of its layers (`split_by_layers`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from service.runtime.scheduler import Hold, first_passes_first, plan_forwards, split_by_layers


@dataclass(frozen=True)
class _Pass:
    cohort: str
    kind: str = "window"


def _run(passes, hold):
    run, hold = first_passes_first([_Pass(c) for c in passes], hold)
    return [p.cohort for p in run], hold


def test_a_first_pass_runs_without_the_running_requests_passes():
    run, hold = _run(["long"], Hold())
    assert run == ["long"]  # the first iteration: everybody's first pass
    run, hold = _run(["long"], hold)
    assert run == ["long"]
    run, hold = _run(["long", "short"], hold)
    assert run == ["short"] and hold.held == {"long"}
    run, hold = _run(["long"], hold)  # the short one finished in one pass
    assert run == ["long"]


def test_a_running_request_waits_at_most_one_iteration_in_a_row():
    seen_runs = []  # a new request in every iteration: a waits for c, runs beside d (it waited before), ...
    run, hold = _run(["a", "b"], Hold(frozenset({"a", "b"})))
    for new in ("c", "d", "e", "f"):
        run, hold = _run(["a", "b", new], hold)
        assert new in run
        seen_runs.append("a" in run)
    assert seen_runs == [False, True, False, True]


def test_no_first_pass_holds_nothing_and_a_cohort_that_left_is_forgotten():
    hold = Hold(frozenset({"a", "b", "gone"}), frozenset({"gone"}))
    run, hold = _run(["a", "b"], hold)
    assert run == ["a", "b"] and hold == Hold(frozenset({"a", "b"}), frozenset())


# ---- the layer split (`service.runtime.scheduler.split_by_layers`) ----------------------------------------------
@dataclass(frozen=True)
class _Wide:
    """What the split reads of a pass: kind, rows, width, layer range; and what grouping reads (seq_len)."""

    cohort: str
    kind: str
    width: int
    rows: tuple = (0,)
    layers: tuple | None = None
    seq_len: int = 0


def test_a_wide_full_pass_runs_one_piece_of_its_layers_and_the_rest_goes_on_from_there():
    long, window = _Wide("long", "full", 556), _Wide("short", "window", 32)
    # 556 tokens at 512 a piece: two pieces of 16 of 32 layers; a window pass and a narrow full pass are whole.
    assert split_by_layers([long, window, _Wide("s", "full", 132)], 512, 32) == [
        _Wide("long", "full", 556, layers=(0, 16)), window, _Wide("s", "full", 132)]
    assert split_by_layers([_Wide("long", "full", 556, layers=(16, 32))], 512, 32) == [
        _Wide("long", "full", 556, layers=(16, 32))]
    # Rows count: 4 rows of 556 tokens at 512 a piece: five pieces of ceil(32 / 5) = 7 layers, the last one short.
    four = _Wide("b", "full", 556, rows=(0, 1, 2, 3))
    pieces, start = [], 0
    while start < 32:
        [piece] = split_by_layers([replace(four, layers=(start, 32) if start else None)], 512, 32)
        pieces.append(piece.layers)
        start = piece.layers[1]
    assert pieces == [(0, 7), (7, 14), (14, 21), (21, 28), (28, 32)]
    # Never more pieces than layers; 0 never splits.
    assert split_by_layers([long], 1, 2) == [replace(long, layers=(0, 1))]
    assert split_by_layers([long], 0, 32) == [long]


def test_only_passes_through_the_same_layers_share_a_forward():
    a, b = _Wide("a", "full", 556, seq_len=556), _Wide("b", "full", 540, seq_len=540)
    c = _Wide("c", "full", 556, layers=(16, 32), seq_len=556)
    groups = plan_forwards([a, b, c], 1 << 20, split_tokens=512, num_layers=32)
    assert [[(p.cohort, p.layers) for p in g] for g in groups] == [[("b", (0, 16)), ("a", (0, 16))],
                                                                   [("c", (16, 32))]]
