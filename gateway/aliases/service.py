"""Aliases: the naming rule, what an alias may point at, and what it serves now.

The rule: an alias name is either a plain name (`[A-Za-z0-9][A-Za-z0-9._-]{0,63}`, not a version id's shape
`v-` + 24 hex digits, not a base model's name), or `<model id>:latest` where `<model id>` is one of the
organisation's fine-tuned models. Model ids never take either shape, so a name is never both an alias and a
model. An alias points at a model, never at another alias (400 `alias_loop`): requests follow one alias at
most, and no chain or loop can form.

Moving an alias commits before `POST` answers; requests read aliases from the database when admitted
(`gateway.serving.targets.resolve`), so every request admitted after the answer is served by the new model,
on this gateway and every other one.
"""

from __future__ import annotations

from gateway.aliases import store
from gateway.aliases.protocol import Alias, AliasWrite
from gateway.aliases.store import AliasRow
from gateway.deps import Resources
from gateway.errors import APIError, InvalidRequest, not_found
from gateway.models import store as models_store
from gateway.serving import targets
from gateway.serving.versions import is_version
from gateway.tenancy.keys import Principal
from gateway.timeutil import ts


async def _check_name(res: Resources, who: Principal, name: str) -> None:
    """A 400 `invalid_value` for a name the rule (module docstring) refuses."""
    if name.endswith(targets.LATEST):
        model_id = name[: -len(targets.LATEST)]
        if await models_store.get(res.pool, org_id=who.organization_id, model_id=model_id) is None:
            raise InvalidRequest(
                f"Invalid alias name '{name}': a name ending ':latest' must extend one of your fine-tuned "
                f"model ids, and '{model_id}' is not one.",
                param="name",
                code="invalid_value",
            )
        return
    if name in res.settings.base_models or is_version(name) or not targets.may_be_alias(name):
        raise InvalidRequest(
            f"Invalid alias name '{name}': use 1-64 letters, digits, '.', '_' or '-' (starting with a letter "
            "or digit) that are not a base model's name or a version id, or '<fine-tuned model id>:latest'.",
            param="name",
            code="invalid_value",
        )


async def _alias(res: Resources, who: Principal, row: AliasRow) -> Alias:
    try:
        target = await targets.resolve(
            res.settings, res.models, res.pool, who.organization_id, row.model, aliases=False
        )
        version: str | None = target.served_version
    except APIError:
        version = None
    return Alias(
        name=row.name,
        model=row.model,
        version=version,
        created_at=ts(row.created_at) or 0,
        updated_at=ts(row.updated_at) or 0,
    )


async def write(res: Resources, who: Principal, body: AliasWrite) -> Alias:
    """Create or move an alias: its name checked, its model one of the caller's (404 `model_not_found`
    otherwise, as for a request naming it), never an alias (400 `alias_loop`)."""
    await _check_name(res, who, body.name)
    org_id = who.organization_id
    if body.model == body.name or await store.get(res.pool, org_id=org_id, name=body.model) is not None:
        raise InvalidRequest(
            f"Alias '{body.name}' cannot point at alias '{body.model}': an alias points at a model (a "
            "fine-tuned model, a checkpoint, a version id or a base model), never at another alias.",
            param="model",
            code="alias_loop",
        )
    await targets.resolve(res.settings, res.models, res.pool, org_id, body.model, aliases=False)
    row = await store.upsert(res.pool, org_id=org_id, name=body.name, model=body.model)
    return await _alias(res, who, row)


async def get(res: Resources, who: Principal, name: str) -> Alias:
    row = await store.get(res.pool, org_id=who.organization_id, name=name)
    if row is None:
        raise not_found("alias", name, param="name", code="alias_not_found")
    return await _alias(res, who, row)


async def list_all(res: Resources, who: Principal) -> list[Alias]:
    rows = await store.list_for_org(res.pool, org_id=who.organization_id)
    return [await _alias(res, who, row) for row in rows]


async def delete(res: Resources, who: Principal, name: str) -> None:
    if await store.delete(res.pool, org_id=who.organization_id, name=name) is None:
        raise not_found("alias", name, param="name", code="alias_not_found")
