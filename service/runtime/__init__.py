"""The serving runtime (issue 21): the scheduler's data and pure functions (`service.runtime.scheduler`:
admission by KV bytes, the plan of an iteration's forwards) and the one loop that applies them
(`service.runtime.loop`: admit -> plan -> run -> finish, with the queue, cancellation, drain and faults); the
engine's running batch (`service.engine.batch.RunningBatch`) runs each planned iteration."""
