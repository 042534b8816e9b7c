"""Serving: `/v1/chat/completions` and `/v1/completions` proxied to the inference engines.

`router` holds the routes, `service` forwards requests (admission, proxying, metering), `targets` resolves
model ids (with a short cache; its SQL in `store`), `engines` picks the engine of a request and puts adapters
on engines, `engine_client` is the HTTP/1.1 client proxied requests use, `protocol` the cheap byte-level
handling of bodies, SSE lines and error envelopes, and `calls` the model calls a request makes of its own.
"""
