"""One base model's engine: request queue, dynamic batching, and the token-by-token generation loop.

A scheduler task collects the requests that arrive within a short window (up to ``max_batch_size`` rows and
``max_loras`` distinct adapters) and hands them as one batch to a worker thread. The thread prefills the
left-padded prompts once, then decodes step by step with a KV cache, calling the PEFT model with
``adapter_names`` so rows of different adapters (``"__base__"`` for none) share every forward pass. Each
step samples every row with its own generator, detokenizes incrementally, applies stop strings, and pushes
the new text to the request's asyncio queue, so streams see tokens as they come. Rows whose request was
cancelled (the client went away) or that finished are dropped from the batch and its cache; the loop ends
when no row is left.

Prompts are held to the model's context before they cost anything: text longer than the context times the
longest token (``max_prompt_chars``) cannot fit and is refused by its length alone, and a long prompt is
tokenized on a thread (the tokenizer lets go of the interpreter's lock), so a huge one never stalls the
event loop that every other request shares.

Several batches may be in flight at once (``max_concurrent_batches``): they interleave step by step under
the model lock, so a long generation does not hold the others back. Adapter loads and unloads take the
same lock between steps; adapters used by a running batch are pinned and never evicted.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from inference.adapters import BASE_ADAPTER, Adapter, AdapterRegistry, LoraHost, read_adapter_config
from inference.errors import BadRequestError, EngineError, ModelNotFoundError, NotFoundError
from inference.sampling import SamplingParams, TokenLogprob, make_generator, sample_row, token_logprob

logger = logging.getLogger(__name__)

_request_ids = itertools.count(1)

INLINE_TOKENIZE_CHARS = 8192
"""Texts up to this long are tokenized on the event loop (well under a millisecond); longer ones on a
thread."""

_VISIBLE_SPECIALS = frozenset(
    {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}
)
"""Special tokens that are part of the output text (tool-call and reasoning markup), never hidden."""


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


class ModelEngine:
    """Serves one base model and the LoRA adapters attached to it."""

    def __init__(
        self,
        name: str,
        path: str,
        *,
        max_loras: int = 8,
        max_batch_size: int = 16,
        device: str = "auto",
        batch_window_s: float = 0.005,
        max_concurrent_batches: int = 4,
        default_max_tokens: int = 1024,
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.name = name
        self.path = path
        self.max_batch_size = max_batch_size
        self.batch_window_s = batch_window_s
        self.default_max_tokens = default_max_tokens
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = device
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        dtype = torch.float32 if device == "cpu" else "auto"
        model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        model = model.to(device)
        model.eval()
        self.config = model.config
        # transformers 5 renamed the forward's ``past_key_values`` to ``cache``
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self.host = LoraHost(model)
        self.registry = AdapterRegistry(max_loras)
        self.max_context = int(getattr(model.config, "max_position_embeddings", 2048))
        self.longest_token_chars = _longest_token_chars(self.tokenizer)
        self.max_prompt_chars = self.max_context * self.longest_token_chars
        """No prompt longer than this fits the context: each token stands for at most
        ``longest_token_chars`` characters (for byte-level BPE its bytes, which a character takes one or
        more of)."""
        self._stop_ids = self._collect_stop_ids(model)
        self._hidden_ids = {
            int(i)
            for i in self.tokenizer.all_special_ids
            if self.tokenizer.convert_ids_to_tokens(int(i)) not in _VISIBLE_SPECIALS
        }
        pad = self.tokenizer.pad_token_id
        self._pad_id = int(pad if pad is not None else next(iter(self._stop_ids), 0))
        self._lock = threading.RLock()
        self._pool = ThreadPoolExecutor(
            max_workers=max_concurrent_batches + 1, thread_name_prefix=f"engine-{name}"
        )
        self._slots = asyncio.Semaphore(max_concurrent_batches)
        self._waiting: deque[GenerationRequest] = deque()
        self._running: set[int] = set()
        self._wake = asyncio.Event()
        self._scheduler: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.base_parameter_count = self.host.parameter_count()
        self.batches_run = 0
        self.largest_batch = 0
        self.tokens_generated = 0
        logger.info("engine %s: loaded %s on %s", name, path, device)

    def _collect_stop_ids(self, model: Any) -> set[int]:
        ids: set[int] = set()
        for source in (getattr(model, "generation_config", None), self.tokenizer):
            eos = getattr(source, "eos_token_id", None)
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, list):
                ids.update(int(e) for e in eos)
        for tok in ("<|im_end|>", "<|endoftext|>"):
            tid = self.tokenizer.convert_tokens_to_ids(tok)
            if isinstance(tid, int) and tid != self.tokenizer.unk_token_id:
                ids.add(tid)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of token ids; ``skip_special_tokens`` hides control tokens but keeps tool-call markup."""
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._hidden_ids]
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._scheduler is None:
            self._scheduler = asyncio.get_running_loop().create_task(self._schedule())

    async def stop(self) -> None:
        if self._scheduler is not None:
            self._scheduler.cancel()
            await asyncio.gather(self._scheduler, return_exceptions=True)
            self._scheduler = None
        for req in list(self._waiting):
            req.cancelled = True
        self._waiting.clear()
        for task in list(self._tasks):
            task.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ prompts
    def check_prompt_chars(self, chars: int, param: str) -> None:
        """A 400 ``context_length_exceeded`` naming ``param`` when a prompt of ``chars`` characters cannot
        fit the context (checked before it is rendered or tokenized)."""
        if chars > self.max_prompt_chars:
            raise BadRequestError(
                f"The prompt is {chars} characters; this model's context of {self.max_context} tokens holds "
                f"at most {self.max_prompt_chars} characters.",
                param=param,
                code="context_length_exceeded",
            )

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (blocking: see ``encode_async``)."""
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    async def encode_async(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``: on the loop when it is short, else on a thread."""
        if len(text) <= INLINE_TOKENIZE_CHARS:
            return self.encode(text, add_special_tokens=add_special_tokens)
        return await asyncio.to_thread(self.encode, text, add_special_tokens=add_special_tokens)

    # ------------------------------------------------------------------ requests
    def resolve(self, model: str) -> Adapter | None:
        """The adapter called ``model`` (``None`` for the base model itself); 404 if unknown."""
        if model == self.name:
            return None
        adapter = self.registry.get(model)
        if adapter is None:
            raise ModelNotFoundError(model)
        return adapter

    def submit(self, req: GenerationRequest) -> GenerationRequest:
        """Queue ``req``; read its output with ``req.events()`` and call :meth:`cancel` to abandon it."""
        budget = self.max_context - len(req.prompt_ids)
        if not req.prompt_ids:
            raise BadRequestError("The prompt is empty.", param="messages")
        if budget <= 0:
            raise BadRequestError(
                f"The prompt has {len(req.prompt_ids)} tokens; this model's context is {self.max_context}.",
                param="messages",
                code="context_length_exceeded",
            )
        if req.params.max_tokens > budget:
            req.params.max_tokens = budget
        req._attach(asyncio.get_running_loop())
        self._waiting.append(req)
        self._wake.set()
        return req

    def cancel(self, req: GenerationRequest) -> None:
        """Stop work on ``req``: drop it from the queue, or from its batch at the next step."""
        req.cancelled = True
        try:
            self._waiting.remove(req)
        except ValueError:
            pass

    def stats(self) -> dict[str, Any]:
        return {
            "running": len(self._running),
            "waiting": len(self._waiting),
            "loaded_adapters": [a.name for a in self.registry.resident()],
            "known_adapters": sorted(self.registry.known),
            "max_loras": self.registry.max_loras,
            "max_batch_size": self.max_batch_size,
            "batches_run": self.batches_run,
            "largest_batch": self.largest_batch,
            "tokens_generated": self.tokens_generated,
        }

    # ------------------------------------------------------------------ adapters
    def load_adapter(self, name: str, path: str, *, load_inplace: bool = False) -> Adapter:
        """Load (or with ``load_inplace`` replace) adapter ``name``; blocking, call from a thread."""
        read_adapter_config(path)
        with self._lock:
            existing = self.registry.get(name)
            if existing is not None and not load_inplace:
                msg = f"The lora adapter '{name}' has already been loaded."
                raise BadRequestError(msg, param="lora_name")
            if existing is not None:
                self._drop(existing)
            adapter = self.registry.add(name, path)
            try:
                self._make_resident(adapter)
            except EngineError:
                self.registry.forget(name)
                raise
            return adapter

    def unload_adapter(self, name: str) -> None:
        """Forget adapter ``name`` and free its weights (once no running batch uses them)."""
        with self._lock:
            adapter = self.registry.get(name)
            if adapter is None:
                raise NotFoundError(f"The lora adapter '{name}' cannot be found.", param="lora_name")
            self._drop(adapter)

    def _drop(self, adapter: Adapter) -> None:
        self.registry.forget(adapter.name)
        if adapter.resident:
            if adapter.pins:
                adapter.doomed = True
            else:
                self.host.delete(adapter.key)
                adapter.resident = False

    def _make_resident(self, adapter: Adapter) -> None:
        """Load ``adapter`` into the model, evicting least recently used ones over the cap (lock held)."""
        if adapter.resident:
            self.registry.touch(adapter.name)
            return
        for victim in self.registry.victims(1):
            logger.info("engine %s: evicting adapter %s", self.name, victim.name)
            self.host.delete(victim.key)
            self.registry.mark_evicted(victim)
        try:
            self.host.load(adapter.key, adapter.path)
        except Exception as exc:
            self.host.keys.discard(adapter.key)
            msg = f"Failed to load LoRA adapter '{adapter.name}': {exc}"
            raise BadRequestError(msg, param="lora_path") from exc
        self.registry.mark_resident(adapter)

    def _pin(self, adapters: list[Adapter]) -> None:
        with self._lock:
            for adapter in adapters:
                if self.registry.get(adapter.name) is not adapter:
                    raise ModelNotFoundError(adapter.name)
            for adapter in adapters:
                self._make_resident(adapter)
                adapter.pins += 1

    def _unpin(self, adapters: list[Adapter]) -> None:
        with self._lock:
            for adapter in adapters:
                adapter.pins -= 1
                if adapter.pins == 0 and adapter.doomed and adapter.resident:
                    self.host.delete(adapter.key)
                    adapter.resident = False
            for victim in self.registry.victims(0):
                self.host.delete(victim.key)
                self.registry.mark_evicted(victim)

    # ------------------------------------------------------------------ scheduling
    async def _schedule(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._waiting:
                self._wake.clear()
                await self._wake.wait()
                continue
            await asyncio.sleep(self.batch_window_s)
            await self._slots.acquire()
            batch = self._take_batch()
            if not batch:
                self._slots.release()
                continue
            task = loop.create_task(self._dispatch(batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _take_batch(self) -> list[GenerationRequest]:
        batch: list[GenerationRequest] = []
        rows = 0
        adapters: set[str] = set()
        deferred: list[GenerationRequest] = []
        while self._waiting:
            req = self._waiting.popleft()
            if req.cancelled:
                continue
            name = req.adapter.name if req.adapter is not None else None
            new_adapter = name is not None and name not in adapters
            too_many_rows = batch and rows + req.n > self.max_batch_size
            too_many_adapters = batch and new_adapter and len(adapters) >= self.registry.max_loras
            if too_many_rows or too_many_adapters:
                deferred.append(req)
                if too_many_rows:
                    break
                continue
            batch.append(req)
            rows += req.n
            if name is not None:
                adapters.add(name)
        self._waiting.extendleft(reversed(deferred))
        return batch

    async def _dispatch(self, batch: list[GenerationRequest]) -> None:
        loop = asyncio.get_running_loop()
        adapters = list({id(r.adapter): r.adapter for r in batch if r.adapter is not None}.values())
        try:
            try:
                await loop.run_in_executor(self._pool, self._pin, adapters)
            except EngineError as exc:
                # one adapter vanished (unloaded meanwhile): fail its requests, retry the others
                for req in batch:
                    if req.adapter is not None and self.registry.get(req.adapter.name) is not req.adapter:
                        req._emit(ModelNotFoundError(req.adapter.name))
                    else:
                        self._waiting.appendleft(req)
                self._wake.set()
                logger.info("engine %s: batch re-queued: %s", self.name, exc.message)
                return
            for req in batch:
                self._running.add(req.id)
            try:
                await loop.run_in_executor(self._pool, self._run_batch, batch)
            finally:
                for req in batch:
                    self._running.discard(req.id)
                await loop.run_in_executor(self._pool, self._unpin, adapters)
        finally:
            self._slots.release()

    # ------------------------------------------------------------------ generation (worker thread)
    def _run_batch(self, batch: list[GenerationRequest]) -> None:
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
        with self._lock:
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
                **{self._cache_kwarg: cache},
                **kwargs,
            )
        return out.logits[:, -1, :].float().cpu()

    def _generate(self, rows: list[_Row]) -> None:
        import torch
        from transformers import DynamicCache

        device = self.device
        width = max(len(r.req.prompt_ids) for r in rows)
        input_ids = torch.full((len(rows), width), self._pad_id, dtype=torch.long)
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
                            self._running.discard(row.req.id)
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
        if token_id in self._stop_ids and not params.ignore_eos:
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


def _longest_token_chars(tokenizer: Any) -> int:
    """Characters of the longest token in ``tokenizer``'s vocabulary, as written there (for byte-level BPE,
    one per byte; added and special tokens included)."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max((len(t) for t in tokens if isinstance(t, str)), default=1) or 1
