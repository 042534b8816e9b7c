"""OpenEnv's format (an environment's own FastAPI server, `openenv.core.env_server.create_app`) as a
tunegate tool environment, with the package's code unchanged.

OpenEnv's contract (openenv-core 0.3.0): the package's ASGI app (`server/app.py`'s
`app = create_app(MyEnvironment, MyAction, MyObservation, ...)`, as `openenv init`'s template writes it)
serves `GET /schema` (the Action's JSON schema), `POST /reset`, `POST /step`, `GET /state` and `WS /ws`.

How it runs here: the app is served by uvicorn in a daemon thread of the sandboxed process, on a Unix socket
in the sandbox's own scratch (`/tmp`), so nothing outside the sandbox can reach it and it reaches nothing
(the sandbox has no network). `/schema` is read over HTTP with `http.client`. Episodes use the `/ws`
WebSocket sessions, as OpenEnv's own `EnvClient` does: openenv 0.3.0's HTTP `/reset` and `/step` make a
fresh environment per request (stateless), so a multi-step episode needs a session; each episode is one
session, with its own environment instance on the server (the app's `max_concurrent_envs` caps how many
run at once). The WebSocket client is the `websockets` package that uvicorn needs to serve `/ws` anyway.

Mapping: the Action schema (less OpenEnv's own `metadata` field) is one tool; each of the model's calls to
it is one `step` with the arguments as the Action, answered by a `tool` message holding the observation's
JSON. A reply without a tool call is an Action too when it is a JSON object, or, with `text_field` set,
`{text_field: reply}`; its observation is the next user message. Any other reply ends the episode. The
reset observation is appended to the task's last user message; the task's other columns go to
`reset(**data)` (OpenEnv passes those the environment's `reset` accepts). A step's reward is the
observation's `reward` (None is 0); the episode's reward is the sum. A reply cut off by the completion
budget is still stepped (as text; its cut-off tool call is not run), as TRL's OpenEnv examples step every
generation. An Action the server refuses
(validation error) is reported to the model as the step's answer, reward 0.

This module is stdlib-only at import time: it runs inside the sandbox; uvicorn and websockets are imported
from the package's venv when the first environment is made.
"""

from __future__ import annotations

import copy
import http.client
import json
import os
import socket
import tempfile
import threading
import time
from typing import Any, ClassVar

from envsdk.env import MultiTurnEnv, task_messages
from envsdk.formats.trl import _append_to_last_user
from envsdk.types import Message, StepResult

PROMPT_KEYS = frozenset({"messages", "prompt"})
"""Task keys that make the prompt rather than `reset`'s data."""
RESERVED_FIELDS = frozenset({"metadata"})
"""Fields of OpenEnv's base `Action` that are not the model's to fill."""


class ActionRefused(Exception):
    """The server answered a WebSocket message with an error (an invalid Action, a failed step)."""


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.path)
        self.sock = sock


