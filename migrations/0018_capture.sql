-- Capture (`gateway.capture`): chat completions recorded from the traffic of organisations or keys that
-- opted in, and served back through OpenAI's stored-completions API.

-- Whether capture is on: one row per organisation (api_key_id '') and per key with a setting of its own
-- (which overrides its organisation's). No row: off.
CREATE TABLE capture_settings (
    organization_id text NOT NULL REFERENCES organizations(id),
    api_key_id      text NOT NULL DEFAULT '',
    enabled         boolean NOT NULL,
    retention_days  integer,
    updated_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (organization_id, api_key_id)
);

-- One captured call. `id` is the completion's own id (the engine's), unique within the organisation.
CREATE TABLE captured_completions (
    organization_id      text NOT NULL,
    id                   text NOT NULL,
    seq                  bigint GENERATED ALWAYS AS IDENTITY,
    api_key_id           text NOT NULL,
    episode_id           text,
    parent_episode_id    text,
    stored               boolean NOT NULL,          -- the request said `store: true`
    streamed             boolean NOT NULL,
    model                text NOT NULL,             -- as the client asked for it
    base_model           text NOT NULL,
    served_version       text NOT NULL,             -- the adapter version (or base model) that answered
    request              jsonb NOT NULL,            -- the body as received, `metadata` aside
    response             jsonb NOT NULL,            -- the chat.completion as the client saw it
    metadata             jsonb NOT NULL DEFAULT '{}',
    prompt_token_ids     jsonb,                     -- null where the engine returned none
    completion_token_ids jsonb,                     -- one list per choice
    logprobs             jsonb,                     -- one list of floats per choice
    finish_reason        text,
    prompt_tokens        integer NOT NULL,
    completion_tokens    integer NOT NULL,
    latency_ms           integer NOT NULL,
    status               integer NOT NULL,
    created_at           timestamptz NOT NULL,
    expires_at           timestamptz,
    PRIMARY KEY (organization_id, id)
);
CREATE INDEX captured_completions_order ON captured_completions (organization_id, created_at, seq);
CREATE INDEX captured_completions_episode ON captured_completions (organization_id, episode_id)
    WHERE episode_id IS NOT NULL;
CREATE INDEX captured_completions_expiry ON captured_completions (expires_at) WHERE expires_at IS NOT NULL;
