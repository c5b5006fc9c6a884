"""The preemption scenario of the runtime tests (tests/service/test_preemption.py, test_llada2_runtime.py): a large
request running alone in the budget, a small one submitted from its first ``on_block`` (on the worker thread,
between iterations: the large one is at a block boundary)."""

from __future__ import annotations

import threading

from service.runtime.loop import Job, Worker


def large_then_small(worker: Worker, large: Job, small: Job) -> tuple:
    """Run the scenario on ``worker`` (not started) and stop it. Returns the two results, the large one's streamed
    blocks ``(block, ids per row)`` and the order the two finished in (``"large"``, ``"small"``)."""
    blocks: list[tuple[int, list[list[int]]]] = []
    submitted = threading.Event()

    def on_block(block: int, ids: list[list[int]]) -> None:
        blocks.append((block, [list(r) for r in ids]))
        if not submitted.is_set():
            submitted.set()
            worker.submit(small)

    large.on_block = on_block
    order: list[str] = []
    for name, job in (("large", large), ("small", small)):
        job.future.add_done_callback(lambda _, name=name: order.append(name))
    worker.submit(large)
    worker.start()
    large_result = large.future.result(timeout=300)
    small_result = small.future.result(timeout=300)
    worker.stop()
    return large_result, small_result, blocks, order
