"""Names of the Tinker API's things: model ids, `tinker://` paths, blob keys and served model ids.

A training model's id is `<session id>:train:<model seq id>`, the id the SDK itself derives when it creates
a model by loading a checkpoint. Checkpoints are `tinker://<model id>/weights/<name>` (training state) and
`tinker://<model id>/sampler_weights/<name>` (an adapter to sample from); a sampler checkpoint is also the
OpenAI model `ft:<base>:<org>:tinker-<name>:<model id>`, usable in `/v1/chat/completions`.
"""

from __future__ import annotations

import re

RUN_TINKER_MODEL = "run_tinker_model"
"""The worker's wake-up for a training model no worker holds (`gateway.worker.main.run_tinker_model`)."""
SEGMENT = {"training": "weights", "sampler": "sampler_weights"}
KIND = {segment: kind for kind, segment in SEGMENT.items()}
_NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


def model_id_of(session_id: str, model_seq_id: int) -> str:
    return f"{session_id}:train:{model_seq_id}"


def tinker_path(model_id: str, kind: str, name: str) -> str:
    return f"tinker://{model_id}/{SEGMENT[kind]}/{name}"


def parse_tinker_path(path: str) -> tuple[str, str, str] | None:
    """`(model id, kind, name)` of a `tinker://` checkpoint path, or None when it is not one."""
    if not path.startswith("tinker://"):
        return None
    parts = path[len("tinker://") :].split("/")
    if len(parts) != 3 or parts[1] not in KIND or not valid_name(parts[2]):
        return None
    return parts[0], KIND[parts[1]], parts[2]


def valid_name(name: str) -> bool:
    return bool(_NAME.match(name)) and name not in (".", "..")


def checkpoint_key(org_id: str, model_id: str, segment: str, name: str) -> str:
    """The blob-store key of a checkpoint directory."""
    return f"tinker/{org_id}/{model_id.replace(':', '_')}/{segment}/{name}"


def served_model_id(base_model: str, org_id: str, model_id: str, name: str) -> str:
    return f"ft:{base_model}:{org_id}:tinker-{name}:{model_id.replace(':', '-')}"
