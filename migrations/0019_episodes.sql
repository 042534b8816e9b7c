-- Episodes of captured traffic (`gateway.capture`): the calls of one agent run, their place in its token
-- sequence, and the rewards posted for them.

-- Episode keys: keys minted by `POST /v1/episodes`, inference only, expiring; named 'episode <id>'.
ALTER TABLE api_keys DROP CONSTRAINT IF EXISTS api_keys_kind_check;
ALTER TABLE api_keys ADD CONSTRAINT api_keys_kind_check CHECK (kind IN ('user', 'eval', 'job', 'episode'));

-- One episode. Made by `POST /v1/episodes`, or by the first captured call that names it in a header. Its
-- state is not stored but read: `closed` once `closed_at` is set; `abandoned` (or `closed`, where
-- `on_idle` says so) once no call came for `idle_timeout_s`; else `open`.
CREATE TABLE episodes (
    organization_id   text NOT NULL,
    id                text NOT NULL,
    seq               bigint GENERATED ALWAYS AS IDENTITY,
    api_key_id        text,                          -- the episode key minted for it (null: named by header)
    parent_episode_id text,
    metadata          jsonb NOT NULL DEFAULT '{}',
    idle_timeout_s    integer NOT NULL DEFAULT 900,
    on_idle           text NOT NULL DEFAULT 'abandon' CHECK (on_idle IN ('abandon', 'close')),
    created_at        timestamptz NOT NULL DEFAULT now(),
    last_call_at      timestamptz,
    closed_at         timestamptz,
    expires_at        timestamptz,                   -- its retention (that of the capture setting)
    PRIMARY KEY (organization_id, id)
);
CREATE INDEX episodes_order ON episodes (organization_id, created_at, seq);

-- A call's prompt as a delta on the episode's previous turn: `previous_id` is that turn, the first
-- `prompt_prefix_tokens` ids of the prompt are its prompt plus its sampled completion (choice 0), and
-- `prompt_token_ids` holds only the ids after them. Where the prompt does not start with them,
-- `segment_break` says why (and the ids are whole).
-- Likewise the request's `messages`: the first `messages_prefix` are the previous turn's request messages,
-- and the stored request holds the ones after them.
ALTER TABLE captured_completions ADD COLUMN previous_id text;
ALTER TABLE captured_completions ADD COLUMN prompt_prefix_tokens integer NOT NULL DEFAULT 0;
ALTER TABLE captured_completions ADD COLUMN messages_prefix integer NOT NULL DEFAULT 0;
ALTER TABLE captured_completions ADD COLUMN segment_break jsonb;
ALTER TABLE captured_completions ADD COLUMN cost_usd double precision;
ALTER TABLE captured_completions ADD COLUMN stored_bytes integer NOT NULL DEFAULT 0;

-- Rewards: append-only. A target is the episode, one completion of it, or a span of a completion's tokens.
-- A repeated idempotency key within the episode is the same reward (kept once).
CREATE TABLE episode_rewards (
    organization_id text NOT NULL,
    id              text NOT NULL,
    seq             bigint GENERATED ALWAYS AS IDENTITY,
    episode_id      text,                            -- null: thumbs on a completion outside any episode
    completion_id   text,
    span_start      integer,
    span_end        integer,
    name            text NOT NULL,
    value           double precision NOT NULL,
    source          text,
    idempotency_key text,
    api_key_id      text NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (organization_id, id)
);
CREATE UNIQUE INDEX episode_rewards_once ON episode_rewards (organization_id, coalesce(episode_id, ''),
    idempotency_key) WHERE idempotency_key IS NOT NULL;
CREATE INDEX episode_rewards_episode ON episode_rewards (organization_id, episode_id, seq);
CREATE INDEX episode_rewards_completion ON episode_rewards (organization_id, completion_id)
    WHERE completion_id IS NOT NULL;
