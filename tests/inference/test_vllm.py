"""vLLM as tunegate's engine, for real: the build `scripts/install-vllm` installs, serving the tiny model
under the supervisor (the `vllm_server` fixture), behind a gateway.

- the greedy answers of the base model and of an adapter loaded at run time equal the embedded engine's;
- bad input answers one envelope through the gateway on both engines: a prompt over the context, a model
  the engine does not serve, a missing adapter folder, an adapter rank above `--max-lora-rank` (refused by
  the gateway itself where it knows the limit, mapped from vLLM's answer where it does not);
- a vLLM that dies mid-stream: the client gets an error event, the supervisor starts it again (its engine
  core and worker killed with it), and the next request, for an adapter too, is answered.

Skipped where vLLM is not installed or cannot run. `test_contract.py` holds both engines to one contract.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.settings import BaseModelConfig, Settings
from inference.vllm import VllmUnavailable
from tests.inference.conftest import RunningServer, start_server
from tests.support.data import BASE, MESSAGES
from tests.support.engine import ft_model, make_lora_adapter, resources_of
from tests.support.stack import Admin, GatewayServer, Services, Tenant, admin_of, make_settings
from tests.support.vllm import VLLM_MAX_LORA_RANK, VLLM_MAX_MODEL_LEN
from tunegate.processes import free_port, wait_port
from tunegate.role_processes import EngineProcess
from tunegate.vllm_process import VllmEngineProcess, engine_processes

pytestmark = pytest.mark.timeout(900)  # vLLM's start: three processes import torch and vLLM

UNSERVED = "other-chat"
"""A base model the gateway routes to the engine, which serves no model of that name."""
LONG_PROMPT: Any = [{"role": "user", "content": "a b " * 1100}]
"""2229 tokens of tiny-chat with its chat template (4400 characters): over both engines' context (1024 here;
the model's own is 2048), but under the 13312 characters 1024 tokens of tiny-chat can hold, so only an
engine, which tokenizes it, can tell."""
TOO_LONG = "x" * 20_000
"""More characters than 1024 tokens of tiny-chat can hold (13 characters its longest token): a gateway that
knows the context refuses it by its length alone."""


GATEWAYS = ("embedded", "vllm", "vllm-unsized")
"""The gateways of this module: one on each engine, sized as the engines are (`engine_max_model_len`,
`engine_max_lora_rank`), and one on vLLM that knows nothing of its sizes, as a gateway in front of an
engine it did not start."""
SIZES: dict[str, Any] = {
    "engine_max_model_len": VLLM_MAX_MODEL_LEN,
    "engine_max_lora_rank": VLLM_MAX_LORA_RANK,
}
"""The settings of the sized gateways: what `tunegate up` starts both engines with."""


@pytest.fixture(scope="module")
def embedded_sized(tiny_model_dir: Path) -> Iterator[RunningServer]:
    """The embedded engine held to vLLM's `--max-model-len`, as `tunegate up` starts it with
    `engine_max_model_len`."""
    running = start_server({BASE: str(tiny_model_dir)}, max_loras=4, max_model_len=VLLM_MAX_MODEL_LEN)
    yield running
    running.close()


@pytest.fixture(scope="module")
def gateways(
    services: Services,
    database: str,
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    embedded_sized: RunningServer,
    vllm_server: VllmEngineProcess,
) -> Iterator[dict[str, GatewayServer]]:
    """The `GATEWAYS`, `tiny-chat` and `other-chat` both routed to their engine."""
    started: dict[str, GatewayServer] = {}
    urls = {"embedded": embedded_sized.url, "vllm": vllm_server.url, "vllm-unsized": vllm_server.url}
    try:
        for name in GATEWAYS:
            sized = SIZES if name != "vllm-unsized" else {}
            settings = make_settings(
                data_dir=tmp_path_factory.mktemp(f"{name}-gw"),
                database_url=database,
                redis_url=services.redis_url,
                tiny_model=tiny_model_dir,
                **sized,
            )
            settings.base_models[BASE].upstreams = [urls[name]]
            settings.base_models[UNSERVED] = BaseModelConfig(path=tiny_model_dir, upstreams=[urls[name]])
            started[name] = GatewayServer(settings).start()
        yield started
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture(scope="module")
def rank32_adapter(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_lora_adapter(tiny_model_dir, tmp_path_factory.mktemp("rank32") / "lora", seed=5, rank=32)


def _tenant(gateway: GatewayServer) -> Tenant:
    return admin_of(gateway).tenant("vllm-" + secrets.token_hex(3))


def _error(exc: openai.APIStatusError) -> tuple[int, dict[str, Any]]:
    body = exc.response.json()
    assert set(body) == {"error"}
    return exc.status_code, body["error"]


# ------------------------------------------------------------------------------------- same answers
def test_greedy_answers_match_the_embedded_engine(
    engine_server: RunningServer, vllm_server: VllmEngineProcess, adapter_dirs: list[Path]
) -> None:
    """float32 on both: the same tokens for the base model and for a PEFT adapter loaded at run time."""
    name = "same-" + secrets.token_hex(3)
    answers: dict[str, list[str | None]] = {}
    for engine, url in (("embedded", engine_server.url), ("vllm", vllm_server.url)):
        loaded = httpx.post(
            f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(adapter_dirs[1])}
        )
        assert loaded.status_code == 200, loaded.text
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
        answers[engine] = [
            client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=16, temperature=0)
            .choices[0]
            .message.content
            for model in (BASE, name)
        ]
    assert answers["vllm"] == answers["embedded"]
    assert answers["vllm"][0] != answers["vllm"][1]  # the adapter changes the answer


def test_seeded_requests_that_fill_a_step_leave_the_cpu_build_alive(vllm_server: VllmEngineProcess) -> None:
    """128 seeded requests of 300-token prompts at once: more prompt than one step takes. The CPU build's
    engine died when a seeded prompt was prefilled in parts ("CPU Generator does not use offset"); it is
    started with whole prefills only (`inference.vllm.vllm_command`), so every request is answered."""
    if not vllm_server.install.on_cpu:
        pytest.skip("the CPU build's failure")
    prompt = "word " * 300

    def one(i: int) -> int:  # each prompt its own from its first token: no prefix cached for another
        body = {"model": BASE, "messages": [{"role": "user", "content": f"{i} {prompt}"}], "max_tokens": 4}
        body.update(seed=i, temperature=1.0)
        return httpx.post(f"{vllm_server.url}/v1/chat/completions", json=body, timeout=300).status_code

    with ThreadPoolExecutor(64) as pool:
        codes = list(pool.map(one, range(128)))
    assert codes == [200] * 128
    assert httpx.get(f"{vllm_server.url}/health", timeout=10).status_code == 200


# -------------------------------------------------------------------------------------- bad input
# What an engine refuses answers one envelope through the gateway whichever engine it is
# (`gateway.serving.engine_errors`); only the engines' own words in `message` differ, where they say more.
LONG_TEXT = "a b " * 1100
"""2200 tokens of tiny-chat as a completion's prompt (2201 with the BOS token the embedded engine adds)."""
CONTEXT_MESSAGES = {
    "embedded": {
        "messages": "The prompt has 2229 tokens; this model's context is 1024.",
        "prompt": "The prompt has 2201 tokens; this model's context is 1024.",
    },
    "vllm": {
        field: "This model's maximum context length is 1024 tokens. However, your prompt contains at least"
        " 1025 input tokens, which exceeds this limit even without any output tokens. Please reduce the"
        " length of the input prompt."
        for field in ("messages", "prompt")
    },
}
"""The engines' own words for a prompt over their context (vLLM's without its `(parameter=input_tokens,
value=1025)` tail: `param` names the request's field)."""


