"""``GET /health``, the engine's own counters (``GET /v1/engine/stats``) and the same as Prometheus text
(``GET /metrics``, with vLLM's ``vllm:lora_requests_info`` line, which the gateway reads as vLLM's)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse, Response

from inference.api.deps import ModelsDep

router = APIRouter()


@router.get("/health")
async def health() -> Response:
    return Response(status_code=200)


@router.get("/v1/engine/stats")
async def stats(models: ModelsDep) -> dict[str, Any]:
    per_model = models.stats()
    return {
        "running": sum(s["running"] for s in per_model.values()),
        "waiting": sum(s["waiting"] for s in per_model.values()),
        "models": per_model,
    }


@router.get("/metrics")
async def metrics(models: ModelsDep) -> PlainTextResponse:
    lines = []
    for name, s in models.stats().items():
        lines.append(f'tunegate_engine_requests_running{{model_name="{name}"}} {s["running"]}')
        lines.append(f'tunegate_engine_requests_waiting{{model_name="{name}"}} {s["waiting"]}')
        lines.append(
            f'tunegate_engine_generation_tokens_total{{model_name="{name}"}} {s["tokens_generated"]}'
        )
        lines.append(f'tunegate_engine_loaded_adapters{{model_name="{name}"}} {len(s["loaded_adapters"])}')
        running = ",".join(s["loaded_adapters"])
        lines.append(
            f'vllm:lora_requests_info{{model_name="{name}",running_lora_adapters="{running}",'
            f'waiting_lora_adapters="",max_lora="{s["max_loras"]}"}} 1'
        )
    return PlainTextResponse("\n".join(lines) + "\n")
