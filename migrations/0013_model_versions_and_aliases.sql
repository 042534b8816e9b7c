-- Immutable adapter versions and movable aliases (docs/serving.md, "Versions and aliases").
-- `version` is derived from an adapter's content (`gateway/serving/versions.py`): written with the row, or
-- computed and stored the first time a row written before this migration is resolved.
ALTER TABLE models ADD COLUMN version text;
ALTER TABLE fine_tuning_job_checkpoints ADD COLUMN version text;
CREATE INDEX models_org_version ON models (organization_id, version) WHERE version IS NOT NULL;
CREATE INDEX checkpoints_org_version ON fine_tuning_job_checkpoints (organization_id, version)
    WHERE version IS NOT NULL;

-- A name an organisation moves between its models; requests naming it are served by the version of the model
-- it points at when they are admitted.
CREATE TABLE model_aliases (
    organization_id text NOT NULL REFERENCES organizations(id) ON DELETE CASCADE,
    name            text NOT NULL,
    model           text NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (organization_id, name)
);
