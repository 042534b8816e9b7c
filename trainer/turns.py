"""The chat-template arithmetic of multi-turn episodes (:mod:`trainer.environment`): a prompt's tokens, an
assistant turn's tokens, the model's text as an OpenAI assistant message, and the tokens of the environment's
messages after a finished turn."""

from __future__ import annotations

import json
from typing import Any

from envsdk.graders import parse_tool_calls
from trainer.errors import TrainerError
from trainer.generation import stop_ids


def template_ids(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[int]:
    ids = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids)


def assistant_turn_ids(
    tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, call: dict[str, Any]
) -> list[int]:
    """Tokens of an assistant turn making tool call ``call`` as the chat template renders it after the
    generation prompt, up to and including its end-of-turn token."""
    arguments = call.get("arguments") or {}
    if isinstance(arguments, str):
        arguments = json.loads(arguments or "{}")
    turn = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": call["name"], "arguments": arguments}}],
    }
    prompt = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template([*messages, turn], tools=tools, tokenize=False)
    if not full.startswith(prompt):
        raise TrainerError("environment_error", "the chat template does not keep earlier turns as a prefix")
    ids = list(tokenizer.encode(full[len(prompt) :], add_special_tokens=False))
    stops = stop_ids(tokenizer)
    end = next((i for i, t in enumerate(ids) if t in stops), len(ids) - 1)
    return ids[: end + 1]


def assistant_message(text: str, turn: int) -> dict[str, Any]:
    """The model's turn as an OpenAI assistant message (``<tool_call>`` blocks become ``tool_calls``)."""
    for token in ("<|im_end|>", "<|endoftext|>"):
        text = text.replace(token, "")
    calls = parse_tool_calls(text)
    content = text.split("<tool_call>", 1)[0].strip() if calls else text.strip()
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"id": f"call_{turn}_{i}", **call} for i, call in enumerate(calls)]
    return message


def suffix_ids(tokenizer: Any, observation: list[dict[str, Any]], assistant: dict[str, Any]) -> list[int]:
    """Tokens of the environment's messages plus the next generation prompt, rendered by the chat template
    after a finished assistant turn (the turn's own end-of-turn token is already in the completion)."""
    dummy_assistant: dict[str, Any] = {"role": "assistant", "content": "x"}
    if any(m.get("role") == "tool" for m in observation):
        calls = assistant.get("tool_calls") or [
            {"type": "function", "function": {"name": "f", "arguments": "{}"}}
        ]
        dummy_assistant["tool_calls"] = [
            {"type": "function", "function": {"name": c["function"]["name"], "arguments": {}}} for c in calls
        ]
    dummy = [{"role": "user", "content": "x"}, dummy_assistant]
    prefix = list(tokenizer.apply_chat_template(dummy, tokenize=True, return_dict=False))
    full = list(
        tokenizer.apply_chat_template(
            dummy + observation, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )
    eos = [i for i, t in enumerate(prefix) if t == tokenizer.eos_token_id]
    if eos:
        prefix = prefix[: eos[-1] + 1]
    if full[: len(prefix)] != prefix:
        raise TrainerError("environment_error", "the chat template does not keep earlier turns as a prefix")
    return full[len(prefix) :]
