"""The `tunegate` command: run the stack or one of its processes, and administer it."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Annotated

import typer

from gateway.settings import Settings

app = typer.Typer(help="tunegate: OpenAI-compatible fine-tuning and inference gateway.", no_args_is_help=True)
admin_app = typer.Typer(help="Organisations and API keys.", no_args_is_help=True)
models_app = typer.Typer(help="Base models.", no_args_is_help=True)
jobs_app = typer.Typer(help="Fine-tuning jobs.", no_args_is_help=True)
app.add_typer(admin_app, name="admin")
app.add_typer(models_app, name="models")
app.add_typer(jobs_app, name="jobs")


def _logging(settings: Settings) -> None:
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def _need_database(settings: Settings) -> str:
    if not settings.database_url:
        typer.echo("TUNEGATE_DATABASE_URL is not set (tunegate up starts an embedded one).", err=True)
        raise typer.Exit(2)
    return settings.database_url


@app.command()
def up(
    host: Annotated[str | None, typer.Option(help="Address to bind.")] = None,
    port: Annotated[int | None, typer.Option(help="Gateway port.")] = None,
    data_dir: Annotated[Path | None, typer.Option(help="Where everything is kept.")] = None,
    engine_port: Annotated[
        int | None,
        typer.Option(help="Port of the inference engine (vLLM: one a base model, from this port on)."),
    ] = None,
    engine: Annotated[
        str | None,
        typer.Option(help="What serves the base models: vllm, embedded, or auto (vLLM where it can run)."),
    ] = None,
) -> None:
    """Run the whole stack in the foreground (embedded PostgreSQL and Redis when no URLs are set)."""
    from tunegate.stack import run_stack

    overrides: dict[str, object] = {}
    if host is not None:
        overrides["host"] = host
    if port is not None:
        overrides["port"] = port
    if data_dir is not None:
        overrides["data_dir"] = data_dir
    if engine_port is not None:
        overrides["engine_port"] = engine_port
    if engine is not None:
        overrides["engine"] = _engine_option(engine)
    settings = Settings(**overrides)  # type: ignore[arg-type]
    _logging(settings)
    raise typer.Exit(run_stack(settings))


def _engine_option(engine: str) -> str:
    if engine not in ("auto", "vllm", "embedded"):
        typer.echo(f"--engine must be auto, vllm or embedded, not {engine!r}.", err=True)
        raise typer.Exit(2)
    return engine


@app.command()
def engine(
    model: Annotated[list[str], typer.Option(help="NAME=PATH of a base model (vLLM: exactly one).")],
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    port: Annotated[int, typer.Option()] = 8100,
    engine: Annotated[
        str | None,
        typer.Option(help="vllm, embedded, or auto (vLLM where it can run); default: the engine setting."),
    ] = None,
) -> None:
    """Serve base models with the engine `tunegate up` would pick, with the same TUNEGATE_ENGINE_* sizes
    (the compose file and the Kubernetes manifests run this)."""
    from argparse import ArgumentTypeError

    from inference.__main__ import parse_models
    from inference.vllm import VllmUnavailable
    from tunegate.vllm_process import serve_engine

    settings = Settings(**({"engine": _engine_option(engine)} if engine is not None else {}))  # type: ignore[arg-type]
    _logging(settings)
    try:
        serve_engine(settings, parse_models(model), host, port)
    except (VllmUnavailable, ValueError, ArgumentTypeError) as exc:
        typer.echo(f"tunegate engine: {exc}", err=True)
        raise typer.Exit(2) from None


@app.command()
def gateway(
    host: Annotated[str | None, typer.Option()] = None,
    port: Annotated[int | None, typer.Option()] = None,
    workers: Annotated[int, typer.Option(help="uvicorn worker processes")] = 1,
) -> None:
    """Run the API gateway (needs TUNEGATE_DATABASE_URL and TUNEGATE_REDIS_URL)."""
    from gateway.httpserver import serve

    settings = Settings()
    _logging(settings)
    _need_database(settings)
    serve(
        "gateway.main:app",
        host=host or settings.host,
        port=port or settings.port,
        workers=workers,
        log_level=settings.log_level,
    )


@app.command()
def worker() -> None:
    """Run a training worker (claims queued jobs and runs the trainer)."""
    from gateway.worker.main import run_worker

    settings = Settings()
    _logging(settings)
    _need_database(settings)
    run_worker(settings)


@app.command("env-server")
def env_server(
    capacity: Annotated[
        int | None, typer.Option(help="Calls served at once (default: env_server_capacity).")
    ] = None,
    pool: Annotated[str | None, typer.Option(help="Pool to serve (default: env_pool).")] = None,
    metrics_port: Annotated[int | None, typer.Option(help="Port of its Prometheus /metrics.")] = None,
) -> None:
    """Host sandboxed environments for the trainers of a pool (needs TUNEGATE_REDIS_URL); scale by running
    more. SIGTERM drains it."""
    from envsdk import venvs
    from envsdk.server import run_env_server

    settings = Settings()
    venvs.configure(settings.venv_builder())  # packages with requirements: the gateway's venv cache
    _logging(settings)
    if not settings.redis_url:
        typer.echo("TUNEGATE_REDIS_URL is not set.", err=True)
        raise typer.Exit(2)
    run_env_server(
        settings.redis_url,
        pool=pool or settings.env_pool,
        capacity=capacity or settings.env_server_capacity,
        data_dir=settings.data_dir / "env-server",
        maxima=settings.sandbox_maxima(),
        allow_unsandboxed=settings.allow_unsandboxed_environments,
        metrics_port=metrics_port,
    )


@app.command()
def inference(
    model: Annotated[list[str], typer.Option(help="NAME=PATH of a base model (repeatable).")],
    host: Annotated[str, typer.Option()] = "127.0.0.1",
    port: Annotated[int, typer.Option()] = 8100,
    max_loras: Annotated[int, typer.Option(help="Resident adapters per base model.")] = 8,
) -> None:
    """Run the embedded inference engine (CPU or any torch device)."""
    from inference.__main__ import main as engine_main
    from inference.options import EngineOptions

    argv = [a for m in model for a in ("--model", m)]
    engine_main([*argv, "--host", host, "--port", str(port), *EngineOptions(max_loras=max_loras).to_flags()])


@app.command()
def migrate() -> None:
    """Apply pending database migrations."""
    from gateway.db import migrate as run_migrations

    settings = Settings()
    applied = asyncio.run(run_migrations(_need_database(settings)))
    typer.echo("applied: " + (", ".join(applied) if applied else "nothing (up to date)"))


async def _admin(settings: Settings, action: str, arg: str) -> str:
    from gateway.db import create_pool
    from gateway.db import migrate as run_migrations
    from gateway.tenancy import service

    dsn = _need_database(settings)
    await run_migrations(dsn)
    pool = await create_pool(dsn, min_size=1, max_size=2)
    try:
        if action == "create-org":
            return (await service.create_org(pool, arg)).id
        key = await service.create_key(pool, arg, None)
        assert key.key is not None
        return key.key
    finally:
        await pool.close()


@admin_app.command("create-org")
def create_org(name: str) -> None:
    """Create an organisation; prints its id."""
    typer.echo(asyncio.run(_admin(Settings(), "create-org", name)))


@admin_app.command("create-key")
def create_key(org_id: str) -> None:
    """Create an API key for an organisation; prints the key (shown only this once)."""
    typer.echo(asyncio.run(_admin(Settings(), "create-key", org_id)))


@models_app.command("make-tiny")
def make_tiny(directory: Path) -> None:
    """Make the tiny offline chat model (`tiny-chat`) in DIRECTORY."""
    from trainer.tiny import make_tiny_model

    typer.echo(str(make_tiny_model(directory)))


@models_app.command("add")
def models_add(
    name: str,
    source: Annotated[str, typer.Argument(help="A local model folder, or a Hugging Face hub id.")],
    data_dir: Annotated[Path | None, typer.Option(help="Data dir of the stack.")] = None,
) -> None:
    """Register a Hugging Face causal LM as base model NAME, for fine-tuning and serving."""
    from tunegate.models import ModelSourceError, add_model

    settings = Settings(data_dir=data_dir) if data_dir is not None else Settings()
    try:
        folder = add_model(settings, name, source)
    except ModelSourceError as exc:
        typer.echo(f"cannot add {name}: {exc}", err=True)
        raise typer.Exit(2) from exc
    typer.echo(f"{name} -> {folder}")
    typer.echo("fine-tune it with model=" + repr(name) + "; restart a running `tunegate up` to serve it")


BaseUrlOpt = Annotated[
    str | None, typer.Option("--base-url", help="Gateway URL (default: TUNEGATE_BASE_URL, else host:port).")
]
ApiKeyOpt = Annotated[str | None, typer.Option("--api-key", help="API key (default: TUNEGATE_API_KEY).")]


@jobs_app.command("follow")
def jobs_follow(
    job_id: str,
    base_url: BaseUrlOpt = None,
    api_key: ApiKeyOpt = None,
    poll: Annotated[float, typer.Option(help="Seconds between polls.")] = 1.0,
) -> None:
    """Follow a fine-tuning job until it ends: step / total, reward and loss live, then the outcome."""
    from rich.console import Console

    from tunegate.client import make_client
    from tunegate.follow import follow_job

    settings = Settings()
    try:
        client = make_client(settings, base_url=base_url, api_key=api_key)
    except ValueError as exc:
        typer.echo(str(exc), err=True)
        raise typer.Exit(2) from exc
    result = follow_job(client, job_id, console=Console(), poll_s=poll)
    raise typer.Exit(0 if result.job.status == "succeeded" else 1)


@app.command()
def quickstart(
    data_dir: Annotated[Path, typer.Option(help="Data dir of the stack started (or found) here.")] = Path(
        ".tunegate"
    ),
    base_url: BaseUrlOpt = None,
    keep_running: Annotated[bool, typer.Option(help="Leave the stack running afterwards.")] = False,
    engine_port: Annotated[int | None, typer.Option(help="Engine port of a stack started here.")] = None,
    engine: Annotated[
        str | None,
        typer.Option(help="What serves the models of a stack started here: vllm, embedded, or auto."),
    ] = None,
) -> None:
    """Start the stack (unless one answers), train `tiny-chat` with RL on the example environment (default
    hyperparameters), score base and fine-tuned on held-out problems and draw the reward curves."""
    import openai
    from rich.console import Console

    from tunegate.client import api_base_url
    from tunegate.quickstart import run_quickstart

    chosen = _engine_option(engine) if engine is not None else None  # typer.Exit is a RuntimeError
    settings = Settings(data_dir=data_dir)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    console = Console()
    try:
        run_quickstart(
            settings,
            console=console,
            base_url=api_base_url(settings, base_url),
            keep_running=keep_running,
            engine_port=engine_port,
            engine=chosen,
        )
    except (RuntimeError, OSError, openai.APIError) as exc:
        console.print(f"[red]quickstart failed:[/red] {exc}", highlight=False)
        raise typer.Exit(1) from exc


@app.command("docs-settings")
def docs_settings() -> None:
    """Print the settings reference (Markdown) made from the Settings class: `> docs/settings.md`."""
    from tunegate.settings_doc import settings_markdown

    typer.echo(settings_markdown(), nl=False)


def main() -> None:
    app()