def _context_error(message: str, param: str) -> tuple[int, dict[str, Any]]:
    return (
        400,
        {
            "message": message,
            "type": "invalid_request_error",
            "param": param,
            "code": "context_length_exceeded",
        },
    )


@pytest.mark.parametrize("engine", ["embedded", "vllm"])
def test_prompt_over_the_context_is_context_length_exceeded(
    gateways: dict[str, GatewayServer], engine: str
) -> None:
    """vLLM answers `param: "input_tokens"` and `code: 400`; through the gateway, OpenAI's
    `context_length_exceeded` naming the request's field, as the embedded engine answers."""
    org = _tenant(gateways[engine])
    with pytest.raises(openai.BadRequestError) as chat:
        org.client.chat.completions.create(model=BASE, messages=LONG_PROMPT, max_tokens=4)
    with pytest.raises(openai.BadRequestError) as legacy:
        org.client.completions.create(model=BASE, prompt=LONG_TEXT, max_tokens=4)
    for info, field in ((chat, "messages"), (legacy, "prompt")):
        assert _error(info.value) == _context_error(CONTEXT_MESSAGES[engine][field], field)


@pytest.mark.parametrize("engine", ["embedded", "vllm"])
def test_gateway_holds_requests_to_engine_max_model_len(
    gateways: dict[str, GatewayServer], engine: str
) -> None:
    """With `engine_max_model_len` the gateway's context is the engines' (1024, not the model's own 2048):
    it refuses, with its own words and before any engine, `max_tokens` beyond it, text that cannot fit by
    its length alone and token ids that leave no room; the same answers on both engines."""
    org = _tenant(gateways[engine])
    refusals = []
    for call in (
        lambda: org.client.chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=1500),
        lambda: org.client.chat.completions.create(
            model=BASE, messages=[{"role": "user", "content": TOO_LONG}], max_tokens=4, stream=True
        ),
        lambda: org.client.completions.create(model=BASE, prompt=["hi", TOO_LONG], max_tokens=4),
        lambda: org.client.completions.create(model=BASE, prompt=[1] * VLLM_MAX_MODEL_LEN, max_tokens=4),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            call()
        refusals.append(_error(info.value))
    most = 13 * VLLM_MAX_MODEL_LEN
    assert refusals == [
        (
            400,
            {
                "message": "Invalid value for 'max_tokens': 1500 is more than the 1024 tokens of model"
                " 'tiny-chat'.",
                "type": "invalid_request_error",
                "param": "max_tokens",
                "code": "invalid_value",
            },
        ),
        _context_error(
            f"The prompt is 20000 characters; this model's context of 1024 tokens holds at most {most}"
            " characters.",
            "messages",
        ),
        _context_error(
            f"The prompt is 20000 characters; this model's context of 1024 tokens holds at most {most}"
            " characters.",
            "prompt",
        ),
        _context_error("The prompt has 1024 tokens; this model's context is 1024.", "prompt"),
    ]


