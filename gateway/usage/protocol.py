"""Usage and costs API shapes: OpenAI's organisation usage pages (`GET /v1/organization/usage/completions`,
`GET /v1/organization/costs`), and the bytes kept in capture
(`GET /v1/organization/usage/capture_storage`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

from pydantic import Field, SerializeAsAny

from gateway.protocol import OpenAIBaseModel


@dataclass(frozen=True, slots=True)
class UsageQuery:
    """What both usage routes are asked: whose usage, the time range and its buckets, grouping and page."""

    organization_id: str
    start_time: int
    end_time: int | None
    bucket_width: str
    group_by: list[str]
    """`group_by[]` and `group_by` together."""
    limit: int | None
    """Buckets a page holds (else a default per width)."""
    page: str | None
    """The cursor of a page after the first (the start time of its first bucket)."""


class CompletionsUsageResult(OpenAIBaseModel):
    """Completion usage of one bucket, of one model or key when grouped by them (else those are null)."""

    object: Literal["organization.usage.completions.result"] = "organization.usage.completions.result"
    input_tokens: int
    output_tokens: int
    input_cached_tokens: int = 0
    input_audio_tokens: int = 0
    output_audio_tokens: int = 0
    num_model_requests: int
    project_id: str | None = None
    user_id: str | None = None
    api_key_id: str | None = None
    model: str | None = None
    batch: bool | None = None


class CaptureStorageUsageResult(OpenAIBaseModel):
    """Bytes kept in capture during one bucket (`gateway.usage.storage`): the records' `stored_bytes` times
    the seconds they were kept, metered as the worker's billing pass accrues them."""

    object: Literal["organization.usage.capture_storage.result"] = "organization.usage.capture_storage.result"
    byte_seconds: int
    gb_months: float
    """The same in GB-months (a GB kept 30 days), the unit it is priced in."""


class CostAmount(OpenAIBaseModel):
    value: float
    currency: Literal["usd"] = "usd"


class CostsResult(OpenAIBaseModel):
    """The cost of one bucket: its total, or one line item of it (`group_by=line_item`)."""

    object: Literal["organization.costs.result"] = "organization.costs.result"
    amount: CostAmount
    line_item: str | None = None
    """`<base model>, input|output|training tokens|training hours`, or `capture storage`, when grouped by line
    item."""
    project_id: str | None = None


class CostsLineItem(CostsResult):
    """A line item of a bucket's cost, with what it counts."""

    quantity: float
    quantity_unit: str
    """`tokens`, `hours` or `GB-months` (bytes kept in capture)."""


ResultT = TypeVar("ResultT", bound=OpenAIBaseModel)


class Bucket(OpenAIBaseModel, Generic[ResultT]):
    """One time bucket `[start_time, end_time)` (Unix seconds); empty buckets are listed too."""

    object: Literal["bucket"] = "bucket"
    start_time: int
    end_time: int
    results: list[SerializeAsAny[ResultT]] = Field(default_factory=list)
    """Serialized as what each is (a `CostsLineItem` keeps its quantity in a page of `CostsResult`s)."""


class UsagePage(OpenAIBaseModel, Generic[ResultT]):
    """A page of buckets; `next_page` is the cursor of the next (the start time of its first bucket)."""

    object: Literal["page"] = "page"
    data: list[Bucket[ResultT]]
    has_more: bool
    next_page: str | None = None
