"""What the Tinker test modules share: an organisation of the module's own gateway (`gw`, made in each
module by `tests.support.fixtures.gateway_fixture`) and a `tinker` SDK client of it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import tinker

from tests.support.stack import Admin, GatewayServer, Tenant


@pytest.fixture(scope="module")
def org(gw_admin: Admin, request: pytest.FixtureRequest) -> Tenant:
    """An organisation named after the module."""
    return gw_admin.tenant(request.module.__name__.rsplit(".", 1)[-1].replace("_", "-"))


@pytest.fixture(scope="module")
def service(gw: GatewayServer, org: Tenant) -> Iterator[tinker.ServiceClient]:
    """The SDK's client with `org`'s key; closed at the end (its heartbeats stop before the gateway does)."""
    with tinker.ServiceClient(base_url=gw.url, api_key="tml-" + org.key) as client:
        yield client
