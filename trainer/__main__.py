"""Command line: ``python -m trainer run SPEC.json`` and ``python -m trainer make-tiny DIR``.

``run`` prints JSON-lines events on stdout (see ``trainer.events``), logs on stderr, and exits 0 when the
job finished or stopped on SIGTERM (after saving a checkpoint), 1 after an ``error`` event.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import traceback

from trainer.errors import TrainerError
from trainer.events import EventWriter

logger = logging.getLogger(__name__)


def _run(spec_path: str) -> int:
    # Nothing may be downloaded at run time; quiet the tokenizers fork warning.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from trainer.distributed import is_main

    events = EventWriter.claim_stdout(reports=is_main())
    stop_requested = threading.Event()

    def on_sigterm(signum: int, frame: object) -> None:
        logger.info("SIGTERM received: stopping after the current step")
        stop_requested.set()

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        from trainer.run import main, read_spec

        spec = read_spec(spec_path)
        return main(spec, events, stop_requested)
    except TrainerError as exc:
        traceback.print_exc(file=sys.stderr)
        events.error(exc.code, exc.message)
    except MemoryError as exc:
        traceback.print_exc(file=sys.stderr)
        events.error("out_of_memory", f"out of memory: {exc}")
    except Exception as exc:
        traceback.print_exc(file=sys.stderr)
        code = "out_of_memory" if type(exc).__name__ == "OutOfMemoryError" else "trainer_error"
        events.error(code, f"{type(exc).__name__}: {exc}")
    return 1


def cli(argv: list[str] | None = None) -> int:
    """Parse arguments and run a command; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m trainer", description="tunegate training runtime")
    sub = parser.add_subparsers(dest="command", required=True)
    run_p = sub.add_parser("run", help="run one training job from a spec JSON file")
    run_p.add_argument("spec", help="path of SPEC.json")
    tiny_p = sub.add_parser(
        "make-tiny", help="the tiny offline chat model in DIR (shipped weights, or built)"
    )
    tiny_p.add_argument("dir")
    tiny_p.add_argument("--seed", type=int, default=0)
    tiny_p.add_argument("--steps", type=int, default=None, help="fitting steps (default: the recipe's)")
    tiny_p.add_argument(
        "--from-scratch", action="store_true", help="build even where the shipped weights would do"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.command == "run":
        return _run(args.spec)
    from trainer.tiny import TinyRecipe, build_tiny_model, make_tiny_model

    if args.from_scratch:
        steps = TinyRecipe.steps if args.steps is None else args.steps
        print(build_tiny_model(args.dir, TinyRecipe(seed=args.seed, steps=steps)))
    else:
        print(make_tiny_model(args.dir, seed=args.seed, steps=args.steps))
    return 0


if __name__ == "__main__":
    sys.exit(cli())
