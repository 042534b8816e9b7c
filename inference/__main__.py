"""``python -m inference --model tiny-chat=/path/to/model [--model ...] --port 8100``: run the engine."""

from __future__ import annotations

import argparse
import logging

logger = logging.getLogger(__name__)


def serve(
    models: dict[str, str],
    host: str = "127.0.0.1",
    port: int = 8100,
    max_loras: int = 8,
    *,
    max_batch_size: int = 16,
    device: str = "auto",
    log_level: str = "info",
    max_model_len: int | None = None,
) -> None:
    """Serve ``models`` (name -> local directory) over HTTP until interrupted."""
    import uvicorn

    from inference.server import create_app

    app = create_app(
        models, max_loras=max_loras, max_batch_size=max_batch_size, device=device, max_model_len=max_model_len
    )
    uvicorn.run(app, host=host, port=port, log_level=log_level)


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
    parser.add_argument("--max-loras", type=int, default=8, help="resident adapters per base model")
    parser.add_argument("--max-batch-size", type=int, default=16, help="rows in one batched generation")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1...")
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
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
    serve(
        models,
        args.host,
        args.port,
        args.max_loras,
        max_batch_size=args.max_batch_size,
        device=args.device,
        log_level=args.log_level,
        max_model_len=args.max_model_len,
    )


if __name__ == "__main__":
    main()
