"""Smoke test of `python -m bench`: every bench runs in quick mode and its report has numbers and ratios.

Values are never asserted (no timed assertions): only that each figure exists and is a finite number.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench.registry import BENCHES

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


SEPARATE = ("training", "stalls", "distributed", "dashboard", "tinker", "tinker_wire", "formats", "adapters")
"""Benches with a test of their own below (each too long for the combined quick report's time)."""


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench")
    names = [n for n in BENCHES if n not in SEPARATE]
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            *names,
            "--quick",
            "--profile",
            "--results-dir",
            str(out),
            "--markdown",
            str(out / "B.md"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert (out / "latest.json").exists(), proc.stderr[-3000:]
    data: dict[str, Any] = json.loads((out / "latest.json").read_text())
    data["_markdown"] = (out / "B.md").read_text()
    return data


def test_report_names_the_machine(report: dict[str, Any]) -> None:
    m = report["machine"]
    assert m["cpu_model"] and m["cores"] >= 1 and m["python"]
    assert m["versions"]["torch"] and report["quick"] is True
    assert "## " in report["_markdown"] and m["cpu_model"] in report["_markdown"]


def test_gateway_bench_pairs_every_point(report: dict[str, Any]) -> None:
    g = report["benches"]["gateway"]
    assert "error" not in g, g.get("traceback")
    assert [p["connections"] for p in g["points"]] == [1, 32]
    for p in g["points"]:
        for side in ("direct", "nullproxy", "gateway"):
            assert p[side]["requests"] > 0 and _number(p[side]["rps"]) and _number(p[side]["p99_ms"])
            assert p[side]["errors"] == 0 and _number(p[side]["steal_pct"])
        assert _number(p["gateway"]["cpu_ms_per_request"]) and _number(p["nullproxy"]["cpu_ms_per_request"])
        assert _number(p["gateway_added_p50_ms"]) and _number(p["gateway_throughput_vs_direct"])
        assert _number(p["gateway_over_floor_p99_ms"]) and _number(p["nullproxy_added_p99_ms"])
        if "litellm" in p:
            assert _number(p["gateway_throughput_vs_litellm"])
    prof = g["profile"]  # None only where py-spy may not attach to another process
    if prof is not None:
        assert prof["samples"] > 0 and prof["self"] and prof["project_inclusive"]
        assert any("gateway/" in func for _, func in prof["project_inclusive"])
        assert "Profile of the gateway" in report["_markdown"]


def test_profile_summary_counts_own_and_inclusive_samples(tmp_path: Path) -> None:
    from bench.profile import summarize

    raw = tmp_path / "p.txt"
    raw.write_text(
        "main (tunegate/cli.py:3);proxy (gateway/serving/router.py:9);write (asyncio/streams.py:343) 6\n"
        "main (tunegate/cli.py:3);proxy (gateway/serving/router.py:12) 3\n"
        "main (tunegate/cli.py:3);flush (/x/site-packages/asyncpg/connection.py:1150) 1\n"
    )
    out = summarize(raw, top=5)
    assert out["samples"] == 10
    assert out["self"][0] == [60.0, "write (asyncio/streams.py:343)"]
    assert [30.0, "proxy (gateway/serving/router.py:12)"] in out["self"]
    assert [10.0, "flush (asyncpg/connection.py:1150)"] in out["self"]
    # two lines of one function count once per stack; frames outside the project are not listed
    assert out["project_inclusive"] == [[90.0, "proxy (gateway/serving/router.py)"]]


def test_streaming_bench_measures_ttft_both_ways(report: dict[str, Any]) -> None:
    s = report["benches"]["streaming"]
    assert "error" not in s, s.get("traceback")
    assert s["direct_ttft"]["n"] == s["gateway_ttft"]["n"] == s["requests"]
    assert _number(s["added_ttft_p50_ms"]) and _number(s["ttft_ratio_p50"])


def test_sandbox_bench_compares_with_in_process(report: dict[str, Any]) -> None:
    s = report["benches"]["sandbox"]
    assert "error" not in s, s.get("traceback")
    for p in s["points"]:
        assert p["calls"]["sandbox"] > 0 and p["calls"]["in_process"] > 0
        assert _number(p["sandbox_vs_in_process"]) and p["same_rewards"] is True


@pytest.mark.timeout(1200)
def test_formats_bench_compares_an_adapter_with_native(tmp_path: Path, venv_dir: Path) -> None:
    # the four frameworks' venvs (about 1 GB) from the session's cache, where earlier tests built them
    f = run_quick("formats", tmp_path, timeout_s=1100, extra=["--venv-dir", str(venv_dir)])
    assert "error" not in f, f.get("traceback")
    assert set(f["formats"]) == {"trl", "openenv", "verifiers", "atropos"}
    for name, r in f["formats"].items():
        assert r["sides"]["native"]["units"] > 0 and r["sides"][name]["units"] > 0
        assert _number(r["vs_native"]) and r["same_rewards"] is True, (name, r["sides"])
    assert "vs native" in (tmp_path / "B.md").read_text()


def test_envservers_bench_scales_servers_against_local(report: dict[str, Any]) -> None:
    e = report["benches"]["envservers"]
    assert "error" not in e, e.get("traceback")
    assert [p["servers"] for p in e["points"]] == [1, 2]
    assert _number(e["local"]["step_wait_s"]) and _number(e["local"]["rewards_per_s"])
    for p in e["points"]:
        assert _number(p["rewards_per_s"]) and _number(p["speedup_vs_1"]) and _number(p["wait_vs_local"])
        assert p["served_by"] == p["servers"]  # every server scored a share of the batches
    assert "| env servers |" in report["_markdown"]
    pipe = e["pipelining"]
    for side in ("trainer", "standin"):
        assert _number(pipe[side]["serial_wait_s"]) and _number(pipe[side]["pipelined_wait_s"])
    assert _number(pipe["trainer_local_wait_s"]) and pipe["same_losses"] is True


def test_metering_bench_loses_no_usage(report: dict[str, Any]) -> None:
    m = report["benches"]["metering"]
    assert "error" not in m, m.get("traceback")
    for tenant in ("limits", "limits_and_budget"):
        assert m[tenant]["answered"] > 0 and m[tenant]["lost"] == 0
        assert m[tenant]["usage_rows"] == m[tenant]["answered"] and _number(m[tenant]["rows_per_s"])
    assert m["gateway_dropped"] == 0 and _number(m["budget_vs_limits_only"])
    alone = m["buffer_alone"]
    assert alone["written"] == alone["recorded"] == alone["rows_in_database"] > 0 and alone["dropped"] == 0


def run_quick(
    name: str, tmp_path: Path, timeout_s: float = 280, extra: list[str] | None = None
) -> dict[str, Any]:
    """Run one bench in quick mode (its summary into `tmp_path/B.md`, `extra` arguments after its own);
    returns its part of the report."""
    proc = subprocess.run(
        [sys.executable, "-m", "bench", name, "--quick", "--results-dir", str(tmp_path)]
        + ["--markdown", str(tmp_path / "B.md"), *(extra or [])],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert (tmp_path / "latest.json").exists(), proc.stderr[-3000:]
    return json.loads((tmp_path / "latest.json").read_text())["benches"][name]


def test_training_bench_compares_tunegate_with_plain_trl(tmp_path: Path) -> None:
    t = run_quick("training", tmp_path)
    assert "error" not in t, t.get("traceback")
    assert t["steps"] == 2 and t["plain_trl"]["steps"] == 2
    assert _number(t["plain_trl"]["wall_s"]) and _number(t["tunegate"]["wall_s"])
    assert _number(t["overhead_ratio"]) and _number(t["tunegate"]["success_to_first_token_ms"])
    assert t["tunegate"]["model"].startswith("ft:tiny-chat:")
    assert "plain TRL" in (tmp_path / "B.md").read_text()


def test_adapters_bench_measures_the_engines_in_turns(tmp_path: Path) -> None:
    a = run_quick("adapters", tmp_path)  # the embedded engine alone: quick mode leaves vLLM out
    assert "error" not in a, a.get("traceback")
    assert set(a["engines"]) == {"embedded"} and "quick mode" in a["vllm_skipped"]
    mixes = [(row["adapters"], row["popularity"]) for row in a["rows"]]
    assert mixes == [(0, "uniform"), (1, "uniform"), (4, "uniform"), (4, "zipf")]
    assert [row["distinct"] for row in a["rows"][:3]] == [1, 1, 4] and 1 <= a["rows"][3]["distinct"] <= 4
    for row in a["rows"]:
        side = row["embedded"]
        assert side["tokens"] == a["requests"] * a["max_tokens"] * a["repetitions"]  # ignore_eos: all of them
        assert side["every_request_exact"] is True and side["tokens_per_s"] > 0 and _number(side["vs_base"])
        assert side["adapter_loads_per_round"] >= 0  # counted by the embedded engine (all resident here)
    cold = a["cold_load"]["embedded"]
    assert cold["load"]["n"] == cold["load_to_first_token"]["n"] == 2
    assert 0 < cold["load"]["p50_ms"] <= cold["load_to_first_token"]["p50_ms"]
    assert "error" not in a["jobs"], a["jobs"]
    jobs = a["jobs"]["embedded"]
    assert jobs["model"].startswith("ft:tiny-chat:") and jobs["success_to_first_token"]["p50_ms"] > 0
    assert a["goal"]["met"] is None  # no vLLM measured, no ratio against it
    assert "vLLM left out" in (tmp_path / "B.md").read_text()


def test_distributed_bench_trains_the_same_steps_on_two_processes(tmp_path: Path) -> None:
    d = run_quick("distributed", tmp_path)
    assert "error" not in d, d.get("traceback")
    one, two = d["one_process"], d["two_processes"]
    assert one["returncode"] == 0 and two["returncode"] == 0, (one["stderr_tail"], two["stderr_tail"])
    assert d["same_steps"] and len(one["losses"]) == len(two["losses"]) == d["steps"]
    assert _number(d["max_loss_gap"]) and d["max_loss_gap"] < 0.05  # one curve, within float noise
    assert _number(d["time_ratio"]) and "two processes" in (tmp_path / "B.md").read_text()


def test_tinker_bench_compares_the_api_with_the_computation_it_serves(tmp_path: Path) -> None:
    t = run_quick("tinker", tmp_path)
    assert "error" not in t, t.get("traceback")
    assert [row["batch"] for row in t["training"]] == [2, 8]
    for row in t["training"]:
        assert _number(row["in_process_ms"]) and _number(row["api_ms"]) and _number(row["overhead_ratio"])
    for model in ("base", "adapter"):
        rates = t["sampling"][model]["tokens_per_s"]
        assert all(_number(rates[path]) and rates[path] > 0 for path in ("engine", "gateway", "tinker"))
        assert _number(t["sampling"][model]["tinker_vs_engine"])
    assert "Tinker API tok/s" in (tmp_path / "B.md").read_text()


def test_tinker_wire_bench_measures_every_refusal_both_ways(tmp_path: Path) -> None:
    w = run_quick("tinker_wire", tmp_path)
    assert "error" not in w, w.get("traceback")
    refused = {name for name, row in w["decoder"].items() if row["kind"] != "accepted"}
    assert refused and refused <= set(w["gateway"])  # each refusal measured in process and through a gateway
    for row in w["decoder"].values():
        assert _number(row["median_ms"]) and _number(row["max_ms"])
    for row in w["gateway"].values():
        assert _number(row["cpu_ms_per_request"])
    assert "Malformed tensors, whatever their declared shape" in (tmp_path / "B.md").read_text()


def test_dashboard_bench_opens_a_long_job(tmp_path: Path) -> None:
    d = run_quick("dashboard", tmp_path)
    assert "error" not in d, d.get("traceback")
    assert d["steps"] == 500 and _number(d["open_ms"]) and _number(d["open_vs_retrieve"])
    assert 0 < d["points_drawn"] <= 2000 and d["curves_bytes"] > 0
    assert "plain job retrieve" in (tmp_path / "B.md").read_text()


def test_episode_bytes_bench_reads_back_a_captured_episode(tmp_path: Path) -> None:
    e = run_quick("episode_bytes", tmp_path)
    assert "error" not in e, e.get("traceback")
    assert e["turns"] == 8 and e["final_tokens"] > 0
    # Each token id is stored once: only the ids of a turn the next one did not extend are not in the final
    # sequence.
    assert e["token_ids_stored"] >= e["final_tokens"]
    assert (e["token_ids_stored"] == e["final_tokens"]) == (e["breaks"] == 0)
    assert e["stored_bytes"] == sum(e["stored_by_field"].values())
    assert _number(e["stored_over_final"]) and e["whole_over_final"] > e["stored_over_final"]
    assert "every call stored whole" in (tmp_path / "B.md").read_text()


def test_stalls_bench_compares_the_attacked_tenant_with_its_idle_self(tmp_path: Path) -> None:
    s = run_quick("stalls", tmp_path)
    assert "error" not in s, s.get("traceback")
    for side in ("idle", "attacked"):
        assert s[side]["n"] > 0 and _number(s[side]["p99_ms"]) and s[side]["failures"] == 0
    assert _number(s["p99_ratio"]) and _number(s["p50_ratio"]) and s["goal"] == 2.0
    assert s["b_other"].get("uploads_failed", 0) == 0 and s["b_other"]["uploads_ok"] == s["rounds"]
    assert s["b_other"].get("model_lists_failed", 0) == 0
    answers = s["a_answers"]  # every worst input answered with its 4xx (or a 200 where it is legitimate)
    assert answers.get("prompt_10mb 413") and answers.get("python_source_4mb 413")
    assert answers.get("prompt_1mb 400") and answers.get("similarity_sample_1mb 400")
    assert not any(key.rpartition(" ")[2].startswith("5") for key in answers), answers
    assert "goal of 2x" in (tmp_path / "B.md").read_text()


def test_only_a_full_run_rewrites_the_summary_file(tmp_path: Path) -> None:
    from bench.common import machine
    from bench.registry import write_report

    summary = (ROOT / "BENCHMARKS.md").read_text()
    base = {"started_at": "now", "machine": machine()}
    partial = {**base, "quick": False, "benches": {"sandbox": {"skipped": "not here"}}}
    path = write_report(partial, results_dir=tmp_path)
    beside = path.with_suffix(".md")
    assert beside.exists() and "Skipped: not here." in beside.read_text()
    quick_full = {**base, "quick": True, "benches": {n: {"skipped": "quick"} for n in BENCHES}}
    assert write_report(quick_full, results_dir=tmp_path).with_suffix(".md").exists()
    assert (ROOT / "BENCHMARKS.md").read_text() == summary  # untouched by either


def test_capture_bench_measures_capture_off_and_on_side_by_side(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.capture",
            "--run",
            "--quick",
            "--profile",
            "--results-dir",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    c = json.loads((tmp_path / "capture.json").read_text())
    points = [(p["mode"], p["clients"]) for p in c["points"]]
    assert points == [("whole", 1), ("whole", 32), ("streamed", 1), ("streamed", 32)]
    for p in c["points"]:
        for arm in ("off", "on"):
            assert p[arm]["requests"] > 0 and p[arm]["failures"] == 0
            assert _number(p[arm]["p50_ms"]) and _number(p[arm]["p99_ms"])
            assert _number(p[arm]["cpu_ms_per_request"])
        assert (
            _number(p["added_p50_ms"]) and _number(p["added_p99_ms"]) and _number(p["throughput_on_vs_off"])
        )
    assert c["captured_records"] == c["capture_answers"] > 0  # every captured call written, none lost
    assert "| answers | clients | off p50 / p99 ms |" in proc.stdout and "| streamed | 32 |" in proc.stdout
    prof = c["profile"]  # None only where py-spy may not attach to another process
    if prof is not None:
        assert prof["samples"] > 0 and _number(prof["capture_pct"]) and prof["capture_functions"]
        assert "Profile of the gateway under the capture arm" in proc.stdout
