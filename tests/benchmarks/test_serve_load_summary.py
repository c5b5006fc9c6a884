"""`benchmarks/serve_load.py` prints the ratio behind each target whose level it ran: issue 5's at 8 clients (as
docs/benchmarks.md shows it) and issue 21's at 16. The rows are the figures one run measured; only the arithmetic
and the wording are checked here (the run itself starts a server: tens of seconds)."""

from __future__ import annotations

from benchmarks.serve_load import summary


def _row(clients: int, req_per_s: float, tok_per_cpu_s: float = 100.0, rows_per_forward: float = 1.0) -> dict:
    return {"clients": clients, "req_per_s": req_per_s, "tok_per_cpu_s": tok_per_cpu_s,
            "rows_per_forward": rows_per_forward}


def test_the_8_client_target_is_stated_against_sequential_with_the_slowest_level():
    rows = [_row(0, 20.0), _row(1, 20.0), _row(4, 19.0), _row(8, 24.0), _row(16, 22.0, 180.0, 6.5)]
    lines = summary(rows)
    assert lines[0] == ("at 8 clients: 1.20x sequential (target >= 1.2x on CPU, >= 3x on a GPU); slowest level: "
                        "0.95x sequential (target >= 1.0x)")
    assert lines[1].startswith("at 16 clients: 1.80x the first level's tokens per server CPU second")
    assert "6.50 rows per forward" in lines[1]


def test_levels_1_and_8_state_the_8_client_ratio_against_one_client():
    """`--levels 1,8` printed no ratio line at all (only a 16-client level had one)."""
    lines = summary([_row(1, 2.0), _row(8, 3.0)])
    assert lines == [("at 8 clients: 1.50x the first level (1 client(s)) (target >= 1.2x on CPU, >= 3x on a GPU); "
                      "slowest level: 1.00x the first level (1 client(s)) (target >= 1.0x)")]


def test_no_target_level_no_line():
    assert summary([_row(0, 5.0), _row(4, 6.0)]) == []
