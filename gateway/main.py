"""`gateway.main:app` — the app built from the environment's settings, for uvicorn."""

from gateway.app import create_app
from gateway.settings import Settings

app = create_app(Settings())
