-- Tenancy, files, fine-tuning jobs, their events and checkpoints, and fine-tuned models.
-- Every tenant-owned row carries organization_id; every query filters by it.

CREATE TABLE organizations (
    id          text PRIMARY KEY,
    seq         bigserial UNIQUE,
    name        text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE api_keys (
    id              text PRIMARY KEY,
    seq             bigserial UNIQUE,
    organization_id text NOT NULL REFERENCES organizations(id),
    name            text,
    display_prefix  text NOT NULL,
    digest          bytea NOT NULL UNIQUE,
    created_at      timestamptz NOT NULL DEFAULT now(),
    last_used_at    timestamptz,
    revoked_at      timestamptz
);
CREATE INDEX api_keys_org ON api_keys (organization_id, seq);

CREATE TABLE files (
    id              text PRIMARY KEY,
    seq             bigserial UNIQUE,
    organization_id text NOT NULL REFERENCES organizations(id),
    filename        text NOT NULL,
    purpose         text NOT NULL,
    bytes           bigint NOT NULL,
    sha256          text NOT NULL,
    status          text NOT NULL DEFAULT 'processed',
    status_details  text,
    blob_key        text NOT NULL,
    line_count      bigint,
    created_at      timestamptz NOT NULL DEFAULT now(),
    expires_at      timestamptz
);
CREATE INDEX files_org ON files (organization_id, seq);

CREATE TABLE fine_tuning_jobs (
    id               text PRIMARY KEY,
    seq              bigserial UNIQUE,
    organization_id  text NOT NULL REFERENCES organizations(id),
    api_key_id       text,
    model            text NOT NULL,
    training_file    text NOT NULL,
    validation_file  text,
    status           text NOT NULL,
    method           jsonb NOT NULL,
    hyperparameters  jsonb NOT NULL,
    seed             bigint NOT NULL,
    suffix           text,
    metadata         jsonb,
    integrations     jsonb,
    error            jsonb,
    fine_tuned_model text,
    trained_tokens   bigint,
    result_files     jsonb NOT NULL DEFAULT '[]'::jsonb,
    estimated_finish timestamptz,
    created_at       timestamptz NOT NULL DEFAULT now(),
    queued_at        timestamptz,
    started_at       timestamptz,
    finished_at      timestamptz,
    -- scheduling
    queue_generation integer NOT NULL DEFAULT 0,
    attempts         integer NOT NULL DEFAULT 0,
    worker_id        text,
    heartbeat_at     timestamptz,
    pause_requested  boolean NOT NULL DEFAULT false,
    current_step     integer,
    total_steps      integer,
    last_checkpoint  text,
    -- idempotent creates
    idempotency_key  text,
    request_hash     text,
    UNIQUE (organization_id, idempotency_key)
);
CREATE INDEX fine_tuning_jobs_org ON fine_tuning_jobs (organization_id, seq);
CREATE INDEX fine_tuning_jobs_status ON fine_tuning_jobs (status, queued_at);

CREATE TABLE fine_tuning_job_events (
    id              text PRIMARY KEY,
    seq             bigserial UNIQUE,
    job_id          text NOT NULL REFERENCES fine_tuning_jobs(id) ON DELETE CASCADE,
    organization_id text NOT NULL REFERENCES organizations(id),
    created_at      timestamptz NOT NULL DEFAULT now(),
    level           text NOT NULL DEFAULT 'info',
    message         text NOT NULL,
    type            text NOT NULL DEFAULT 'message',
    data            jsonb,
    dedup_key       text,
    UNIQUE (job_id, dedup_key)
);
CREATE INDEX fine_tuning_job_events_job ON fine_tuning_job_events (job_id, seq);

CREATE TABLE fine_tuning_job_checkpoints (
    id                          text PRIMARY KEY,
    seq                         bigserial UNIQUE,
    job_id                      text NOT NULL REFERENCES fine_tuning_jobs(id) ON DELETE CASCADE,
    organization_id             text NOT NULL REFERENCES organizations(id),
    created_at                  timestamptz NOT NULL DEFAULT now(),
    step_number                 integer NOT NULL,
    metrics                     jsonb NOT NULL DEFAULT '{}'::jsonb,
    fine_tuned_model_checkpoint text NOT NULL,
    path                        text NOT NULL,
    UNIQUE (job_id, step_number)
);
CREATE INDEX fine_tuning_job_checkpoints_job ON fine_tuning_job_checkpoints (job_id, seq);

CREATE TABLE models (
    id              text PRIMARY KEY,
    seq             bigserial UNIQUE,
    organization_id text NOT NULL REFERENCES organizations(id),
    base_model      text NOT NULL,
    job_id          text REFERENCES fine_tuning_jobs(id),
    adapter_path    text NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX models_org ON models (organization_id, seq);
