"""Serving: `/v1/chat/completions` and `/v1/completions` proxied to the inference engines.

`router` holds the routes, `service` resolves models and forwards requests, `upstreams` holds the state made
in the lifespan (the pooled HTTP client, the engine registry, adapter loads, the model cache, the usage sink),
and `protocol` the cheap byte-level handling of bodies, SSE lines and error envelopes.
"""
