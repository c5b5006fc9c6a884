"""`benchmarks/decode_speed.py` runs end to end and prints every method for both schedules (tiny shape)."""

from __future__ import annotations

from benchmarks import decode_speed


def test_benchmark_prints_every_method_with_ratios(capsys):
    decode_speed.main([
        "--preset", "tiny", "--prompt-length", "20", "--gen-length", "32", "--block-length", "16",
        "--steps-per-block", "4", "--threads", "1", "--repeats", "2",
    ])
    out = capsys.readouterr().out
    assert "d_model 64, 2 layers" in out and "torch threads 1, best of 2" in out
    assert "fixed 4 steps/block" in out and "threshold 0.9" in out
    fixed = out.split("fixed 4 steps/block")[1].split("threshold")[0]
    for method in decode_speed.METHODS:
        line = next(line for line in fixed.splitlines() if line.strip().startswith(method.name))
        columns = line[len("  ") + 24:].split()
        tokens_per_s, tokens_per_cpu_s, nfe, ratio, cpu_ratio, time_vs_dual, cpu_vs_dual, alive, read = columns
        assert float(tokens_per_s) > 0 and float(tokens_per_cpu_s) > 0
        assert float(nfe) == 8.0  # 4 steps x 2 blocks in every mode
        assert all(r.endswith("x") for r in (ratio, cpu_ratio, time_vs_dual, cpu_vs_dual))
        if method.name == decode_speed.BASELINE:
            assert ratio == cpu_ratio == "1.00x"
            assert float(alive) == float(read) == 0  # no cache holds and reads no reused K/V
        else:
            assert float(alive) > 0 and float(read) > 0
    assert "no cache                " in fixed and "1.00x" in fixed
    assert "dual+kivi 4b keep" in fixed and "dual+kvquant 4b" in fixed
