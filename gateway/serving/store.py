"""SQL of serving: the base model, adapter and version of a fine-tuned model, checkpoint or version id in one
organisation, and the model an alias points at."""

from __future__ import annotations

from dataclasses import dataclass

import asyncpg

GET_MODEL = "SELECT base_model, adapter_path, version FROM models WHERE id = $1 AND organization_id = $2"
GET_CHECKPOINT = """
SELECT j.model AS base_model, c.path AS adapter_path, c.version
FROM fine_tuning_job_checkpoints c JOIN fine_tuning_jobs j ON j.id = c.job_id
WHERE c.fine_tuned_model_checkpoint = $1 AND c.organization_id = $2
LIMIT 1"""
GET_VERSION = """
SELECT base_model, adapter_path, version FROM models WHERE version = $1 AND organization_id = $2
UNION ALL
SELECT j.model, c.path, c.version
FROM fine_tuning_job_checkpoints c JOIN fine_tuning_jobs j ON j.id = c.job_id
WHERE c.version = $1 AND c.organization_id = $2
LIMIT 1"""
SET_MODEL_VERSION = """
UPDATE models SET version = $3
WHERE id = $1 AND organization_id = $2 AND adapter_path = $4 AND version IS NULL"""
SET_CHECKPOINT_VERSION = """
UPDATE fine_tuning_job_checkpoints SET version = $3
WHERE fine_tuned_model_checkpoint = $1 AND organization_id = $2 AND path = $4 AND version IS NULL"""
GET_ALIAS = "SELECT model FROM model_aliases WHERE organization_id = $1 AND name = $2"


@dataclass(frozen=True, slots=True)
class Served:
    """What a model id of an organisation is made of."""

    base_model: str
    adapter_path: str
    version: str | None
    """The adapter's version id; None for a row written before versions, until it is first resolved."""
    checkpoint: bool = False
    """Whether the id names a checkpoint (`...:ckpt-step-N`) rather than a model."""


async def find_adapter(pool: asyncpg.Pool, org_id: str, model_id: str) -> Served | None:
    """The fine-tuned model `model_id` of `org_id`, or its checkpoint of that id (`...:ckpt-step-N`)."""
    row = await pool.fetchrow(GET_MODEL, model_id, org_id)
    if row is not None:
        return Served(row["base_model"], row["adapter_path"], row["version"])
    if ":ckpt-step-" in model_id:
        row = await pool.fetchrow(GET_CHECKPOINT, model_id, org_id)
        if row is not None:
            return Served(row["base_model"], row["adapter_path"], row["version"], checkpoint=True)
    return None


async def find_version(pool: asyncpg.Pool, org_id: str, version: str) -> Served | None:
    """A model or checkpoint of `org_id` whose version is `version`."""
    row = await pool.fetchrow(GET_VERSION, version, org_id)
    return None if row is None else Served(row["base_model"], row["adapter_path"], row["version"])


async def set_version(pool: asyncpg.Pool, org_id: str, model_id: str, served: Served, version: str) -> None:
    """Store the version computed for a row written before versions (unless its adapter changed meanwhile)."""
    query = SET_CHECKPOINT_VERSION if served.checkpoint else SET_MODEL_VERSION
    await pool.execute(query, model_id, org_id, version, served.adapter_path)


async def find_alias(pool: asyncpg.Pool, org_id: str, name: str) -> str | None:
    """The model id alias `name` of `org_id` points at (one primary-key lookup), or None."""
    model: str | None = await pool.fetchval(GET_ALIAS, org_id, name)
    return model
