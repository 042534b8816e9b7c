"""``python -m inference --model tiny-chat=/path/to/model [--model ...] --port 8100``: run the engine.

Besides the models, host, port and log level, every flag fills in a field of the engine's ``EngineOptions``
(``--max-loras``, ``--max-batch-size``, ``--device``, ``--max-model-len``...: ``inference.options.FLAGS``);
``serve`` runs ``create_app(models, options)``.
"""

from __future__ import annotations

import argparse
import logging

from inference.options import EngineOptions, add_flags

logger = logging.getLogger(__name__)


def serve(
    models: dict[str, str],
    host: str = "127.0.0.1",
    port: int = 8100,
    options: EngineOptions | None = None,
    *,
    log_level: str = "info",
) -> None:
    """Serve ``models`` (name -> local directory) over HTTP until interrupted, as ``options`` say."""
    import uvicorn

    from inference.server import create_app

    uvicorn.run(create_app(models, options), host=host, port=port, log_level=log_level)


def parse_models(specs: list[str]) -> dict[str, str]:
    """``["name=/path", ...]`` -> ``{"name": "/path"}``."""
    models: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise argparse.ArgumentTypeError(f"--model expects NAME=PATH, got {spec!r}")
        models[name] = path
    return models


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m inference", description="tunegate's CPU inference engine"
    )
    parser.add_argument("--model", action="append", required=True, metavar="NAME=PATH", help="a base model")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    add_flags(parser)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    try:
        models = parse_models(args.model)
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    serve(models, args.host, args.port, EngineOptions.from_flags(args), log_level=args.log_level)


if __name__ == "__main__":
    main()
