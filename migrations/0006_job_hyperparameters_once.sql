-- A job's hyperparameters live once, in method.<type>.hyperparameters (resolved when the job is queued).
ALTER TABLE fine_tuning_jobs DROP COLUMN hyperparameters;
