"""The one settings object. Every value comes from a `TUNEGATE_*` environment variable or its default.

Nothing else in the project reads the environment: processes build a `Settings` once and pass it down.
`Settings` serves five processes (gateway, worker, engine, CLI, trainer), so its fields are written by
concern, one class a module: storage, the HTTP server, limits, serving, training, sandboxes, metering and
Tinker. `Settings` inherits them all, so every field stays flat (`settings.engine_max_loras`,
`TUNEGATE_ENGINE_MAX_LORAS`); what spans concerns (the data dir's base-model registry, the admin key
stored there, the venv root) is defined here.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from envsdk.venvs import VenvBuilder
from gateway.settings.limits import LimitSettings
from gateway.settings.metering import MeteringSettings, ModelPrice
from gateway.settings.sandbox import SandboxSettings
from gateway.settings.server import ServerSettings
from gateway.settings.serving import BASE_MODELS_FILE, LORA_RANKS, BaseModelConfig, ServingSettings
from gateway.settings.storage import StorageSettings
from gateway.settings.tinker import TinkerSettings
from gateway.settings.training import TrainingSettings

__all__ = [
    "BASE_MODELS_FILE",
    "GROUPS",
    "LORA_RANKS",
    "BaseModelConfig",
    "LimitSettings",
    "MeteringSettings",
    "ModelPrice",
    "SandboxSettings",
    "ServerSettings",
    "ServingSettings",
    "Settings",
    "StorageSettings",
    "TinkerSettings",
    "TrainingSettings",
    "settings_env",
]


class Settings(
    StorageSettings,
    ServerSettings,
    LimitSettings,
    ServingSettings,
    TrainingSettings,
    SandboxSettings,
    MeteringSettings,
    TinkerSettings,
    BaseSettings,
):
    """Settings of every tunegate process (gateway, worker, engine, CLI)."""

    model_config = SettingsConfigDict(env_prefix="TUNEGATE_", env_nested_delimiter="__", extra="ignore")

    @model_validator(mode="after")
    def _registered_base_models(self) -> Settings:
        """Add the base models registered in the data dir (`tunegate models add`: a folder, and the hub id it
        came from, as its `tokenizer`) to those configured."""
        try:
            registered = json.loads((self.data_dir / BASE_MODELS_FILE).read_text())
        except (OSError, ValueError):
            return self
        if isinstance(registered, dict):
            for name, entry in registered.items():
                if name not in self.base_models and isinstance(entry, dict) and entry.get("path"):
                    tokenizer = entry.get("tokenizer")
                    self.base_models[name] = BaseModelConfig(path=Path(entry["path"]), tokenizer=tokenizer)
        return self

    def venv_builder(self) -> VenvBuilder:
        """The builder of environment packages' venvs (`env_venv_*`), for `envsdk`."""
        return VenvBuilder(
            root=self.env_venv_dir or self.data_dir / "venvs",
            timeout_s=self.env_venv_build_timeout_s,
            max_bytes=self.env_venv_max_bytes,
        )

    def base_model_path(self, model_id: str) -> Path:
        """Local directory of a configured base model."""
        entry = self.base_models[model_id]
        if entry.path is not None:
            return entry.path
        return self.data_dir / "models" / model_id

    def tokenizer_of(self, model_id: str) -> str:
        """Where clients load a base model's tokenizer from: its `tokenizer`, else its directory."""
        return self.base_models[model_id].tokenizer or str(self.base_model_path(model_id))

    def admin_key_value(self) -> str | None:
        """The admin key, from the settings or from the data dir where `tunegate up` stored it."""
        if self.admin_key is not None:
            return self.admin_key.get_secret_value()
        stored = self.data_dir / "admin_key"
        if stored.exists():
            return stored.read_text().strip()
        return None


def settings_env(settings: Settings) -> dict[str, str]:
    """`TUNEGATE_*` variables that recreate these settings in a child process (every field, so a child
    never falls back to a default its parent overrode)."""
    env: dict[str, str] = {}
    for name in Settings.model_fields:
        value = getattr(settings, name)
        if value is None:
            continue
        if isinstance(value, SecretStr):
            text = value.get_secret_value()
        elif isinstance(value, dict | list):
            text = json.dumps(
                {k: v.model_dump(mode="json") if isinstance(v, BaseModel) else v for k, v in value.items()}
                if isinstance(value, dict)
                else value
            )
        else:
            text = str(value)
        env[f"TUNEGATE_{name.upper()}"] = text
    return env


GROUPS: tuple[type[BaseModel], ...] = tuple(base for base in Settings.__bases__ if base is not BaseSettings)
"""The concerns `Settings` is made of, in the order the settings reference lists them (its bases')."""
