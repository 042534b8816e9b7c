"""
FastAPI application for the Guess Environment.

Endpoints (OpenEnv's): POST /reset, POST /step, GET /state, GET /schema, WS /ws.

Usage:
    uvicorn server.app:app --host 0.0.0.0 --port 8000
"""

try:
    from openenv.core.env_server.http_server import create_app
except Exception as e:  # pragma: no cover
    raise ImportError("openenv-core is required: pip install openenv-core") from e

try:
    from ..models import GuessAction, GuessObservation
    from .guess_environment import GuessEnvironment
except ImportError:
    from models import GuessAction, GuessObservation

    from server.guess_environment import GuessEnvironment


app = create_app(
    GuessEnvironment,
    GuessAction,
    GuessObservation,
    env_name="guess",
    max_concurrent_envs=64,  # one WebSocket session per concurrent episode
)


def main(host: str = "0.0.0.0", port: int = 8000):
    import uvicorn

    uvicorn.run(app, host=host, port=port)


if __name__ == "__main__":
    main()
