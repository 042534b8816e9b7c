"""The stages of one job run, driven by `gateway.worker.runner.JobRun` (the state machine):

1. `spec`: the work dir and `spec.json`;
2. `process`: the trainer process (spawn, heartbeat, stop, the job's key);
3. `ingest`: the trainer's events to rows (metrics, checkpoints, messages);
4. `metering`: the attempt's cost, its usage row, the budget pause.

Each stage holds one concern and its SQL lives in the stores (`gateway.jobs.running`, `gateway.jobs.store`).
"""
