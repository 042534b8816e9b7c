"""`python -m bench [NAME ...] [--quick] [--profile] [--markdown PATH]`: run benches, write the report
and summary."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from bench.common import RESULTS_DIR, Options
from bench.registry import BENCHES, run_benches, write_report

logger = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description="tunegate's side-by-side benchmarks")
    parser.add_argument(
        "names", nargs="*", metavar="NAME", help=f"benches to run (default: all): {', '.join(BENCHES)}"
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes (seconds): checks that benches run")
    parser.add_argument(
        "--profile", action="store_true", help="also sample the gateway with py-spy under load (gateway)"
    )
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="where the JSON report goes")
    parser.add_argument(
        "--venv-dir",
        type=Path,
        default=None,
        help="venv cache of environment packages (default: under the work dir)",
    )
    parser.add_argument(
        "--markdown",
        type=Path,
        default=None,
        help="markdown summary (default: BENCHMARKS.md after a full run, else beside the JSON report)",
    )
    args = parser.parse_args(argv)
    names = args.names or list(BENCHES)
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        parser.error(f"unknown bench(es): {', '.join(unknown)}; choose from {', '.join(BENCHES)}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    opts = Options(
        quick=args.quick, workdir=args.results_dir / "work", profile=args.profile, venv_dir=args.venv_dir
    )
    report = run_benches(names, opts)
    path = write_report(report, results_dir=args.results_dir, markdown_path=args.markdown)
    print(path)
    return 1 if any("error" in r for r in report["benches"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
