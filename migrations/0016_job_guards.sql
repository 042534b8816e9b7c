-- A job's guards (`gateway.jobs.guards`): every guard's thresholds and action, resolved when the job is
-- created (the defaults under the create's `guards`). NULL: a job made before guards, shown with the defaults.
ALTER TABLE fine_tuning_jobs ADD COLUMN guards jsonb;
