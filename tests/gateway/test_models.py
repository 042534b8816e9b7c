"""Models API: base models from the registry, fine-tuned models only for their organisation."""

from __future__ import annotations

import openai
import pytest

from tests.support.engine import register_model
from tests.support.stack import GatewayServer, Tenant


def test_models_list_retrieve_delete_and_tenancy(
    stack: GatewayServer, tenant: Tenant, other_tenant: Tenant
) -> None:
    model_id = f"ft:tiny-chat:{tenant.org_id}:mine:ftjob-models1"
    register_model(stack.settings.database_url or "", tenant.org_id, model_id, "/x")

    listed = tenant.client.models.list().data
    assert [m.id for m in listed] == ["tiny-chat", model_id]
    assert all(m.object == "model" and isinstance(m.created, int) and m.owned_by for m in listed)
    base = tenant.client.models.retrieve("tiny-chat")
    assert base.id == "tiny-chat" and base.owned_by == "tunegate"
    mine = tenant.client.models.retrieve(model_id)  # ':' in the path round-trips
    assert mine.id == model_id and mine.owned_by == tenant.org_id

    assert model_id not in [m.id for m in other_tenant.client.models.list().data]
    for call in (other_tenant.client.models.retrieve, other_tenant.client.models.delete):
        with pytest.raises(openai.NotFoundError) as err:
            call(model_id)
        assert err.value.code == "model_not_found"
    with pytest.raises(openai.PermissionDeniedError):
        tenant.client.models.delete("tiny-chat")
    with pytest.raises(openai.NotFoundError):
        tenant.client.models.retrieve("no-such-model")

    deleted = tenant.client.models.delete(model_id)
    assert deleted.id == model_id and deleted.deleted is True
    with pytest.raises(openai.NotFoundError):
        tenant.client.models.retrieve(model_id)
    assert [m.id for m in tenant.client.models.list().data] == ["tiny-chat"]
