"""Admin API shapes: organisations and API keys."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gateway.protocol import OpenAIBaseModel
from gateway.tenancy.store import KeyRow, OrgRow
from gateway.timeutil import ts as _ts


class OrganizationCreate(OpenAIBaseModel):
    name: str = Field(min_length=1, max_length=256)


class Organization(OpenAIBaseModel):
    id: str
    object: Literal["organization"] = "organization"
    name: str
    created_at: int

    @classmethod
    def from_row(cls, row: OrgRow) -> Organization:
        return cls(id=row.id, name=row.name, created_at=_ts(row.created_at) or 0)


class ApiKeyCreate(OpenAIBaseModel):
    name: str | None = Field(default=None, max_length=256)


class ApiKey(OpenAIBaseModel):
    id: str
    object: Literal["organization.api_key"] = "organization.api_key"
    organization_id: str
    name: str | None
    redacted_value: str
    created_at: int
    last_used_at: int | None
    revoked_at: int | None
    kind: str = "user"
    """`user` (made through the admin API), or `eval` / `job`: minted by a worker for one eval run or job."""
    expires_at: int | None = None
    """When a minted key stops working unless its holder renews it (null for people's keys)."""
    key: str | None = None
    """The plaintext key: present only in the response that created it."""

    @classmethod
    def from_row(cls, row: KeyRow, *, key: str | None = None) -> ApiKey:
        return cls(
            id=row.id,
            organization_id=row.organization_id,
            name=row.name,
            redacted_value=row.display_prefix,
            created_at=_ts(row.created_at) or 0,
            last_used_at=_ts(row.last_used_at),
            revoked_at=_ts(row.revoked_at),
            kind=row.kind,
            expires_at=_ts(row.expires_at),
            key=key,
        )
