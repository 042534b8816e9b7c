-- Usage metering, rate limits, budgets and the Stripe billing outbox.

-- One row per completion request that reached an inference engine (written in batches by the gateway).
CREATE TABLE completion_usage (
    id                bigserial PRIMARY KEY,
    organization_id   text NOT NULL REFERENCES organizations(id),
    api_key_id        text NOT NULL,
    model             text NOT NULL,
    base_model        text NOT NULL,
    prompt_tokens     bigint NOT NULL DEFAULT 0,
    completion_tokens bigint NOT NULL DEFAULT 0,
    latency_ms        integer NOT NULL DEFAULT 0,
    status            integer NOT NULL DEFAULT 200,
    created_at        timestamptz NOT NULL,
    billed            boolean NOT NULL DEFAULT false
);
CREATE INDEX completion_usage_org_time ON completion_usage (organization_id, created_at);
CREATE INDEX completion_usage_unbilled ON completion_usage (id) WHERE NOT billed;

-- One row per trainer attempt that ended (succeeded, failed, cancelled, paused, handed back): the progress
-- it made. Written in the same transaction as the job's state change.
CREATE TABLE training_usage (
    id               bigserial PRIMARY KEY,
    organization_id  text NOT NULL REFERENCES organizations(id),
    job_id           text NOT NULL REFERENCES fine_tuning_jobs(id) ON DELETE CASCADE,
    base_model       text NOT NULL,
    method           text NOT NULL,
    trained_tokens   bigint NOT NULL DEFAULT 0,
    steps            integer NOT NULL DEFAULT 0,
    training_seconds double precision NOT NULL DEFAULT 0,
    outcome          text NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now(),
    billed           boolean NOT NULL DEFAULT false
);
CREATE INDEX training_usage_org_time ON training_usage (organization_id, created_at);
CREATE INDEX training_usage_job ON training_usage (job_id);
CREATE INDEX training_usage_unbilled ON training_usage (id) WHERE NOT billed;

-- Requests and tokens per minute for an organisation (api_key_id NULL) or one of its keys.
CREATE TABLE rate_limits (
    subject                   text PRIMARY KEY,
    organization_id           text NOT NULL REFERENCES organizations(id),
    api_key_id                text,
    max_requests_per_1_minute integer,
    max_tokens_per_1_minute   integer,
    updated_at                timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX rate_limits_org ON rate_limits (organization_id);

-- Monthly hard budget and the Stripe customer of an organisation.
CREATE TABLE organization_billing (
    organization_id    text PRIMARY KEY REFERENCES organizations(id),
    monthly_budget_usd double precision,
    stripe_customer_id text,
    updated_at         timestamptz NOT NULL DEFAULT now()
);

-- Meter events to send to Stripe: one row per (organisation, meter, window, aggregation run), made in the
-- same transaction that marks its usage rows billed; `identifier` is what Stripe dedupes on.
CREATE TABLE billing_outbox (
    id                 bigserial PRIMARY KEY,
    identifier         text NOT NULL UNIQUE,
    organization_id    text NOT NULL REFERENCES organizations(id),
    stripe_customer_id text,
    meter              text NOT NULL,
    event_name         text NOT NULL,
    window_start       timestamptz NOT NULL,
    value              bigint NOT NULL,
    status             text NOT NULL DEFAULT 'pending',
    attempts           integer NOT NULL DEFAULT 0,
    last_error         text,
    created_at         timestamptz NOT NULL DEFAULT now(),
    sent_at            timestamptz
);
CREATE INDEX billing_outbox_pending ON billing_outbox (id) WHERE status = 'pending';
CREATE INDEX billing_outbox_org ON billing_outbox (organization_id, id);
