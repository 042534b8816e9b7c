-- A spend limit per API key (`gateway.limits.budget`): the most a key may spend in a UTC calendar month, on its
-- completions, its Tinker training and the jobs it created (their training and their graders' completions).
-- NULL: no limit of its own (the organisation's monthly budget still holds).
ALTER TABLE rate_limits ADD COLUMN monthly_spend_limit_usd double precision;
-- A key's jobs, for its month's spend.
CREATE INDEX fine_tuning_jobs_key ON fine_tuning_jobs (api_key_id, created_at) WHERE api_key_id IS NOT NULL;
