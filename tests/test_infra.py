"""Deployment files, checked offline: they parse, carry what they must, name only real settings, the
kustomization lists files that exist; `kubectl kustomize` builds the manifests and every object validates
against Kubernetes' schemas (kubernetes-validate), and every compose client here (Debian's `docker-compose`,
the `docker compose` plugin) accepts `infra/compose.yaml` with each profile. `scripts/install` installs the
tools where they are missing; a missing tool fails these tests rather than skipping them."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gateway.settings import Settings
from tunegate.settings_doc import env_name

ROOT = Path(__file__).resolve().parents[1]
INFRA = ROOT / "infra"
K8S = INFRA / "k8s"
OURS = [INFRA / "compose.yaml", *sorted(K8S.glob("*.yaml")), *sorted((INFRA / "docker").glob("Dockerfile*"))]


def _docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _k8s_objects() -> dict[tuple[str, str], dict[str, Any]]:
    objects = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in _docs(path):
            assert {"apiVersion", "kind", "metadata"} <= doc.keys(), path
            objects[(doc["kind"], doc["metadata"]["name"])] = doc
    return objects


def test_every_tunegate_variable_is_a_setting() -> None:
    known = {env_name(name) for name in Settings.model_fields}
    used: dict[str, set[str]] = {}
    for path in OURS:
        for var in re.findall(r"\bTUNEGATE_[A-Z0-9_]+", path.read_text()):
            used.setdefault(var, set()).add(path.name)
    assert used, "no settings found in infra files"
    unknown = {v: sorted(files) for v, files in used.items() if v not in known}
    assert unknown == {}


def test_compose_file() -> None:
    compose = yaml.safe_load((INFRA / "compose.yaml").read_text())
    services = compose["services"]
    assert {"postgres", "redis", "gateway", "worker", "engine", "worker-gpu", "vllm"} <= services.keys()
    assert "cpu" in services["engine"]["profiles"] and "gpu" in services["vllm"]["profiles"]
    # Both engine services run `tunegate engine` (vLLM's flags from the settings every process reads): the
    # model and the port of the gateway's upstream, vLLM named outright on the GPU profile.
    registry = yaml.safe_load(services["gateway"]["environment"]["TUNEGATE_BASE_MODELS"])
    for name in ("engine", "vllm"):
        command = services[name]["command"]
        assert command[0] == "engine", command
        model, path = command[command.index("--model") + 1].split("=", 1)
        assert registry[model]["path"] == path
        assert registry[model]["upstreams"] == [f"http://engine:{command[command.index('--port') + 1]}"]
        assert services[name]["environment"]["TUNEGATE_ENGINE_MAX_LORA_RANK"] == "64"
    assert services["vllm"]["networks"]["default"]["aliases"] == ["engine"]  # the same upstream URL
    vllm_command = services["vllm"]["command"]
    assert vllm_command[vllm_command.index("--engine") + 1] == "vllm"
    # env servers: a profile of their own (scaled with --scale), with the stack's Redis and settings
    env_server = services["env-server"]
    assert env_server["profiles"] == ["env-servers"] and env_server["command"][0] == "env-server"
    assert "TUNEGATE_REDIS_URL" in env_server["environment"] and "ports" not in env_server
    gateway_env = services["gateway"]["environment"]
    for name in ("TUNEGATE_DATABASE_URL", "TUNEGATE_REDIS_URL", "TUNEGATE_ADMIN_KEY", "TUNEGATE_BASE_MODELS"):
        assert name in gateway_env
    # The base-model registry is valid for the Settings object.
    settings = Settings.model_validate({"base_models": yaml.safe_load(gateway_env["TUNEGATE_BASE_MODELS"])})
    assert settings.base_models["tiny-chat"].upstreams == ["http://engine:8100"]
    for service in services.values():
        build = service.get("build")
        if build:
            assert (INFRA / build["context"] / build["dockerfile"]).is_file()


def test_kustomization_lists_existing_files() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = kustomization["resources"]
    assert listed and all((K8S / name).is_file() for name in listed)
    on_disk = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(listed) == on_disk


def test_kubernetes_objects() -> None:
    objects = _k8s_objects()
    for kind, name in [
        ("Deployment", "tunegate-gateway"),
        ("Service", "tunegate-gateway"),
        ("HorizontalPodAutoscaler", "tunegate-gateway"),
        ("Deployment", "tunegate-worker"),
        ("Deployment", "tunegate-env-server"),
        ("HorizontalPodAutoscaler", "tunegate-env-server"),
        ("Deployment", "vllm-tiny-chat"),
        ("Service", "vllm-tiny-chat"),
        ("Job", "tunegate-migrate"),
        ("ConfigMap", "tunegate-config"),
        ("Secret", "tunegate-secrets"),
    ]:
        assert (kind, name) in objects, (kind, name)
    worker = objects[("Deployment", "tunegate-worker")]["spec"]["template"]["spec"]["containers"][0]
    assert worker["resources"]["requests"]["nvidia.com/gpu"] >= 1
    # env servers run on CPU nodes, apart from the GPU workers, and scale with their own HPA
    env_pod = objects[("Deployment", "tunegate-env-server")]["spec"]["template"]["spec"]
    assert env_pod["containers"][0]["args"][0] == "env-server"
    assert "nvidia.com/gpu" not in str(env_pod["containers"][0]["resources"])
    assert "nvidia.com/gpu.present" in str(env_pod["affinity"])
    env_hpa = objects[("HorizontalPodAutoscaler", "tunegate-env-server")]["spec"]
    assert env_hpa["scaleTargetRef"]["name"] == "tunegate-env-server"
    hpa = objects[("HorizontalPodAutoscaler", "tunegate-gateway")]["spec"]
    assert hpa["scaleTargetRef"]["name"] == "tunegate-gateway"
    migrate = objects[("Job", "tunegate-migrate")]["spec"]["template"]["spec"]["containers"][0]
    assert migrate["args"] == ["migrate"]
    # The ConfigMap's base models parse as the Settings object reads them.
    config = objects[("ConfigMap", "tunegate-config")]["data"]
    settings = Settings.model_validate({"base_models": yaml.safe_load(config["TUNEGATE_BASE_MODELS"])})
    service = objects[("Service", "vllm-tiny-chat")]
    port = service["spec"]["ports"][0]["port"]
    assert settings.base_models["tiny-chat"].upstreams == [f"http://vllm-tiny-chat:{port}"]
    # vLLM is started by `tunegate engine --engine vllm` on the model's path and the Service's port, sized by
    # the same ConfigMap the gateway reads.
    vllm = objects[("Deployment", "vllm-tiny-chat")]["spec"]["template"]["spec"]["containers"][0]
    args = vllm["args"]
    assert vllm["command"] == ["tunegate", "engine"] and args[args.index("--engine") + 1] == "vllm"
    assert args[args.index("--model") + 1] == f"tiny-chat={settings.base_models['tiny-chat'].path}"
    assert vllm["ports"][0]["containerPort"] == int(args[args.index("--port") + 1])
    assert {"configMapRef": {"name": "tunegate-config"}} in vllm["envFrom"]
    assert "TUNEGATE_ENGINE_MAX_LORA_RANK" in config
    # Every Service selects pods that some Deployment labels.
    labels = [
        o["spec"]["template"]["metadata"]["labels"] for (k, _), o in objects.items() if k == "Deployment"
    ]
    for (kind, name), obj in objects.items():
        if kind == "Service":
            assert obj["spec"]["selector"] in labels, name


def test_dockerfiles_build_from_repository_paths() -> None:
    for dockerfile in sorted((INFRA / "docker").glob("Dockerfile*")):
        text = dockerfile.read_text()
        assert text.startswith("#") and "ENTRYPOINT" in text and "bubblewrap" in text
        for source in re.findall(r"^COPY (\S+) ", text, flags=re.M):
            assert (ROOT / source).exists(), f"{dockerfile.name}: COPY {source}"


def _tool(name: str) -> str:
    """A command on PATH or in this interpreter's environment (where `scripts/install` puts kubectl when the
    machine has none); fails the test when neither has it."""
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail(f"{name} is not installed: run scripts/install")
    return found


def _compose_clients() -> list[list[str]]:
    clients = []
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        clients.append([docker, "compose"])
    legacy = shutil.which("docker-compose")
    if legacy:
        clients.append([legacy])
    return clients


def _run(command: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    environment = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(ROOT), **env}
    return subprocess.run(command, env=environment, capture_output=True, text=True, timeout=120, cwd=ROOT)


@pytest.mark.parametrize("profile", ["cpu", "gpu"])
def test_compose_clients_accept_the_compose_file(profile: str) -> None:
    clients = _compose_clients()
    if not clients:
        pytest.fail("no compose client (docker-compose or the docker compose plugin): run scripts/install")
    compose = ["-f", str(INFRA / "compose.yaml"), "--profile", profile, "config"]
    for client in clients:
        out = _run([*client, *compose, "-q"], TUNEGATE_ADMIN_KEY="sk-admin-test")
        assert out.returncode == 0, (client, out.stderr)
        # The admin key is required: without it the file is refused, not run with an empty key.
        missing = _run([*client, *compose, "-q"])
        assert missing.returncode != 0 and "TUNEGATE_ADMIN_KEY" in missing.stderr, (client, missing.stderr)
        resolved = yaml.safe_load(_run([*client, *compose], TUNEGATE_ADMIN_KEY="sk-admin-test").stdout)
        engine = "engine" if profile == "cpu" else "vllm"
        assert {"postgres", "redis", "init", "gateway", engine} <= resolved["services"].keys()
        gateway_env = resolved["services"]["gateway"]["environment"]
        assert gateway_env["TUNEGATE_ADMIN_KEY"] == "sk-admin-test"


def test_kustomize_builds_manifests_that_validate() -> None:
    out = _run([_tool("kubectl"), "kustomize", str(K8S)])
    assert out.returncode == 0, out.stderr
    objects = [d for d in yaml.safe_load_all(out.stdout) if d is not None]
    kinds = {o["kind"] for o in objects}
    assert kinds >= {"Namespace", "Deployment", "Service", "Job", "ConfigMap", "Secret"}
    versions = sorted({kubernetes_validate.utils.all_versions()[0], kubernetes_validate.latest_version()})
    for obj in objects:
        for version in versions:  # the oldest and the newest schemas the validator ships
            kubernetes_validate.validate(obj, version, strict=True)
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "tunegate"
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "tunegate"
    images = {
        c["image"]
        for o in objects
        if o["kind"] in ("Deployment", "Job")
        for c in o["spec"]["template"]["spec"]["containers"]
    }
    assert images and all(i.startswith("ghcr.io/example/tunegate:") for i in images)
