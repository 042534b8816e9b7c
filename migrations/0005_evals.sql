-- OpenAI's Evals API: evals (a data source config and testing criteria), their runs (a model sampled over a
-- data source, executed by a worker) and each run's output items (one per data source item).

CREATE TABLE evals (
    id                 text PRIMARY KEY,
    seq                bigserial UNIQUE,
    organization_id    text NOT NULL REFERENCES organizations(id),
    name               text NOT NULL,
    metadata           jsonb,
    data_source_config jsonb NOT NULL,
    testing_criteria   jsonb NOT NULL,
    created_at         timestamptz NOT NULL DEFAULT now(),
    updated_at         timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX evals_org ON evals (organization_id, seq);

CREATE TABLE eval_runs (
    id                           text PRIMARY KEY,
    seq                          bigserial UNIQUE,
    eval_id                      text NOT NULL REFERENCES evals(id) ON DELETE CASCADE,
    organization_id              text NOT NULL REFERENCES organizations(id),
    api_key_id                   text,
    name                         text NOT NULL,
    model                        text NOT NULL,
    metadata                     jsonb,
    data_source                  jsonb NOT NULL,
    -- the eval's criteria when the run was made: what its items are graded with
    testing_criteria             jsonb NOT NULL,
    status                       text NOT NULL DEFAULT 'queued',
    error                        jsonb,
    result_counts                jsonb NOT NULL
        DEFAULT '{"total": 0, "errored": 0, "failed": 0, "passed": 0}'::jsonb,
    per_testing_criteria_results jsonb NOT NULL DEFAULT '[]'::jsonb,
    per_model_usage              jsonb NOT NULL DEFAULT '[]'::jsonb,
    created_at                   timestamptz NOT NULL DEFAULT now(),
    started_at                   timestamptz,
    finished_at                  timestamptz,
    -- scheduling (as for fine-tuning jobs)
    queue_generation             integer NOT NULL DEFAULT 0,
    attempts                     integer NOT NULL DEFAULT 0,
    worker_id                    text,
    heartbeat_at                 timestamptz,
    -- the key the worker minted for this run (revoked when the run ends, or by the reaper)
    worker_key_id                text
);
CREATE INDEX eval_runs_eval ON eval_runs (eval_id, seq);
CREATE INDEX eval_runs_org ON eval_runs (organization_id, seq);
CREATE INDEX eval_runs_open ON eval_runs (status, created_at) WHERE status IN ('queued', 'in_progress');

CREATE TABLE eval_run_output_items (
    id                 text PRIMARY KEY,
    seq                bigserial UNIQUE,
    run_id             text NOT NULL REFERENCES eval_runs(id) ON DELETE CASCADE,
    eval_id            text NOT NULL,
    organization_id    text NOT NULL,
    datasource_item_id integer NOT NULL,
    datasource_item    jsonb NOT NULL,
    status             text NOT NULL,
    results            jsonb NOT NULL,
    sample             jsonb NOT NULL,
    -- tokens by model (the sampled model, and model graders'): what per_model_usage adds up
    usage              jsonb NOT NULL DEFAULT '{}'::jsonb,
    created_at         timestamptz NOT NULL DEFAULT now(),
    UNIQUE (run_id, datasource_item_id)
);
CREATE INDEX eval_run_output_items_run ON eval_run_output_items (run_id, datasource_item_id);
