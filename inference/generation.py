"""The engine's requests and its worker-thread half: the token-by-token generation of one batch.

A ``GenerationRequest`` carries a prompt to complete ``n`` times and an asyncio queue of ``ChoiceEvent``s. A
``BatchRunner`` runs the batch that ``inference.engine.ModelEngine`` hands to a worker thread: it is
prefilled once (left-padded prompts), then decoded step by step with a KV cache, calling the PEFT model with
``adapter_names`` so rows of different adapters (``"__base__"`` for none) share every forward pass. Each step
samples every row with its own generator, detokenizes incrementally, applies stop strings, and pushes the
new text to the request's queue, so streams see tokens as they come. Rows whose request was cancelled or
that finished are dropped from the batch and its cache; the loop ends when no row is left.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from inference.adapters import BASE_ADAPTER, Adapter, LoraHost
from inference.errors import EngineError
from inference.sampling import SamplingParams, TokenLogprob, make_generator, sample_row, token_logprob

logger = logging.getLogger("inference.engine")  # the engine's logger: these are its messages

_request_ids = itertools.count(1)


@dataclass
class ChoiceEvent:
    """New output of one choice: text decoded since the last event, its tokens, and maybe the finish.

    Tokens whose text is held back (a possible stop string, an incomplete UTF-8 sequence) travel with the
    next event, so the events of a choice account for every generated token exactly once.
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None = None


@dataclass
class GenerationRequest:
    """A prompt to complete ``n`` times with one adapter (or the base model)."""

    prompt_ids: list[int]
    params: SamplingParams
    n: int = 1
    adapter: Adapter | None = None
    stop_check: Callable[[str], bool] | None = None
    """Extra stopping rule on a choice's whole text (used to end forced JSON as soon as it is complete)."""
    id: int = field(default_factory=lambda: next(_request_ids))
    cancelled: bool = False
    _loop: asyncio.AbstractEventLoop | None = None
    _queue: asyncio.Queue[ChoiceEvent | BaseException] | None = None
    _open_rows: int = 0

    def _attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queue = asyncio.Queue()
        self._open_rows = self.n

    def _emit(self, item: ChoiceEvent | BaseException) -> None:
        """Called from the worker thread."""
        assert self._loop is not None and self._queue is not None
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            self.cancelled = True

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        """Output events until every choice has finished; raises the batch's error if it failed."""
        assert self._queue is not None
        remaining = self.n
        while remaining:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finish_reason is not None:
                remaining -= 1
            yield item


@dataclass
class _Row:
    req: GenerationRequest
    index: int
    generator: Any
    ids: list[int] = field(default_factory=list)
    count: int = 0
    sent: int = 0
    pending: list[int] = field(default_factory=list)
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    done: bool = False


