"""Migration 0014 fills the job columns the claim reads (`gpus`, `method_type`) from the jobs already stored:
a resolved `gpus` is kept, one not a number yet (`"auto"`, or absent in a job made before devices were
counted) counts one device, as the claim's JSON path counted it before.
"""

from __future__ import annotations

import json

import asyncpg

from gateway.db import list_migrations, migrate

INSERT_JOB = """
INSERT INTO fine_tuning_jobs (id, organization_id, model, training_file, status, method, seed)
VALUES ($1, 'org-old', 'tiny-chat', 'file-x', $2, $3::jsonb, 1)"""


async def test_existing_jobs_keep_their_devices(own_database: str) -> None:
    conn = await asyncpg.connect(own_database)
    try:
        await conn.execute(
            "CREATE TABLE schema_migrations (version integer PRIMARY KEY, name text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now())"
        )
        for version, name, path in list_migrations():
            if version >= 14:
                break
            await conn.execute(path.read_text())
            await conn.execute("INSERT INTO schema_migrations (version, name) VALUES ($1, $2)", version, name)
        await conn.execute("INSERT INTO organizations (id, name) VALUES ('org-old', 'old')")

        def method(kind: str, **hyperparameters: object) -> dict[str, object]:
            return {"type": kind, kind: {"hyperparameters": hyperparameters}}

        jobs = {
            "ftjob-two": ("queued", method("dpo", gpus=2, beta=0.1)),
            "ftjob-auto": ("validating_files", method("supervised", gpus="auto")),
            "ftjob-old": ("queued", method("supervised", n_epochs=1)),
            "ftjob-rl": ("queued", method("reinforcement", gpus=1)),
        }
        for job_id, (status, stored) in jobs.items():
            await conn.execute(INSERT_JOB, job_id, status, json.dumps(stored))
        assert (await migrate(own_database))[0] == "0014_job_devices"  # and any later ones
        rows = await conn.fetch("SELECT id, gpus, method_type, method FROM fine_tuning_jobs")
        found = {r["id"]: (r["gpus"], r["method_type"]) for r in rows}
        assert found == {
            "ftjob-two": (2, "dpo"),
            "ftjob-auto": (1, "supervised"),
            "ftjob-old": (1, "supervised"),
            "ftjob-rl": (1, "reinforcement"),
        }
        assert {r["id"]: json.loads(r["method"]) for r in rows} == {k: m for k, (_, m) in jobs.items()}
    finally:
        await conn.close()
