"""Names of the Tinker API's things: session, model and sampler ids, `tinker://` paths, blob keys and
served model ids -- and the one policy for the ids a client names.

A session id is minted by this server (`ts-` and 24 letters and digits). A training model's id is
`<session id>:train:<model seq id>` and a sampling session's `<session id>:sample:<seq id>`, the ids the SDK
itself derives; the session must be one of the caller's organisation's own (checked by
`gateway.tinker.owned`), so every id is made of a value this server minted and a number, and no
organisation can name, or take, an id in another's session. Checkpoints are
`tinker://<model id>/weights/<name>` (training state) and `tinker://<model id>/sampler_weights/<name>` (an
adapter to sample from); a sampler checkpoint is also the OpenAI model
`ft:<base>:<org>:tinker-<name>:<model id>`, usable in `/v1/chat/completions`.

Blob keys and working directories are built only from values checked here (`checkpoint_key` refuses any
other), and the blob store refuses a key that leaves it besides (`gateway.blobstore`).
"""

from __future__ import annotations

import re

RUN_TINKER_MODEL = "run_tinker_model"
"""The worker's wake-up for a training model no worker holds (`gateway.worker.main.run_tinker_model`)."""
SEGMENT = {"training": "weights", "sampler": "sampler_weights"}
KIND = {segment: kind for kind, segment in SEGMENT.items()}
IDLE_SEGMENT = "idle"
"""The segment of the state an idle holder saves before it lets its model go."""
MAX_SEQ_ID = 2**31 - 1
"""Largest `model_seq_id` or `sampling_session_seq_id` (the SDK counts from 0 in each session)."""

_SESSION = r"ts-[A-Za-z0-9]{1,64}"
_SEQ = r"(?:0|[1-9][0-9]{0,9})"
_SESSION_ID = re.compile(rf"^{_SESSION}$")
_MODEL_ID = re.compile(rf"^{_SESSION}:train:{_SEQ}$")
_SAMPLER_ID = re.compile(rf"^{_SESSION}:sample:{_SEQ}$")
_REQUEST_ID = re.compile(r"^tr-[A-Za-z0-9]{1,64}$")
_ORG_ID = re.compile(r"^org-[A-Za-z0-9]{1,64}$")
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


def valid_session_id(session_id: str) -> bool:
    """Whether `session_id` has the shape of a session id this server mints (not whether it exists)."""
    return bool(_SESSION_ID.match(session_id))


def valid_model_id(model_id: str) -> bool:
    return bool(_MODEL_ID.match(model_id))


def valid_sampler_id(sampler_id: str) -> bool:
    return bool(_SAMPLER_ID.match(sampler_id))


def valid_request_id(request_id: str) -> bool:
    """Whether `request_id` has the shape of a request (future) id this server mints."""
    return bool(_REQUEST_ID.match(request_id))


def valid_seq_id(seq_id: int) -> bool:
    return 0 <= seq_id <= MAX_SEQ_ID


def model_id_of(session_id: str, model_seq_id: int) -> str:
    """The id of the training model `model_seq_id` of a session; ValueError for a malformed part."""
    if not valid_session_id(session_id) or not valid_seq_id(model_seq_id):
        raise ValueError(f"not a session id and model seq id: {session_id!r}, {model_seq_id!r}")
    return f"{session_id}:train:{model_seq_id}"


def sampler_id_of(session_id: str, sampling_session_seq_id: int) -> str:
    """The id of the sampling session `sampling_session_seq_id` of a session; ValueError for a malformed
    part."""
    if not valid_session_id(session_id) or not valid_seq_id(sampling_session_seq_id):
        raise ValueError(f"not a session id and sampler seq id: {session_id!r}, {sampling_session_seq_id!r}")
    return f"{session_id}:sample:{sampling_session_seq_id}"


def tinker_path(model_id: str, kind: str, name: str) -> str:
    return f"tinker://{model_id}/{SEGMENT[kind]}/{name}"


def parse_tinker_path(path: str) -> tuple[str, str, str] | None:
    """`(model id, kind, name)` of a `tinker://` checkpoint path, or None when it is not one (a model id
    or a name of any other shape included)."""
    if not path.startswith("tinker://"):
        return None
    parts = path[len("tinker://") :].split("/")
    if len(parts) != 3 or not valid_model_id(parts[0]) or parts[1] not in KIND or not valid_name(parts[2]):
        return None
    return parts[0], KIND[parts[1]], parts[2]


def valid_name(name: str) -> bool:
    return bool(_NAME.match(name)) and name not in (".", "..")


def checkpoint_key(org_id: str, model_id: str, segment: str, name: str) -> str:
    """The blob-store key of a checkpoint directory: `tinker/<org>/<model id, ':' as '_'>/<segment>/<name>`.

    Every part is checked (ValueError otherwise): a key is never made of a string of another shape, even
    one that reached a row before ids were checked."""
    if not _ORG_ID.match(org_id) or not valid_model_id(model_id):
        raise ValueError(f"not an organisation and model id: {org_id!r}, {model_id!r}")
    if segment not in KIND and segment != IDLE_SEGMENT:
        raise ValueError(f"not a checkpoint segment: {segment!r}")
    if not valid_name(name):
        raise ValueError(f"not a checkpoint name: {name!r}")
    return f"tinker/{org_id}/{model_id.replace(':', '_')}/{segment}/{name}"


def workdir_key(model_seq: int) -> str:
    """The blob-store key of a training process's working directory (its `session.log`): the model's row
    number, which the database assigns."""
    return f"work/tinker/{int(model_seq)}"


def served_model_id(base_model: str, org_id: str, model_id: str, name: str) -> str:
    return f"ft:{base_model}:{org_id}:tinker-{name}:{model_id.replace(':', '-')}"