@dataclass(eq=False, kw_only=True)
class BatchRunner:
    """Runs one batch to its end on a worker thread: prefill, then one token a step for every row, each
    row's new text sent to its request as it comes. Several batches may run at once on different threads;
    they interleave step by step under ``lock``, which adapter loads and unloads take too.

    ``ModelEngine`` makes one when it loads its model and hands it what generation needs of the model.
    """

    name: str
    """The base model's served name (for the log)."""
    host: LoraHost
    """The model (with its adapters) that runs the steps."""
    device: str
    decode: Callable[[list[int]], str]
    """Token ids -> their visible text (control tokens hidden, tool-call markup kept)."""
    lock: threading.RLock
    """The model lock: held for each forward pass."""
    stop_ids: set[int]
    """Tokens that end a choice (unless its request ignores EOS)."""
    pad_id: int
    """The token left-padded prompts are padded with."""
    running: set[int]
    """Ids of the requests in a running batch (the engine's); a request leaves it when its last choice
    ends."""
    batches_run: int = field(default=0, init=False)
    largest_batch: int = field(default=0, init=False)
    """Most rows in one batch so far."""
    tokens_generated: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.config = self.host.base.config
        # transformers 5 renamed the forward's ``past_key_values`` to ``cache``
        params = inspect.signature(self.host.base.forward).parameters
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"

    # ------------------------------------------------------------------ generation (worker thread)
    def run(self, batch: list[GenerationRequest]) -> None:
        """Generate every choice of ``batch`` (blocking: call on a worker thread); a failure ends each of
        its requests with an ``EngineError``."""
        rows = [
            _Row(req=req, index=i, generator=make_generator(req.params.row_seed(i)))
            for req in batch
            for i in range(req.n)
        ]
        self.batches_run += 1
        self.largest_batch = max(self.largest_batch, len(rows))
        try:
            self._generate(rows)
        except Exception as exc:
            logger.exception("engine %s: batch failed", self.name)
            err = EngineError(f"Generation failed: {exc}")
            for req in batch:
                req._emit(err)

    def _forward(self, input_ids: Any, mask: Any, positions: Any, cache: Any, rows: list[_Row]) -> Any:
        kwargs: dict[str, Any] = {}
        with self.lock:
            if self.host.keys:
                kwargs["adapter_names"] = [
                    r.req.adapter.key if r.req.adapter is not None else BASE_ADAPTER for r in rows
                ]
            out = self.host.model(
                input_ids=input_ids,
                attention_mask=mask,
                position_ids=positions,
                use_cache=True,
                logits_to_keep=1,
                **{self.cache_kwarg: cache},
                **kwargs,
            )
        return out.logits[:, -1, :].float().cpu()

    def _generate(self, rows: list[_Row]) -> None:
        import torch
        from transformers import DynamicCache

        device = self.device
        width = max(len(r.req.prompt_ids) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids = row.req.prompt_ids
            input_ids[i, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            mask[i, width - len(ids) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.config)
        with torch.inference_mode():
            logits = self._forward(input_ids.to(device), mask.to(device), positions.to(device), cache, rows)
            last_pos = positions[:, -1]
            while True:
                keep: list[int] = []
                next_ids: list[int] = []
                for i, row in enumerate(rows):
                    if row.req.cancelled:
                        row.done = True
                        continue
                    params = row.req.params
                    tok = sample_row(logits[i], params, row.generator)
                    lp = token_logprob(logits[i], tok, params.top_logprobs) if params.logprobs else None
                    event = self._advance(row, tok, lp)
                    if event is not None:
                        row.req._emit(event)
                    if row.done:
                        row.req._open_rows -= 1
                        if row.req._open_rows == 0:
                            self.running.discard(row.req.id)
                    else:
                        keep.append(i)
                        next_ids.append(tok)
                if not keep:
                    return
                if len(keep) < len(rows):
                    index = torch.tensor(keep, dtype=torch.long)
                    cache.batch_select_indices(index.to(device))
                    mask = mask[index]
                    last_pos = last_pos[index]
                    rows = [rows[i] for i in keep]
                mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=torch.long)], dim=1)
                last_pos = last_pos + 1
                logits = self._forward(
                    torch.tensor(next_ids, dtype=torch.long, device=device)[:, None],
                    mask.to(device),
                    last_pos[:, None].to(device),
                    cache,
                    rows,
                )

    def _advance(self, row: _Row, token_id: int, lp: TokenLogprob | None) -> ChoiceEvent | None:
        """Account one sampled token to ``row``; the event to send, if any."""
        params = row.req.params
        row.count += 1
        self.tokens_generated += 1
        row.pending.append(token_id)
        if lp is not None:
            row.pending_logprobs.append(lp)
        finish: str | None = None
        if (token_id in self.stop_ids and not params.ignore_eos) or token_id in params.stop_token_ids:
            finish = "stop"
        else:
            row.ids.append(token_id)
        text = self.decode(row.ids)
        if params.stop:
            cut = -1
            for s in params.stop:
                pos = text.find(s, row.sent)
                if pos != -1 and (cut == -1 or pos < cut):
                    cut = pos
            if cut != -1:
                text = text[:cut]
                finish = "stop"
        if finish is None and row.req.stop_check is not None and row.req.stop_check(text):
            finish = "stop"
        if finish is None and row.count >= params.max_tokens:
            finish = "length"
        if finish is None:
            safe = len(text)
            if params.stop:
                safe -= max(len(s) for s in params.stop) - 1
            if text.endswith("\ufffd"):
                safe = min(safe, len(text) - 1)
            safe = max(safe, row.sent)
        else:
            safe = max(len(text), row.sent)
            row.done = True
        delta = text[row.sent : safe]
        row.sent = safe
        if not delta and finish is None:
            return None
        event = ChoiceEvent(
            index=row.index,
            text=delta,
            token_ids=row.pending,
            logprobs=row.pending_logprobs,
            finish_reason=finish,
        )
        row.pending = []
        row.pending_logprobs = []
        return event
