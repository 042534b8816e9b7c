"""Base models beyond `tiny-chat`: `tunegate models add NAME SOURCE` registers a Hugging Face causal LM.

A registered model is recorded in `<data_dir>/base_models.json` (`{"name": {"path": "/abs/folder"}}`), which
`Settings` reads beside `TUNEGATE_BASE_MODELS`: every process of a stack on that data dir can fine-tune it,
and `tunegate up` serves it on its engine (restart a running stack to load it). A source is a local model
folder, or a hub id (`Qwen/Qwen2.5-0.5B-Instruct`) that is taken from the local Hugging Face cache or, where
the machine has internet, downloaded into it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from gateway.settings import BASE_MODELS_FILE, Settings

logger = logging.getLogger(__name__)

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$")
"""What a base model's name may look like (it becomes the `model` of requests and of `ft:` names)."""
HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


class ModelSourceError(Exception):
    """A model source that cannot be registered; the message says why and what to do."""


def check_model_folder(path: Path) -> dict[str, Any]:
    """The folder's `config.json` once the folder is checked to hold a causal LM with a tokenizer."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ModelSourceError(
            f"{path} is not a Hugging Face model folder: no readable config.json ({exc})"
        ) from None
    architectures = config.get("architectures") or []
    if not any(str(a).endswith("ForCausalLM") for a in architectures):
        raise ModelSourceError(
            f"{path} holds a {', '.join(architectures) or config.get('model_type', 'model')}, not a causal "
            "language model (config.json's architectures name no ...ForCausalLM)"
        )
    if not any((path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise ModelSourceError(f"{path} has no tokenizer (tokenizer.json or tokenizer_config.json)")
    weights = list(path.glob("*.safetensors")) + list(path.glob("*.bin"))
    if not weights:
        raise ModelSourceError(f"{path} has no weights (*.safetensors or *.bin)")
    return dict(config)


def resolve_source(source: str) -> Path:
    """The local folder of `source`: a folder as given, or a hub id from the local cache or the hub."""
    path = Path(source).expanduser()
    if path.exists():
        return path.resolve()
    if not HUB_ID.match(source):
        raise ModelSourceError(f"{source} is neither a folder nor a Hugging Face hub id (owner/name)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
    try:
        return Path(snapshot_download(source, local_files_only=True, allow_patterns=patterns))
    except (LocalEntryNotFoundError, OSError, ValueError):
        pass
    try:
        return Path(snapshot_download(source, allow_patterns=patterns))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as exc:
        raise ModelSourceError(
            f"cannot fetch {source} from the Hugging Face hub ({type(exc).__name__}: {exc}) and it is not in "
            "the local cache; on a machine without internet, download the model elsewhere and pass its "
            "folder instead"
        ) from None


def registered(settings: Settings) -> dict[str, dict[str, Any]]:
    """The models registered in the data dir."""
    try:
        data = json.loads((settings.data_dir / BASE_MODELS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def add_model(settings: Settings, name: str, source: str) -> Path:
    """Register `source` as base model `name` in the data dir; returns the model's folder."""
    if not NAME.match(name) or name.startswith("ft:"):
        raise ModelSourceError(
            f"{name!r} is not a usable model name: letters, digits, '.', '_', '-' and '/', at most 128"
        )
    if name in Settings(data_dir=settings.data_dir).base_models and name not in registered(settings):
        raise ModelSourceError(f"{name} is already a base model of this stack (from its settings)")
    folder = resolve_source(source)
    check_model_folder(folder)
    entries = registered(settings)
    entries[name] = {"path": str(folder)}
    if not Path(source).expanduser().exists():  # a hub id: Tinker clients on other machines load it there
        entries[name]["tokenizer"] = source
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=settings.data_dir, prefix=f".{BASE_MODELS_FILE}.")
    with os.fdopen(fd, "w") as out:
        json.dump(entries, out, indent=2)
    os.replace(tmp, settings.data_dir / BASE_MODELS_FILE)
    logger.info("registered base model %s at %s", name, folder)
    return folder
