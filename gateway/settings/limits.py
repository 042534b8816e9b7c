"""Settings of what one request may carry and how much a key or organisation may use: body and upload
sizes, JSON depth, grader input sizes, rate limits and the budget reservations."""

from __future__ import annotations

from pydantic import BaseModel, Field


class LimitSettings(BaseModel):
    """Limits and budgets: the largest request bodies, uploads and grader inputs the gateway accepts, the
    default rate limits of a key, and how gateways share rate-limit buckets and monthly budgets."""

    max_upload_bytes: int = 512 * 1024 * 1024
    """Largest file accepted by `POST /v1/files` (OpenAI's limit: 512 MB)."""
    max_jsonl_line_bytes: int = 8 * 1024 * 1024
    """Largest single line of a `fine-tune` JSONL upload."""
    max_json_depth: int = Field(default=64, ge=2)
    """Deepest nesting of arrays and objects in a request body or a JSONL line; deeper JSON is refused."""
    max_request_body_bytes: int = Field(default=2 * 1024 * 1024, ge=1024)
    """Largest body of any request but a file upload (`POST /v1/files` has `max_upload_bytes`): completions,
    graders, evals, jobs. A declared `Content-Length` over it is refused with 413 before the body is read, a
    streamed body as soon as it passes it. JSON is parsed on the event loop (2 MiB of escaped text: about
    10 ms), so this also bounds how long one request can hold everyone else's."""
    grader_max_source_bytes: int = Field(default=256 * 1024, ge=1)
    """Largest `source` of a python grader, in UTF-8 bytes (OpenAI's limit); checked before it is parsed."""
    grader_max_text_chars: int = Field(default=32 * 1024, ge=1)
    """Longest text a grader reads on the gateway or a worker: the `model_sample` of `graders/run`, and each
    `input` and `reference` of a `string_check` or `text_similarity` grader once its templates are filled in
    (fuzzy matching and ROUGE-L grow with the square of the length). Longer: a 400 naming the field in
    `graders/run`, an error of the item (score 0) in an eval run."""
    default_requests_per_minute: int = Field(default=10_000, ge=0)
    """Requests per minute of an API key with no request limit of its own (0: unlimited)."""
    default_tokens_per_minute: int = Field(default=10_000_000, ge=0)
    """Tokens (prompt estimate plus max tokens) per minute of an API key with no token limit of its own
    (0: unlimited)."""
    budget_default_max_tokens: int = 256
    """Completion tokens assumed for a budget reservation when a request names no `max_tokens`."""
    rate_limit_lease_s: float = Field(default=0.25, ge=0)
    """Seconds of its own recent traffic a gateway may take from a large rate-limit bucket, or hold of a
    monthly budget, in advance, to admit the requests that follow without a Redis round trip (never more
    than the bucket or the budget grants, so limits and budgets hold across gateways; small buckets and
    budgets near their end are counted request by request). 0: ask Redis every time."""
    limits_cache_ttl_s: float = 10.0
    """How long a gateway trusts its cached rate limits and budgets (its own admin changes apply at once)."""
