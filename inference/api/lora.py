"""vLLM's runtime LoRA endpoints: ``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``,
answered in plain text as vLLM answers them."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from inference.api.deps import ModelsDep
from inference.protocol import LoadLoraAdapterRequest, UnloadLoraAdapterRequest

router = APIRouter()


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoraAdapterRequest, models: ModelsDep) -> PlainTextResponse:
    await models.load_adapter(body)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoraAdapterRequest, models: ModelsDep) -> PlainTextResponse:
    await models.unload_adapter(body)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
