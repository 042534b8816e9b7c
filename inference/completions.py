"""``/v1/completions``: legacy text completions over raw prompts (text or token ids).

``prompt`` may be a string, a list of strings, a list of token ids or a list of such lists; every prompt
gets ``n`` choices, numbered ``prompt_index * n + i``. ``echo`` puts the prompt text in front of each
choice; ``logprobs: k`` returns the legacy shape ``{tokens, token_logprobs, top_logprobs, text_offset}``
for the generated tokens (echoed prompt tokens are listed with ``null`` log-probabilities).
``return_token_ids`` (vLLM's extra parameter, which the gateway's capture asks for) puts each choice's
prompt ids (``prompt_token_ids``) and sampled ids (``token_ids``) on the choice, as vLLM does.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from typing import Any

from inference.chunks import DONE, ChunkStream, answer, answer_id
from inference.engine import ChoiceEvent, GenerationRequest, ModelEngine
from inference.errors import BadRequestError
from inference.protocol import CompletionRequest
from inference.sampling import TokenLogprob

logger = logging.getLogger(__name__)


async def _prompts(engine: ModelEngine, req: CompletionRequest) -> list[list[int]]:
    """Each prompt's token ids; a prompt that cannot fit the context is refused before it is tokenized
    (texts by their length, token lists by their count), and a long text is tokenized on a thread."""
    prompt = req.prompt
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise BadRequestError("The prompt is empty.", param="prompt")
    for item in items:
        if isinstance(item, str):
            engine.check_prompt_chars(len(item), "prompt")
        else:
            _within_context(engine, len(item))
    vocab = len(engine.tokenizer)
    out: list[list[int]] = []
    for item in items:
        if isinstance(item, str):
            ids = await engine.encode_async(item)
            _within_context(engine, len(ids))
        else:
            ids = [int(t) for t in item]
            if any(t < 0 or t >= vocab for t in ids):
                raise BadRequestError("Token id out of range.", param="prompt")
        out.append(ids)
    return out


def _within_context(engine: ModelEngine, tokens: int) -> None:
    """A 400 naming `prompt` when a prompt of `tokens` leaves no room in the context."""
    if tokens >= engine.max_context:
        raise BadRequestError(
            f"The prompt has {tokens} tokens; this model's context is {engine.max_context}.",
            param="prompt",
            code="context_length_exceeded",
        )


class _Legacy:
    """Accumulates one choice in the legacy logprobs shape."""

    def __init__(self, engine: ModelEngine, offset: int, as_ids: bool = False) -> None:
        self.engine = engine
        self.as_ids = as_ids
        """vLLM's `return_tokens_as_token_ids`: tokens as `token_id:<id>`, so a client gets the exact ids."""
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top: list[dict[str, float] | None] = []
        self.offsets: list[int] = []
        self.offset = offset

    def _token(self, tid: int) -> str:
        return f"token_id:{tid}" if self.as_ids else self.engine.decode([tid], skip_special_tokens=False)

    def add_prompt(self, ids: list[int]) -> None:
        for tid in ids:
            self._add(self._token(tid), None, None)

    def add(self, entries: list[TokenLogprob]) -> None:
        for e in entries:
            top = {self._token(t): lp for t, lp in e.top}
            self._add(self._token(e.token_id), e.logprob, top)

    def _add(self, token: str, logprob: float | None, top: dict[str, float] | None) -> None:
        self.tokens.append(token)
        self.token_logprobs.append(logprob)
        self.top.append(top)
        self.offsets.append(self.offset)
        self.offset += len(token)

    def body(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top,
            "text_offset": self.offsets,
        }


async def _submit(engine: ModelEngine, req: CompletionRequest) -> list[GenerationRequest]:
    adapter = engine.resolve(req.model)
    prompts = await _prompts(engine, req)
    gens = []
    try:
        for ids in prompts:
            gen = GenerationRequest(
                prompt_ids=ids,
                params=req.to_sampling_params(engine.default_max_tokens),
                n=req.n,
                adapter=adapter,
            )
            gens.append(engine.submit(gen))
    except Exception:
        for gen in gens:
            engine.cancel(gen)
        raise
    return gens