class OpenEnvServer:
    """The package's ASGI app, served by uvicorn in a daemon thread on a Unix socket of the process."""

    def __init__(self, app: Any, *, timeout_s: float = 30.0) -> None:
        import uvicorn  # from the package's venv

        self.timeout_s = timeout_s
        self.path = os.path.join(tempfile.mkdtemp(prefix="openenv-"), "server.sock")
        config = uvicorn.Config(app, uds=self.path, log_level="warning", lifespan="on", access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="openenv-server", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the OpenEnv server stopped while starting (see the sandbox's stderr)")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the OpenEnv server did not start within {timeout_s:g} s")
            time.sleep(0.01)

    def get(self, path: str) -> Any:
        """The JSON body of `GET path`."""
        conn = _UnixConnection(self.path, self.timeout_s)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            body = response.read()
        finally:
            conn.close()
        if response.status != 200:
            raise RuntimeError(f"GET {path} answered {response.status}: {body[:200]!r}")
        return json.loads(body)

    def session(self) -> Any:
        """A new `/ws` session (one environment instance on the server)."""
        from websockets.sync.client import unix_connect  # from the package's venv

        return unix_connect(self.path, "ws://localhost/ws", open_timeout=self.timeout_s, max_size=None)


def action_tool(schema: dict[str, Any], name: str) -> dict[str, Any]:
    """The OpenAI tool whose arguments are the Action of `schema` (its JSON schema from `/schema`)."""
    parameters = copy.deepcopy(schema)
    parameters.pop("title", None)
    description = str(parameters.pop("description", "") or f"Take one step with a {schema.get('title')}.")
    properties = parameters.get("properties") or {}
    parameters["properties"] = {k: v for k, v in properties.items() if k not in RESERVED_FIELDS}
    parameters["required"] = [k for k in parameters.get("required") or [] if k not in RESERVED_FIELDS]
    parameters.setdefault("type", "object")
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }


def _render(observation: Any) -> str:
    return observation if isinstance(observation, str) else json.dumps(observation)


def openenv_environment(
    app: Any, *, tool_name: str = "step", text_field: str | None = None, name: str | None = None
) -> type[MultiTurnEnv]:
    """A tool environment that plays the OpenEnv server `app` (an ASGI app made by `create_app`)."""
    if not callable(app):
        raise TypeError("the entrypoint must be the ASGI app that openenv's create_app returns")
    shared: dict[str, Any] = {}
    lock = threading.Lock()

    def server() -> OpenEnvServer:
        with lock:
            if "server" not in shared:
                shared["server"] = OpenEnvServer(app)
                shared["tool"] = action_tool(shared["server"].get("/schema")["action"], tool_name)
            found: OpenEnvServer = shared["server"]
            return found

    class OpenEnvEnvironment(MultiTurnEnv):
        kind: ClassVar[str] = "tool"
        scores_truncated: ClassVar[bool] = True  # a reply cut off by the budget is still stepped, as
        # TRL's OpenEnv examples step every generation (a cut-off tool call is not run)

        def __init__(self, config: dict[str, Any] | None = None) -> None:
            super().__init__(config)
            self.server = server()
            self.ws: Any = None
            self.info: dict[str, Any] = {}

        def tool_schemas(self) -> list[dict[str, Any]]:
            return [copy.deepcopy(shared["tool"])]

        def _send(self, message: dict[str, Any]) -> dict[str, Any]:
            self.ws.send(json.dumps(message))
            answer = json.loads(self.ws.recv(timeout=self.server.timeout_s))
            if answer.get("type") == "error":
                data = answer.get("data") or {}
                raise ActionRefused(f"{data.get('code', 'error')}: {data.get('message', '')}".strip())
            result: dict[str, Any] = answer.get("data") or {}
            return result

        def close(self) -> None:
            """End the episode's session (its environment on the server is closed and freed)."""
            ws, self.ws = self.ws, None
            if ws is None:
                return
            try:
                ws.send(json.dumps({"type": "close"}))
            except Exception:  # the session is going away either way
                pass
            ws.close()

        def __del__(self) -> None:  # an episode the host dropped unfinished (max_turns) frees its session
            try:
                self.close()
            except Exception:
                pass

        async def reset(self, task: dict[str, Any]) -> list[Message]:
            self.close()
            self.info = {"metrics": {"openenv/steps": 0.0}}
            self.ws = self.server.session()
            data = {k: v for k, v in task.items() if k not in PROMPT_KEYS}
            result = self._send({"type": "reset", "data": data})
            return _append_to_last_user(task_messages(task), "\n" + _render(result.get("observation")))

        def _step(self, action: Any) -> tuple[str, float, bool]:
            if not isinstance(action, dict):
                return "error: the action must be a JSON object", 0.0, False
            try:
                result = self._send({"type": "step", "data": action})
            except ActionRefused as exc:
                return f"error: {exc}", 0.0, False
            self.info["metrics"]["openenv/steps"] += 1
            reward = result.get("reward")
            return _render(result.get("observation")), float(reward or 0.0), bool(result.get("done"))

        def _call(self, call: dict[str, Any]) -> tuple[Message, float, bool]:
            """One tool call: its `tool` message, reward and done."""
            function = call.get("function") or {}
            content, reward, done = (
                f"error: unknown tool {function.get('name')!r}; use {tool_name!r}",
                0.0,
                False,
            )
            if function.get("name") == tool_name:
                arguments = function.get("arguments") or "{}"
                try:
                    action = json.loads(arguments) if isinstance(arguments, str) else arguments
                    content, reward, done = self._step(action)
                except ValueError as exc:
                    content = f"error: the arguments are not JSON: {exc}"
            return {"role": "tool", "tool_call_id": call.get("id", ""), "content": content}, reward, done

        async def step(self, assistant_message: Message) -> StepResult:
            calls = assistant_message.get("tool_calls") or []
            observation: list[Message] = []
            total, done = 0.0, False
            for call in calls:
                message, reward, done = self._call(call)
                observation.append(message)
                total += reward
                if done:
                    break
            if not calls:
                action = self._reply_action(assistant_message.get("content"))
                if action is None:  # a plain answer that is no Action ends the episode, as in a ToolEnv
                    done = True
                else:
                    content, total, done = self._step(action)
                    if not done:
                        observation.append({"role": "user", "content": content})
            if done:
                self.close()
            return StepResult(observation=observation, reward=total, done=done, info=copy.deepcopy(self.info))

        def _reply_action(self, content: Any) -> dict[str, Any] | None:
            text = content if isinstance(content, str) else ""
            try:
                parsed = json.loads(text)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                return parsed
            if text_field and text.strip():
                return {text_field: text.strip()}
            return None

    OpenEnvEnvironment.__name__ = OpenEnvEnvironment.__qualname__ = name or "OpenEnv"
    return OpenEnvEnvironment
