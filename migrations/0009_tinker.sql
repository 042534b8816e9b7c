-- The Tinker API (gateway/tinker): sessions, training models, their requests (futures) and checkpoints.
-- Every row carries its organisation; every query filters by it.
CREATE TABLE tinker_sessions (
    id                text PRIMARY KEY,
    organization_id   text NOT NULL REFERENCES organizations(id),
    api_key_id        text NOT NULL,
    tags              jsonb NOT NULL DEFAULT '[]',
    user_metadata     jsonb,
    sdk_version       text,
    created_at        timestamptz NOT NULL DEFAULT now(),
    last_heartbeat_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX tinker_sessions_org ON tinker_sessions (organization_id, created_at);

-- A training model: a LoRA adapter held by one worker's training process while it is in use.
CREATE TABLE tinker_models (
    id              text PRIMARY KEY,
    seq             bigserial UNIQUE,
    organization_id text NOT NULL REFERENCES organizations(id),
    api_key_id      text NOT NULL,
    session_id      text NOT NULL,
    base_model      text NOT NULL,
    lora_rank       integer NOT NULL,
    lora_config     jsonb NOT NULL,
    user_metadata   jsonb,
    worker_id       text,              -- the worker holding the model now, NULL when none does
    heartbeat_at    timestamptz,       -- the holder's last beat
    resume_path     text,              -- state saved when an idle holder let the model go
    lost            text,              -- why the model's weights are gone (its holder died), else NULL
    created_at      timestamptz NOT NULL DEFAULT now(),
    last_request_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX tinker_models_org ON tinker_models (organization_id, seq);

-- A request of the API, answered later through retrieve_future. A training model's requests run in seq order.
CREATE TABLE tinker_requests (
    id              text PRIMARY KEY,
    seq             bigserial UNIQUE,
    organization_id text NOT NULL REFERENCES organizations(id),
    model_id        text,
    kind            text NOT NULL,
    payload         jsonb NOT NULL DEFAULT '{}',
    status          text NOT NULL DEFAULT 'pending'
                    CHECK (status IN ('pending', 'running', 'done', 'failed')),
    result          bytea,
    result_type     text,              -- 'json' or 'proto'
    error           text,
    category        text,              -- 'user' or 'server' for a failed request
    created_at      timestamptz NOT NULL DEFAULT now(),
    finished_at     timestamptz
);
CREATE INDEX tinker_requests_open ON tinker_requests (model_id, seq) WHERE status IN ('pending', 'running');

CREATE TABLE tinker_checkpoints (
    organization_id text NOT NULL REFERENCES organizations(id),
    model_id        text NOT NULL,
    kind            text NOT NULL CHECK (kind IN ('training', 'sampler')),
    name            text NOT NULL,
    path            text NOT NULL,     -- the directory on the blob store
    served_model    text,              -- a sampler checkpoint's OpenAI model id
    with_optimizer  boolean NOT NULL DEFAULT false,
    size_bytes      bigint,
    created_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (model_id, kind, name)
);
CREATE INDEX tinker_checkpoints_org ON tinker_checkpoints (organization_id, created_at);

-- Sampling sessions: a base model or a sampler checkpoint, for one organisation.
CREATE TABLE tinker_samplers (
    id              text PRIMARY KEY,
    organization_id text NOT NULL REFERENCES organizations(id),
    session_id      text NOT NULL,
    base_model      text NOT NULL,
    model_path      text,              -- tinker:// path of the sampler checkpoint, NULL for the base model
    served_model    text NOT NULL,     -- the OpenAI model id the engines answer for
    created_at      timestamptz NOT NULL DEFAULT now()
);