def test_vllms_bound_on_characters_through_a_gateway_that_does_not_know_the_context(
    gateways: dict[str, GatewayServer],
) -> None:
    """A gateway in front of a vLLM whose `--max-model-len` it does not know lets the text through; vLLM
    refuses it by its characters (`param: "input_text"`), answered as `context_length_exceeded` too."""
    org = _tenant(gateways["vllm-unsized"])
    with pytest.raises(openai.BadRequestError) as info:
        org.client.completions.create(model=BASE, prompt=TOO_LONG, max_tokens=4)
    assert _error(info.value) == _context_error(
        "This model's maximum context length is 1024 tokens. However, your prompt contains 20000 characters"
        " (more than 13312 characters, which is the upper bound for 1024 input tokens). Please reduce the"
        " length of the input prompt.",
        "prompt",
    )


@pytest.mark.parametrize("engine", ["embedded", "vllm"])
def test_model_the_engine_does_not_serve_is_model_not_found(
    gateways: dict[str, GatewayServer], engine: str
) -> None:
    """vLLM answers `code: 404` and lists the names it serves; through the gateway, the same 404
    `model_not_found` on both engines, streamed or not."""
    org = _tenant(gateways[engine])
    for stream in (False, True):
        with pytest.raises(openai.NotFoundError) as info:
            org.client.chat.completions.create(model=UNSERVED, messages=MESSAGES, max_tokens=4, stream=stream)
        assert _error(info.value) == (
            404,
            {
                "message": f"The model `{UNSERVED}` does not exist.",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            },
        )


