"""OpenAI's Evals API: evals, runs (executed by the worker, `gateway.worker.evals`) and output items."""
