"""The benches by name, and running a selection of them into one report (JSON + markdown).

A bench is a module with `run(opts: Options) -> dict` and `markdown(report: dict) -> list[str]`. Names map
to modules lazily so that `python -m bench sandbox` never imports torch.
"""

from __future__ import annotations

import importlib
import json
import logging
import time
import traceback
from pathlib import Path
from typing import Any

from bench.common import RESULTS_DIR, ROOT, Options, machine

logger = logging.getLogger(__name__)

BENCHES: dict[str, tuple[str, str]] = {
    "gateway": ("bench.gateway_bench", "Gateway overhead vs direct and vs LiteLLM"),
    "streaming": ("bench.streaming", "Streaming: time to first token through the gateway vs direct"),
    "adapters": ("bench.adapters", "Adapters: cold load, first token, throughput with many adapters"),
    "sandbox": ("bench.sandbox", "Sandbox: reward calls per second, sandboxed vs in-process"),
    "envservers": (
        "bench.envservers",
        "Env servers: reward throughput with 1, 2, 4 servers; step wait vs local",
    ),
    "formats": ("bench.formats", "Environment formats: episodes per second through an adapter vs native"),
    "metering": ("bench.metering", "Metering: usage rows per second sustained, none lost"),
    "stalls": ("bench.stalls", "Stalls: one tenant's chat p99 while another sends the worst inputs"),
    "distributed": ("bench.distributed", "Distributed: two training processes (DDP) against one"),
    "dashboard": ("bench.dashboard", "Dashboard: a job with 10,000 steps of metrics opens"),
    "tinker": ("bench.tinker_api", "Tinker API: a training step and sampling, through the API vs in process"),
    "tinker_wire": ("bench.tinker_wire", "Tinker wire: gateway CPU to refuse a malformed forward_backward"),
    "episode_bytes": (
        "bench.episode_bytes",
        "Capture: stored bytes of a 32-turn episode vs its final sequence",
    ),
    "training": (
        "bench.training",
        "Training overhead: tunegate vs a plain TRL script, success to first token",
    ),
}
"""name -> (module, title)."""
QUICK_NOTE = " in quick mode (smoke sizes, not meaningful)"


def _module(name: str) -> Any:
    return importlib.import_module(BENCHES[name][0])


def run_benches(names: list[str], opts: Options) -> dict[str, Any]:
    """Run `names` in order; a bench that fails is reported as `{"error": ...}` and the rest go on."""
    report: dict[str, Any] = {
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "quick": opts.quick,
        "machine": machine(),
        "benches": {},
    }
    opts.workdir.mkdir(parents=True, exist_ok=True)
    for name in names:
        logger.info("bench %s ...", name)
        t0 = time.perf_counter()
        try:
            result = _module(name).run(opts)
        except ModuleNotFoundError as exc:
            if exc.name != BENCHES[name][0]:
                raise
            result = {"skipped": f"{BENCHES[name][0]} is not in this tree"}
        except Exception as exc:  # noqa: BLE001 - one broken bench must not lose the others' numbers
            logger.exception("bench %s failed", name)
            result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
        result["wall_s"] = time.perf_counter() - t0
        report["benches"][name] = result
        logger.info("bench %s done in %.1fs", name, result["wall_s"])
    return report


def render_markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items() if v)
    lines = [
        "# Benchmarks",
        "",
        "Made by `python -m bench` (see `bench/`). Every figure is a pair or a ratio measured side by side",
        "in the same run on the same machine; absolute numbers move with the machine, the ratios much less.",
        "",
        f"Measured {report['started_at']}{QUICK_NOTE if report['quick'] else ''}"
        f" on: {m['cpu_model']}, {m['cores']} cores ({m['usable_cores']} usable), Python {m['python']},"
        f" {m['platform']}; {versions}.",
    ]
    for name, result in report["benches"].items():
        lines += ["", f"## {BENCHES[name][1]} (`{name}`, {result.get('wall_s', 0):.0f} s)", ""]
        if "error" in result:
            lines.append(f"Failed: `{result['error']}`")
            continue
        if "skipped" in result:
            lines.append(f"Skipped: {result['skipped']}.")
            continue
        lines += _module(name).markdown(result)
    return "\n".join(lines) + "\n"


def write_report(
    report: dict[str, Any], *, results_dir: Path = RESULTS_DIR, markdown_path: Path | None = None
) -> Path:
    """Write `results_dir/bench-<time>.json`, `latest.json` and the markdown summary; returns the first.

    The summary goes to `markdown_path` when given; else to `BENCHMARKS.md` after a full run of every
    bench (so that it always shows one run of all of them), and beside the JSON report otherwise."""
    results_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = results_dir / f"bench-{stamp}.json"
    text = json.dumps(report, indent=2, default=str)
    path.write_text(text)
    (results_dir / "latest.json").write_text(text)
    complete = not report["quick"] and set(report["benches"]) == set(BENCHES)
    target = markdown_path or (ROOT / "BENCHMARKS.md" if complete else path.with_suffix(".md"))
    target.write_text(render_markdown(report))
    return path
