-- Dashboard sign-ins. The row is found by the SHA-256 of the cookie's session id; the key signed in with is
-- kept only as `sealed` (the key XOR a one-time pad that lives in the cookie alone), so neither the
-- database nor the cookie holds it. `api_key_id` is NULL for the admin key.
CREATE TABLE dashboard_sessions (
    id_digest       bytea PRIMARY KEY,
    organization_id text REFERENCES organizations(id) ON DELETE CASCADE,
    api_key_id      text REFERENCES api_keys(id) ON DELETE CASCADE,
    is_admin        boolean NOT NULL,
    sealed          bytea NOT NULL,
    csrf_token      text NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    expires_at      timestamptz NOT NULL
);
CREATE INDEX dashboard_sessions_expiry ON dashboard_sessions (expires_at);
