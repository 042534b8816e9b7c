-- A job's cost limit and its estimate: `max_cost_usd`, the create's `max_cost` (the job pauses once its cost
-- reaches it), and `estimated_cost_usd`, the expected cost when it was queued (what `cost.projected_total`
-- shows before the first step).
ALTER TABLE fine_tuning_jobs
    ADD COLUMN max_cost_usd double precision CHECK (max_cost_usd > 0),
    ADD COLUMN estimated_cost_usd double precision;
