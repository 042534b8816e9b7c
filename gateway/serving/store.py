"""SQL of serving: the base model and adapter of a fine-tuned model or checkpoint id in one organisation."""

from __future__ import annotations

from dataclasses import dataclass

import asyncpg

GET_MODEL = "SELECT base_model, adapter_path FROM models WHERE id = $1 AND organization_id = $2"
GET_CHECKPOINT = """
SELECT j.model AS base_model, c.path AS adapter_path
FROM fine_tuning_job_checkpoints c JOIN fine_tuning_jobs j ON j.id = c.job_id
WHERE c.fine_tuned_model_checkpoint = $1 AND c.organization_id = $2
LIMIT 1"""


@dataclass(frozen=True, slots=True)
class Served:
    """What a model id of an organisation is made of."""

    base_model: str
    adapter_path: str


async def find_adapter(pool: asyncpg.Pool, org_id: str, model_id: str) -> Served | None:
    """The fine-tuned model `model_id` of `org_id`, or its checkpoint of that id (`...:ckpt-step-N`)."""
    row = await pool.fetchrow(GET_MODEL, model_id, org_id)
    if row is None and ":ckpt-step-" in model_id:
        row = await pool.fetchrow(GET_CHECKPOINT, model_id, org_id)
    return None if row is None else Served(row["base_model"], row["adapter_path"])
