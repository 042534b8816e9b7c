"""The engine's HTTP routes, one module a route family, as vLLM's ``entrypoints/openai`` lays them out.

- ``generate``: ``/v1/chat/completions`` and ``/v1/completions``, JSON or server-sent events.
- ``models``: ``/v1/models``.
- ``lora``: vLLM's runtime LoRA endpoints, ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.
- ``tokenize``: vLLM's ``/tokenize`` (a chat's or a text's token ids).
- ``health``: ``/health``, ``/v1/engine/stats`` and the Prometheus ``/metrics``.
- ``errors``: every failure as OpenAI's error envelope.

Each module holds a module-level ``APIRouter``; ``inference.server.create_app`` includes them and puts the
one ``ServedModels`` on ``app.state``, which the routes take through ``deps.ModelsDep``.
"""
