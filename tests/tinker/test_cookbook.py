"""tinker-cookbook (the pinned release) trains against a running stack on `tiny-chat`, with no network.

Its own training loops run, driven by `examples/tinker/cookbook_sl.py` (`supervised.train.main` over the
arithmetic conversations) and `examples/tinker/cookbook_rl.py` (`rl.train.main` with the cookbook's
`ArithmeticEnv`); the assertions read what the cookbook wrote in its log directory (`metrics.jsonl`,
`checkpoints.jsonl`, the rollout summaries) and the checkpoints the server stored.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import asyncpg
import pytest
import tinker

from tests.support.fixtures import gateway_fixture, worker_fixture
from tests.support.source import load_script
from tests.support.stack import Admin, GatewayServer, Tenant
from tests.support.tinker import sampler_folder

pytest.importorskip("tinker_cookbook", reason="tinker-cookbook is installed by scripts/install")

pytestmark = [pytest.mark.slow]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "tinker"
gw = gateway_fixture("tinker-cookbook", own_database=True)
worker = worker_fixture(autouse=True, TUNEGATE_TRAINING_SLOTS="2")


def driver(name: str) -> ModuleType:
    return load_script(EXAMPLES / f"{name}.py", f"tinker_{name}")


def run(name: str, gw: GatewayServer, org: Tenant, log_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The driver's `__main__`, with `base_url` and `log_path` given as on its command line."""
    monkeypatch.setenv("TINKER_API_KEY", "tml-" + org.key)  # the cookbook's ServiceClient reads it
    module = driver(name)
    blueprint = module.build_config_blueprint()
    blueprint.make_from_argv([f"base_url={gw.url}", f"log_path={log_path}"])
    module.main(blueprint.make())


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def adapter(gw: GatewayServer, org: Tenant, sampler_path: str) -> dict[str, Any]:
    """The LoRA tensors of a sampler checkpoint, as the server stored them."""
    from safetensors.torch import load_file

    folder = sampler_folder(gw.settings.blob_dir, org.org_id, sampler_path)
    return load_file(str(folder / "adapter_model.safetensors"))


@pytest.mark.timeout(600)
def test_the_cookbook_supervised_loop_lowers_nll(
    gw: GatewayServer, gw_admin: Admin, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    org = gw_admin.tenant("cookbook-sl")
    run("cookbook_sl", gw, org, tmp_path / "sl", monkeypatch)

    steps = [m for m in jsonl(tmp_path / "sl" / "metrics.jsonl") if "train_mean_nll" in m]
    nll = [m["train_mean_nll"] for m in steps]
    assert [m["step"] for m in steps] == list(range(8))
    # measured: 0.74 0.59 0.34 0.44 0.13 0.20 0.08 0.15
    assert sum(nll[-3:]) < sum(nll[:3]), nll

    checkpoints = jsonl(tmp_path / "sl" / "checkpoints.jsonl")
    assert [c["name"] for c in checkpoints] == ["000004", "final"]
    rest = tinker.ServiceClient(base_url=gw.url, api_key="tml-" + org.key).create_rest_client()
    for c in checkpoints:
        assert c["state_path"].startswith("tinker://") and c["sampler_path"].startswith("tinker://")
        for path in (c["state_path"], c["sampler_path"]):
            assert rest.get_weights_info_by_tinker_path(path).result().base_model == "tiny-chat"


@pytest.mark.timeout(600)
def test_the_cookbook_rl_loop_rewards_and_steps(
    gw: GatewayServer, gw_admin: Admin, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    org = gw_admin.tenant("cookbook-rl")
    run("cookbook_rl", gw, org, tmp_path / "rl", monkeypatch)

    # every sampled answer was scored by ArithmeticEnv: 1 for the right number, less 0.1 for an answer that
    # did not end with the stop token; rewards vary within groups, so the advantages are not all zero
    iterations = [tmp_path / "rl" / f"iteration_{i:06d}" for i in range(4)]
    trajectories = [t for it in iterations for t in jsonl(it / "train_rollout_summaries.jsonl")]
    assert len(trajectories) == 4 * 4 * 8
    rewards = [t["total_reward"] for t in trajectories]
    assert {round(r, 6) for r in rewards} <= {-0.1, 0.0, 0.9, 1.0}, rewards
    correct = sum(t["steps"][0]["metrics"]["correct"] for t in trajectories)
    assert 0 < correct < len(trajectories), correct
    metrics = [m for m in jsonl(tmp_path / "rl" / "metrics.jsonl") if "env/all/reward/total" in m]
    assert len(metrics) == 4 and all(m["env/all/by_group/frac_mixed"] > 0 for m in metrics), metrics

    # the optimizer steps changed the weights: the adapter (its B matrices start at zero) is no longer the
    # base model, and it moved between the checkpoint after two steps and the final one after four
    checkpoints = {c["name"]: c for c in jsonl(tmp_path / "rl" / "checkpoints.jsonl")}
    assert {"000002", "final"} <= set(checkpoints)
    assert all(c["sampler_path"].startswith("tinker://") for c in checkpoints.values())
    middle = adapter(gw, org, checkpoints["000002"]["sampler_path"])
    final = adapter(gw, org, checkpoints["final"]["sampler_path"])
    lora_b = [name for name in final if "lora_B" in name]
    assert lora_b and any(final[name].abs().max() > 0 for name in lora_b)
    assert any(not final[name].equal(middle[name]) for name in final)

    # the cookbook closed its ServiceClient: the session is finished, so the worker saved the model and let
    # its training slot go without waiting out the idle timeout (300 s)
    model_id = checkpoints["final"]["state_path"].removeprefix("tinker://").split("/")[0]
    assert asyncio.run(_released(gw, model_id, within_s=60)), model_id


async def _released(gw: GatewayServer, model_id: str, within_s: float) -> bool:
    """Whether the model's session is finished and no worker holds the model (saved) within `within_s`."""
    assert gw.settings.database_url is not None
    conn = await asyncpg.connect(gw.settings.database_url)
    try:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            row = await conn.fetchrow(
                "SELECT m.worker_id, m.resume_path, s.finish_reason FROM tinker_models m"
                " JOIN tinker_sessions s ON s.id = m.session_id WHERE m.id = $1",
                model_id,
            )
            if row["finish_reason"] == "success" and row["worker_id"] is None and row["resume_path"]:
                return True
            await asyncio.sleep(0.5)
        return False
    finally:
        await conn.close()