@pytest.mark.parametrize("engine", ["embedded", "vllm"])
def test_missing_adapter_folder_is_the_servers_fault(
    gateways: dict[str, GatewayServer], engine: str, tmp_path: Path
) -> None:
    """A registered model whose folder is gone: vLLM's load answers 404, the embedded engine's 400; through
    the gateway both are a 500 `adapter_files_missing` (the server's state, which no retry mends), with no
    path in it."""
    org = _tenant(gateways[engine])
    model = ft_model(gateways[engine], org, tmp_path / "gone")
    with pytest.raises(openai.InternalServerError) as info:
        org.client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4)
    assert _error(info.value) == (
        500,
        {
            "message": f"Model '{model}' cannot be served: its adapter files are missing on the server.",
            "type": "server_error",
            "param": None,
            "code": "adapter_files_missing",
        },
    )


def _loads_for_a_rank_refused(gateway: GatewayServer, adapter: Path) -> int:
    """Ask `gateway` for a model of a new organisation on `adapter` (rank 32, above the engines'
    `--max-lora-rank`): assert the 400 `adapter_rank_too_large` naming rank and limit, and return how many
    adapter loads the gateway asked of its engines meanwhile."""
    org = _tenant(gateway)
    model = ft_model(gateway, org, adapter)
    loads = resources_of(gateway).engines.load_count
    with pytest.raises(openai.BadRequestError) as info:
        org.client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4)
    assert _error(info.value) == (
        400,
        {
            "message": f"Model '{model}' cannot be served: it is a LoRA adapter of rank 32, and the inference"
            f" engine serves ranks up to {VLLM_MAX_LORA_RANK}.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "adapter_rank_too_large",
        },
    )
    return resources_of(gateway).engines.load_count - loads


@pytest.mark.parametrize("engine", ["embedded", "vllm"])
def test_rank_above_max_lora_rank_is_refused_before_the_engine(
    gateways: dict[str, GatewayServer], engine: str, rank32_adapter: Path
) -> None:
    """The gateway reads the adapter's rank and holds it to `engine_max_lora_rank` itself: the same 400 on
    both engines (the embedded engine would load any rank), and no engine is asked."""
    assert _loads_for_a_rank_refused(gateways[engine], rank32_adapter) == 0


def test_rank_above_vllms_max_lora_rank_through_a_gateway_that_does_not_know_it(
    gateways: dict[str, GatewayServer], vllm_server: VllmEngineProcess, rank32_adapter: Path
) -> None:
    """vLLM reserves memory for ranks up to `--max-lora-rank` and refuses a higher one with a 500 of its
    own; a gateway whose `engine_max_lora_rank` is above the engine's asks it, and answers its refusal as
    the same 400."""
    direct = httpx.post(
        f"{vllm_server.url}/v1/load_lora_adapter",
        json={"lora_name": "r32-" + secrets.token_hex(3), "lora_path": str(rank32_adapter)},
    )
    assert direct.status_code == 500
    error = direct.json()["error"]
    assert error["type"] == "InternalServerError"
    assert f"LoRA rank 32 is greater than max_lora_rank {VLLM_MAX_LORA_RANK}" in error["message"]

    assert _loads_for_a_rank_refused(gateways["vllm-unsized"], rank32_adapter) == 1


