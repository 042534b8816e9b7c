"""OpenAI's rate-limit headers (`x-ratelimit-{limit,remaining,reset}-{requests,tokens}`) and the 429 of a
request a bucket refused, from the buckets' states after a check (`gateway.limits.guard`)."""

from __future__ import annotations

from gateway.errors import RateLimited
from gateway.limits.buckets import BucketState, TakeResult

UNLIMITED = 1_000_000_000
"""Limit and remaining reported for a kind that no bucket limits."""
KINDS = ("requests", "tokens")


def _duration(ms: int) -> str:
    """OpenAI's reset format: `1s`, `6m0s`, `250ms`."""
    if ms < 1000:
        return f"{max(0, ms)}ms"
    seconds = ms / 1000
    if seconds < 60:
        return f"{seconds:.3g}s"
    return f"{int(seconds // 60)}m{int(seconds % 60)}s"


NO_BUCKET = BucketState(UNLIMITED, UNLIMITED, 0)
HEADER_NAMES = {
    kind: (f"x-ratelimit-limit-{kind}", f"x-ratelimit-remaining-{kind}", f"x-ratelimit-reset-{kind}")
    for kind in KINDS
}


def headers_of(kinds: list[str], states: list[BucketState]) -> dict[str, str]:
    """`x-ratelimit-*` headers: per kind, the bucket with the least left (`UNLIMITED` for a kind without)."""
    out: dict[str, str] = {}
    for kind in KINDS:
        tight = NO_BUCKET
        for k, state in zip(kinds, states, strict=True):
            if k == kind and (tight is NO_BUCKET or state.remaining < tight.remaining):
                tight = state
        limit, remaining, reset = HEADER_NAMES[kind]
        out[limit] = str(tight.limit)
        out[remaining] = str(tight.remaining)
        out[reset] = _duration(tight.reset_ms)
    return out


def refusal_of(taken: TakeResult, headers: dict[str, str]) -> RateLimited:
    """The 429 of a request a bucket refused, with the rate-limit headers and when to retry."""
    retry_s = max(1, -(-taken.retry_after_ms // 1000))
    return RateLimited(
        f"Rate limit reached for this organization or API key; please try again in {retry_s}s.",
        headers={**headers, "retry-after": str(retry_s)},
    )
