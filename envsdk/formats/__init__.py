"""Adapters that run environments written for other frameworks as tunegate environments (stdlib-only:
they run inside the sandbox)."""