# ------------------------------------------------------------------------------------- restart
def _alive_in_group(pgid: int) -> list[int]:
    """Processes of process group `pgid` that still run (zombies are dead)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(stat.parent.name))
    return alive


def test_vllm_killed_mid_stream_is_restarted_and_serves_adapters_again(
    gateways: dict[str, GatewayServer], vllm_server: VllmEngineProcess, adapter_dirs: list[Path]
) -> None:
    gateway = gateways["vllm"]
    org = _tenant(gateway)
    model = ft_model(gateway, org, adapter_dirs[2])
    first = org.client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0)
    assert first.model == model

    old_pid = vllm_server.pid
    stream = org.client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=900,
        n=8,  # eight answers of 900 tokens: long enough to be cut on a fast machine too
        stream=True,
        extra_body={"ignore_eos": True},  # vLLM's: a generation long enough to be cut
    )
    chunks = iter(stream)
    assert next(chunks).choices[0].delta.role == "assistant"
    vllm_server.proc.kill()
    with pytest.raises(openai.APIError) as info:
        for _ in chunks:
            pass
    assert info.value.body == {
        "message": info.value.message,
        "type": "server_error",
        "param": None,
        "code": "upstream_error",
    }
    assert info.value.message.startswith("The inference engine stream failed")

    # The supervisor starts it again; the engine core and worker of the killed start are gone with it.
    deadline = time.monotonic() + 60
    while (vllm_server.pid == old_pid or _alive_in_group(old_pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert vllm_server.pid != old_pid
    assert _alive_in_group(old_pid) == []
    vllm_server.wait_ready()
    again = org.client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0)
    assert again.choices[0].message.content == first.choices[0].message.content


# -------------------------------------------------------------------------------- tunegate up's choice
def _engine_settings(tmp_path: Path, **values: Any) -> Settings:
    return Settings(data_dir=tmp_path / "data", engine_port=free_port(), **values)


def test_auto_falls_back_to_the_embedded_engine_and_says_why(tmp_path: Path, tiny_model_dir: Path) -> None:
    settings = _engine_settings(
        tmp_path,
        engine="auto",
        engine_vllm_venv=tmp_path / "none",
        engine_max_loras=3,
        engine_max_model_len=512,
    )
    choice = engine_processes(settings, {BASE: str(tiny_model_dir)}, die_with_parent=False)
    try:
        assert choice.engine == "embedded"
        assert (
            choice.reason
            == f"vLLM is not installed in {tmp_path / 'none'} (scripts/install-vllm installs it)"
        )
        (process,) = choice.processes
        assert isinstance(process, EngineProcess)
        assert choice.served_by == {BASE: f"http://127.0.0.1:{settings.engine_port}"}
        assert process.argv[process.argv.index("--max-loras") + 1] == "3"
        assert process.argv[process.argv.index("--max-model-len") + 1] == "512"
    finally:
        for process in choice.processes:
            process.stop()


def test_engine_vllm_without_vllm_is_refused(tmp_path: Path, tiny_model_dir: Path) -> None:
    settings = _engine_settings(tmp_path, engine="vllm", engine_vllm_venv=tmp_path / "none")
    with pytest.raises(VllmUnavailable, match="vLLM is not installed in"):
        engine_processes(settings, {BASE: str(tiny_model_dir)}, die_with_parent=False)


def test_engine_vllm_serves_each_model_on_a_port_of_its_own(
    tmp_path: Path, tiny_model_dir: Path, vllm_server: VllmEngineProcess
) -> None:
    """One vLLM a base model, on `engine_port` and the ports after it, sized by the `engine_*` settings
    (stopped before they are ready: what they would serve is in their command lines)."""
    port = free_port()
    settings = Settings(
        data_dir=tmp_path / "data",
        engine="vllm",
        engine_port=port,
        engine_max_loras=2,
        engine_max_cpu_loras=5,
        engine_max_lora_rank=32,
        engine_max_model_len=512,
        engine_kv_cache_gib=0.5,
    )
    models = {BASE: str(tiny_model_dir), UNSERVED: str(tiny_model_dir)}
    choice = engine_processes(settings, models, die_with_parent=False)
    try:
        assert choice.engine == "vllm" and choice.reason == ""
        assert choice.served_by == {
            BASE: f"http://127.0.0.1:{port}",
            UNSERVED: f"http://127.0.0.1:{port + 1}",
        }
        for process, name in zip(choice.processes, models, strict=True):
            assert isinstance(process, VllmEngineProcess) and process.install == vllm_server.install
            flags = {k: process.argv[process.argv.index(k) + 1] for k in process.argv if k.startswith("--")}
            assert {k: flags[k] for k in ("--served-model-name", "--max-loras", "--max-cpu-loras")} == {
                "--served-model-name": name,
                "--max-loras": "2",
                "--max-cpu-loras": "5",
            }
            assert (flags["--max-lora-rank"], flags["--max-model-len"]) == ("32", "512")
            assert flags["--kv-cache-memory-bytes"] == str(1024**3 // 2)
    finally:
        for process in choice.processes:
            process.stop()


def _descendants(pid: int) -> set[int]:
    """Every process below `pid`."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


