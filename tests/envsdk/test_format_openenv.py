"""OpenEnv's format (`envsdk.formats.openenv`) through the real sandbox: the package's own FastAPI server
(openenv-core 0.3.0's `create_app`, installed in the package's venv) runs inside the sandbox on a private
Unix socket, and the rewards are those its environment's `step` returns."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest

from envsdk.errors import PackageError
from envsdk.manifest import parse_manifest
from envsdk.rollout import run_episode
from envsdk.sandbox import Sandbox, probe_backend
from envsdk.types import StopReason
from envsdk.venvs import VenvBuilder

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "envs" / "openenv_guess"


@pytest.fixture(params=["bwrap", "unshare"])
def backend(request: pytest.FixtureRequest) -> str:
    if not probe_backend(request.param):
        pytest.skip(f"the {request.param} backend does not work here")
    return str(request.param)


TASK = {"messages": [{"role": "user", "content": "Guess my number."}], "target": 7}


def call(name: str, arguments: dict[str, Any], call_id: str) -> dict[str, Any]:
    function = {"name": name, "arguments": json.dumps(arguments)}
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": call_id, "type": "function", "function": function}],
    }


def scripted(*turns: dict[str, Any]) -> Any:
    played = iter(turns)

    def policy(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> dict[str, Any]:
        return next(played)

    return policy


def test_an_openenv_server_plays_episodes_in_the_sandbox(backend: str, builder: VenvBuilder) -> None:
    with Sandbox(EXAMPLE, backend=backend, venvs=builder) as sandbox:
        described = sandbox.describe()
        assert described["kind"] == "tool" and described["max_turns"] == 3 and described["scores_truncated"]
        (tool,) = described["tools"]  # the Action's schema from the server's /schema, less its metadata
        assert tool["function"]["name"] == "guess"
        parameters = tool["function"]["parameters"]
        assert set(parameters["properties"]) == {"guess"} and parameters["required"] == ["guess"]
        assert "1 to 10" in parameters["properties"]["guess"]["description"]

        # a tool call, then a plain reply (the [openenv] text_field): both are Actions stepped on the server
        result = run_episode(
            sandbox,
            TASK,
            scripted(call("guess", {"guess": "3"}, "c1"), {"role": "assistant", "content": "7"}),
        )
        assert result.stop_reason == StopReason.DONE and result.turns == 2, result.error
        assert (
            "I am thinking of a number from 1 to 10." in result.messages[0]["content"]
        )  # reset's observation
        feedback = json.loads(result.messages[2]["content"])
        assert result.messages[2]["role"] == "tool" and feedback == {"message": "higher", "guesses_left": 2}
        assert result.reward == pytest.approx(
            1.1
        )  # the server's step rewards: 0.1 (a number) + 1.0 (correct)
        assert result.info["metrics"]["openenv/steps"] == 2

        # a JSON reply is an Action; an Action the server refuses is answered with its error, reward 0; the
        # package's max_turns (3) ends the episode before the environment's own end (three guesses)
        result = run_episode(
            sandbox,
            {**TASK, "target": 2},
            scripted(
                call("guess", {"number": 5}, "c1"),
                {"role": "assistant", "content": json.dumps({"guess": "9"})},
                call("guess", {"guess": "eight"}, "c2"),
            ),
        )
        assert result.stop_reason == StopReason.MAX_TURNS and result.turns == 3, result.error
        assert result.messages[2]["content"].startswith("error: VALIDATION_ERROR")
        assert json.loads(result.messages[4]["content"])["message"] == "lower"
        assert result.reward == pytest.approx(0.1)  # 0 (refused) + 0.1 + 0 (not a number)
        assert result.info["metrics"]["openenv/steps"] == 2  # the refused Action was not a step

        # concurrent episodes are sessions of their own on the server, each with its own environment
        first, second = sandbox.reset(TASK), sandbox.reset({**TASK, "target": 2})
        answer = {"role": "assistant", "content": "2"}
        assert sandbox.step(second["episode_id"], answer)["reward"] == 1.0  # the second's target
        assert sandbox.step(first["episode_id"], answer)["reward"] == pytest.approx(0.1)  # not the first's

        # a reply that is no Action ends the episode
        no_action = run_episode(sandbox, TASK, scripted({"role": "assistant", "content": "   "}))
        assert no_action.stop_reason == StopReason.DONE and no_action.reward == 0.0


PROBE_ENV = """
import socket

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class ConnectAction(Action):
    port: int


class ConnectObservation(Observation):
    outcome: str = ""


class ProbeEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def reset(self, seed=None, episode_id=None, **kwargs):
        return ConnectObservation(outcome="ready")

    def step(self, action):
        try:
            socket.create_connection(("127.0.0.1", action.port), timeout=2).close()
            outcome = "connected"
        except OSError as exc:
            outcome = type(exc).__name__
        return ConnectObservation(outcome=outcome, reward=1.0, done=True)

    @property
    def state(self):
        return State()


app = create_app(ProbeEnvironment, ConnectAction, ConnectObservation, env_name="probe", max_concurrent_envs=4)
"""


def test_the_sandboxed_server_cannot_reach_the_host(
    tmp_path: Path, backend: str, builder: VenvBuilder
) -> None:
    package = tmp_path / "probe"
    (package / "server").mkdir(parents=True)
    (package / "server" / "__init__.py").write_text("")
    (package / "server" / "app.py").write_text(PROBE_ENV)
    manifest = (EXAMPLE / "environment.toml").read_text()  # the same exact set: the same venv
    manifest = manifest.replace('name = "openenv-guess"', 'name = "openenv-probe"')
    (package / "environment.toml").write_text(
        manifest.replace('tool_name = "guess"', 'tool_name = "connect"')
    )
    with socket.socket() as listener, Sandbox(package, backend=backend, venvs=builder) as sandbox:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        result = run_episode(sandbox, {"prompt": "connect"}, scripted(call("connect", {"port": port}, "c1")))
        assert result.reward == 1.0, result.error  # the step ran on the sandboxed server...
        outcome = json.loads(result.messages[-1]["content"])["outcome"]
        # ...whose loopback, if any, is not the host's
        assert outcome in {"ConnectionRefusedError", "OSError"}


def test_the_openenv_options_are_checked() -> None:
    manifest = (EXAMPLE / "environment.toml").read_text()
    assert parse_manifest(manifest).format_options() == {"tool_name": "guess", "text_field": "guess"}
    with pytest.raises(PackageError, match=r"openenv\.tool_name"):
        parse_manifest(manifest.replace('tool_name = "guess"', 'tool_name = "a guess"'))
    with pytest.raises(PackageError, match=r"openenv\.port"):
        parse_manifest(manifest.replace('tool_name = "guess"', "port = 8000"))
