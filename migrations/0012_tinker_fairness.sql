-- When a worker last took a Tinker training model: with jobs' started_at, the claim's "started least
-- recently" across both kinds of work (gateway/worker/store.py FAIREST).
ALTER TABLE tinker_models ADD COLUMN held_at timestamptz;
CREATE INDEX tinker_models_held ON tinker_models (organization_id) WHERE worker_id IS NOT NULL;
