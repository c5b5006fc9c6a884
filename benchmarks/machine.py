"""The context every benchmark prints first and last: when, on what machine, under what load, and how long it ran.

Figures quoted in ``docs/benchmarks.md`` carry this line, so a reader can tell a busy shared machine from an idle
one. Load is the 1/5/15-minute load average of the whole machine (``os.getloadavg``), CPUs the logical ones.
"""

from __future__ import annotations

import os
import platform
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Self


def cpu_model() -> str:
    """The CPU's model name (Linux ``/proc/cpuinfo``), else what ``platform`` knows."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def context_line() -> str:
    """``date ..., machine ..., load ...``: one line for the top of a benchmark's output."""
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return f"date {now}; machine {cpu_model()}, {os.cpu_count()} CPUs; load average {load} (1/5/15 min)"


class Run:
    """Prints the context line at the start and ``ran N s; load average ...`` at the end (``with Run(): ...``)."""

    def __enter__(self) -> Self:
        self.started = time.perf_counter()
        print(context_line(), flush=True)
        return self

    def __exit__(self, *exc) -> None:
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        print(f"ran {time.perf_counter() - self.started:.0f} s; load average at the end {load} (1/5/15 min)")