async def completion(engine: ModelEngine, req: CompletionRequest) -> dict[str, Any]:
    """A whole ``text_completion`` object."""
    gens = await _submit(engine, req)
    choices: list[dict[str, Any]] = []
    completion_tokens = 0
    try:
        for p, gen in enumerate(gens):
            prompt_text = engine.decode(gen.prompt_ids, skip_special_tokens=False) if req.echo else ""
            texts = [prompt_text] * req.n
            sampled: list[list[int]] = [[] for _ in range(req.n)]
            reasons = ["stop"] * req.n
            legacy = [
                _Legacy(engine, len(prompt_text) if not req.echo else 0, req.return_tokens_as_token_ids)
                for _ in range(req.n)
            ]
            if req.echo and req.logprobs is not None:
                for lg in legacy:
                    lg.add_prompt(gen.prompt_ids)
            async for event in gen.events():
                texts[event.index] += event.text
                sampled[event.index].extend(event.token_ids)
                completion_tokens += len(event.token_ids)
                legacy[event.index].add(event.logprobs)
                if event.finish_reason is not None:
                    reasons[event.index] = event.finish_reason
            for i in range(req.n):
                choice: dict[str, Any] = {
                    "index": p * req.n + i,
                    "text": texts[i],
                    "finish_reason": reasons[i],
                    "logprobs": legacy[i].body() if req.logprobs is not None else None,
                }
                if req.return_token_ids:
                    choice["prompt_token_ids"] = list(gen.prompt_ids)
                    choice["token_ids"] = sampled[i]
                choices.append(choice)
    finally:
        for gen in gens:
            engine.cancel(gen)
    prompt_tokens = sum(len(g.prompt_ids) for g in gens)
    return answer("text_completion", "cmpl-", req.model, choices, prompt_tokens, completion_tokens)


async def completion_stream(engine: ModelEngine, req: CompletionRequest) -> AsyncGenerator[str, None]:
    """``text_completion`` SSE lines, choices of all prompts interleaved as they come."""
    import asyncio

    gens = await _submit(engine, req)
    chunks = ChunkStream(
        "text_completion", req.model, req.include_usage(), answer_id("cmpl-"), fingerprint_with_usage=False
    )
    queue: asyncio.Queue[tuple[int, ChoiceEvent] | BaseException | None] = asyncio.Queue()

    async def pump(p: int, gen: GenerationRequest) -> None:
        try:
            async for event in gen.events():
                await queue.put((p, event))
        except BaseException as exc:  # handed to the consumer, which re-raises it
            await queue.put(exc)
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(p, g)) for p, g in enumerate(gens)]
    try:
        completion_tokens = 0
        echoed: set[int] = set()
        started: set[int] = set()
        open_pumps = len(tasks)
        while open_pumps:
            item = await queue.get()
            if item is None:
                open_pumps -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            p, event = item
            gen = gens[p]
            index = p * req.n + event.index
            completion_tokens += len(event.token_ids)
            text = event.text
            legacy = _Legacy(engine, 0, req.return_tokens_as_token_ids)
            if req.echo and index not in echoed:
                echoed.add(index)
                text = engine.decode(gen.prompt_ids, skip_special_tokens=False) + text
                if req.logprobs is not None:
                    legacy.add_prompt(gen.prompt_ids)
            legacy.add(event.logprobs)
            lp = legacy.body() if req.logprobs is not None else None
            piece: dict[str, Any] = {
                "index": index,
                "text": text,
                "logprobs": lp,
                "finish_reason": event.finish_reason,
            }
            if req.return_token_ids:
                piece["prompt_token_ids"] = None if index in started else list(gen.prompt_ids)
                piece["token_ids"] = list(event.token_ids)
                started.add(index)
            yield chunks.choice(piece)
        if chunks.include_usage:
            yield chunks.usage(sum(len(g.prompt_ids) for g in gens), completion_tokens)
        yield DONE
    finally:
        for task in tasks:
            task.cancel()
        for gen in gens:
            engine.cancel(gen)
