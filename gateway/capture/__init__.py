"""Capture: chat completions recorded from the traffic of organisations and keys that opted in (admin API),
with the token ids and log-probabilities the engines sampled, and OpenAI's stored-completions API over them.

`policy` holds who captures (in memory: the request path reads one dict), `recorder` watches one request
(`Capture`), `writer` writes the records in batches off the request path (`CaptureWriter`), `store` is the
SQL, `protocol` the shapes, `service` and `router` the admin and stored-completions routes. See
docs/capture.md.
"""
