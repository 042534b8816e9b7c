-- A job's devices as columns the claim reads (`gateway.work.store.FAIREST`), set at create and when its
-- hyperparameters are resolved, instead of a JSON path into `method`: `gpus`, the devices it trains on, and
-- `method_type`, whose reinforcement jobs may take generation devices besides. Existing rows are filled
-- from their method; one whose `gpus` is not a number yet ("auto", or absent in a job made before devices
-- were counted) trains on one, as the claim counted it.
ALTER TABLE fine_tuning_jobs
    ADD COLUMN gpus integer NOT NULL DEFAULT 1 CHECK (gpus > 0),
    ADD COLUMN method_type text NOT NULL DEFAULT 'supervised';

UPDATE fine_tuning_jobs
SET method_type = coalesce(method->>'type', 'supervised'),
    gpus = CASE WHEN (method #>> ARRAY[method->>'type', 'hyperparameters', 'gpus']) ~ '^[1-9][0-9]*$'
                THEN (method #>> ARRAY[method->>'type', 'hyperparameters', 'gpus'])::int
                ELSE 1 END;