@pytest.mark.slow
def test_tunegate_up_with_engine_vllm(
    tmp_path: Path,
    tiny_model_dir: Path,
    own_database: str,
    services: Services,
    vllm_server: VllmEngineProcess,
) -> None:
    """`tunegate up --engine vllm`: vLLM serves the base model, `up` says so, chats go through the gateway,
    and SIGTERM stops everything, vLLM's engine core and worker too."""
    port, engine_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TUNEGATE_")}
    env.update(
        TUNEGATE_DATABASE_URL=own_database,
        TUNEGATE_REDIS_URL=services.redis_url,
        TUNEGATE_QUEUE_NAME=f"tunegate:vllm-up:{secrets.token_hex(4)}",
        TUNEGATE_BASE_MODELS=json.dumps({BASE: {"path": str(tiny_model_dir)}}),
        TUNEGATE_ENGINE_KV_CACHE_GIB="0.5",
        PYTHONUNBUFFERED="1",
    )
    argv = [sys.executable, "-m", "tunegate", "up", "--engine", "vllm", "--data-dir", str(tmp_path / "data")]
    argv += ["--port", str(port), "--engine-port", str(engine_port)]
    log = tmp_path / "up.log"
    below: set[int] = set()
    with log.open("w") as out:
        up = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while "tunegate is up" not in log.read_text() and up.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        said = log.read_text().splitlines()
        version = vllm_server.install.version
        assert f"{BASE}: served by vLLM {version} (CPU build) at http://127.0.0.1:{engine_port}" in said
        wait_port(port, 120, up)
        key = (tmp_path / "data" / "admin_key").read_text().strip()
        org = Admin(f"http://127.0.0.1:{port}", key).tenant("up-" + secrets.token_hex(3))
        answer = org.client.chat.completions.create(
            model=BASE, messages=MESSAGES, max_tokens=4, temperature=0
        )
        assert answer.model == BASE and answer.usage is not None and answer.usage.completion_tokens >= 1
        # the worker, and vLLM's server, engine core and worker (a busy machine once showed two of them for a
        # moment, after the first answer)
        deadline = time.monotonic() + 60
        while len(below := _descendants(up.pid)) < 4 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert len(below) >= 4, [_cmdline(pid) for pid in below]
    finally:
        up.send_signal(signal.SIGTERM)
        code = up.wait(timeout=120)
    assert code == 0
    assert [pid for pid in below if _state(pid) not in ("Z", "gone")] == []


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120]
    except OSError:
        return "gone"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
