-- Keys the system mints for its own work next to the keys people hold: `kind` says which ('user' for keys
-- made through the admin API; 'eval' for the key a worker uses for one eval run; 'job' for one training
-- job), and `expires_at` bounds a minted key's life even when its holder dies without revoking it.
ALTER TABLE api_keys ADD COLUMN kind text NOT NULL DEFAULT 'user' CHECK (kind IN ('user', 'eval', 'job'));
ALTER TABLE api_keys ADD COLUMN expires_at timestamptz;
CREATE INDEX api_keys_org_kind ON api_keys (organization_id, kind, seq);
