-- When a worker last took a Tinker training model: with jobs' started_at, the claim's "started least
-- recently" across both kinds of work (gateway/worker/store.py FAIREST).
ALTER TABLE tinker_models ADD COLUMN held_at timestamptz;
CREATE INDEX tinker_models_held ON tinker_models (organization_id) WHERE worker_id IS NOT NULL;

-- When a checkpoint expires (the SDK's `ttl_seconds`; checkpoints made for a sampling client at once expire
-- after `tinker_ephemeral_ttl_s`): a worker's cron deletes it, its served model and its files.
ALTER TABLE tinker_checkpoints ADD COLUMN expires_at timestamptz;
CREATE INDEX tinker_checkpoints_expiry ON tinker_checkpoints (expires_at) WHERE expires_at IS NOT NULL;
