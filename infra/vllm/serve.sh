#!/usr/bin/env bash
# Serve one base model with vLLM and runtime LoRA adapters: the GPU twin of `python -m inference`.
# Usage: infra/vllm/serve.sh BASE_MODEL_PATH SERVED_NAME [PORT]
# Tunables (environment): MAX_LORAS (8), MAX_CPU_LORAS (16), MAX_LORA_RANK (64), GPU_MEMORY_UTILIZATION (0.9)
set -euo pipefail

BASE="${1:?base model path}"
NAME="${2:?served model name}"
PORT="${3:-8000}"

export VLLM_ALLOW_RUNTIME_LORA_UPDATING=True

exec vllm serve "$BASE" \
  --served-model-name "$NAME" \
  --host 0.0.0.0 --port "$PORT" \
  --enable-lora \
  --max-loras "${MAX_LORAS:-8}" \
  --max-cpu-loras "${MAX_CPU_LORAS:-16}" \
  --max-lora-rank "${MAX_LORA_RANK:-64}" \
  --gpu-memory-utilization "${GPU_MEMORY_UTILIZATION:-0.9}"
