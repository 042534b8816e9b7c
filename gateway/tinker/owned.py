"""What a Tinker request names, resolved to the caller's own rows: the one place the API's ids are checked.

Another organisation's model, session, sampler or checkpoint answers 404, exactly like an unknown one. The
ids a client names follow one policy (`gateway.tinker.paths`): a session it names must be one of its
organisation's own (else 404, as an unknown one), its models and samplers live in that session, and an id it
already uses there is refused (400 `duplicate_id`); an id of another shape is unknown (404), a `tinker://`
path of another shape or a sequence number out of range is a bad request (400).
"""

from __future__ import annotations

from gateway.deps import Resources
from gateway.errors import InvalidRequest, not_found
from gateway.tenancy.keys import Principal
from gateway.tinker import store
from gateway.tinker.paths import MAX_SEQ_ID, parse_tinker_path, valid_model_id, valid_seq_id, valid_session_id
from gateway.tinker.rows import ModelCheckpointRow, TrainingModelRow


async def own_session(res: Resources, who: Principal, session_id: str, *, param: str = "session_id") -> None:
    """404 unless `session_id` is a session of the caller's organisation (another's answers as an unknown)."""
    if not valid_session_id(session_id) or not await store.own_session(
        res.pool, session_id=session_id, org_id=who.organization_id
    ):
        raise not_found("session", session_id, param=param)


def seq_id(value: int, param: str) -> int:
    """`value`, a sequence number the client counts (of a model or a sampler in its session), or 400."""
    if not valid_seq_id(value):
        message = f"'{param}' must be between 0 and {MAX_SEQ_ID}."
        raise InvalidRequest(message, param=param, code="invalid_value")
    return value


def taken(what: str, ident: str, param: str) -> InvalidRequest:
    """The answer for an id the caller's organisation already uses in its session (the SDK counts ids up from
    0 per session, so only a client that repeats itself meets it; 400, which the SDK does not retry)."""
    return InvalidRequest(
        f"The {what} id '{ident}' is already in use in this session; give another '{param}'.",
        param=param,
        code="duplicate_id",
    )


def known_base(res: Resources, name: str) -> None:
    """400 unless `name` is a base model this server trains and samples."""
    if name not in res.settings.base_models:
        known = ", ".join(sorted(res.settings.base_models))
        raise InvalidRequest(f"Unknown base model '{name}'; this server trains: {known}.", param="base_model")


async def model(res: Resources, who: Principal, model_id: str) -> TrainingModelRow:
    """The caller's training model `model_id`, or 404."""
    row = None
    if valid_model_id(model_id):
        row = await store.get_model(res.pool, model_id=model_id, org_id=who.organization_id)
    if row is None:
        raise not_found("model", model_id, param="model_id")
    return row


async def checkpoint(
    res: Resources, who: Principal, path: str, kind: str | None = None, *, param: str = "path"
) -> ModelCheckpointRow:
    """The caller's checkpoint at the `tinker://` path `path` (the request's field `param`): 400 for a path
    of another shape, 404 for one of no checkpoint of the caller's organisation."""
    parsed = parse_tinker_path(path)
    if parsed is None or (kind is not None and parsed[1] != kind):
        raise InvalidRequest(f"Invalid tinker path {path!r}.", param=param)
    row = await store.get_checkpoint(
        res.pool, org_id=who.organization_id, model_id=parsed[0], kind=parsed[1], name=parsed[2]
    )
    if row is None:
        raise not_found("checkpoint", path, param=param)
    return row
