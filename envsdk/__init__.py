"""envsdk: write, test, pack and safely run tunegate environments.

The authoring API (stdlib only, importable inside the sandbox)::

    from envsdk import SingleTurnEnv, MultiTurnEnv, ToolEnv, StepResult, tool

The host side (pydantic; imported lazily so that ``import envsdk`` stays light)::

    from envsdk import Sandbox, Limits, Maxima, Manifest, inspect_package, safe_extract, pack
    from envsdk import VenvBuilder       # the venvs of packages' pinned requirements
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from envsdk.env import Environment, MultiTurnEnv, SingleTurnEnv, ToolEnv, completion_text, task_messages
from envsdk.errors import EnvSDKError, PackageError, SandboxError
from envsdk.host import EnvHost, InProcessRunner
from envsdk.tools import tool, tool_schema
from envsdk.types import EpisodeResult, Message, RewardResult, StepResult, StopReason

if TYPE_CHECKING:
    from envsdk.archive import inspect_package, pack, safe_extract
    from envsdk.manifest import Limits, Manifest, Maxima, load_manifest
    from envsdk.rollout import run_episode, run_single_turn
    from envsdk.sandbox import Sandbox, detect_backend
    from envsdk.venvs import VenvBuilder

_LAZY = {
    "Sandbox": "envsdk.sandbox",
    "detect_backend": "envsdk.sandbox",
    "Limits": "envsdk.manifest",
    "Manifest": "envsdk.manifest",
    "Maxima": "envsdk.manifest",
    "load_manifest": "envsdk.manifest",
    "inspect_package": "envsdk.archive",
    "safe_extract": "envsdk.archive",
    "pack": "envsdk.archive",
    "run_episode": "envsdk.rollout",
    "run_single_turn": "envsdk.rollout",
    "VenvBuilder": "envsdk.venvs",
}

__all__ = [
    "EnvHost",
    "EnvSDKError",
    "Environment",
    "EpisodeResult",
    "InProcessRunner",
    "Limits",
    "Manifest",
    "Maxima",
    "Message",
    "MultiTurnEnv",
    "PackageError",
    "RewardResult",
    "Sandbox",
    "SandboxError",
    "SingleTurnEnv",
    "StepResult",
    "StopReason",
    "ToolEnv",
    "VenvBuilder",
    "completion_text",
    "detect_backend",
    "inspect_package",
    "load_manifest",
    "pack",
    "run_episode",
    "run_single_turn",
    "safe_extract",
    "task_messages",
    "tool",
    "tool_schema",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'envsdk' has no attribute {name!r}")
