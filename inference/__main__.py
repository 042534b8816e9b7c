"""``python -m inference --model tiny-chat=/path/to/model [--model ...] --port 8100``: run the engine.

The flags ``--max-loras``, ``--max-batch-size``, ``--device`` and ``--max-model-len`` fill in the engine's
``EngineOptions`` (the others keep their defaults); ``serve`` runs ``create_app(models, options)``.
"""

from __future__ import annotations

import argparse
import logging

from inference.options import EngineOptions

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
    defaults = EngineOptions()
    parser.add_argument(
        "--max-loras", type=int, default=defaults.max_loras, help="resident adapters per base model"
    )
    parser.add_argument(
        "--max-batch-size", type=int, default=defaults.max_batch_size, help="rows in one batched generation"
    )
    parser.add_argument("--device", default=defaults.device, help="auto, cpu, cuda, cuda:1...")
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=defaults.max_model_len,
        help="most tokens of prompt and completion in one request (default: each model's own context)",
    )
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    try:
        models = parse_models(args.model)
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    options = EngineOptions(
        max_loras=args.max_loras,
        max_batch_size=args.max_batch_size,
        device=args.device,
        max_model_len=args.max_model_len,
    )
    serve(models, args.host, args.port, options, log_level=args.log_level)


if __name__ == "__main__":
    main()
