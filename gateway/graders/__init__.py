"""Scoring endpoints: OpenAI's graders (`/v1/fine_tuning/alpha/graders/{run,validate}`) and the gateway's
environment extension (`/v1/fine_tuning/alpha/environments/run`)."""
