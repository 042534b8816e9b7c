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

This module loads the model, checks and tokenizes prompts, queues and batches requests and keeps the
adapters resident; the requests and the generation loop of the worker thread (``BatchRunner``, which the
engine makes with its model host, decoder, lock and stop ids) are ``inference.generation``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from inference.adapters import Adapter, AdapterRegistry, LoraHost, read_adapter_config
from inference.errors import BadRequestError, EngineError, ModelNotFoundError, NotFoundError
from inference.generation import BatchRunner, ChoiceEvent, GenerationRequest
from inference.options import EngineOptions

__all__ = ["INLINE_TOKENIZE_CHARS", "ChoiceEvent", "GenerationRequest", "ModelEngine"]

logger = logging.getLogger(__name__)

INLINE_TOKENIZE_CHARS = 8192
"""Texts up to this long are tokenized on the event loop (well under a millisecond); longer ones on a
thread."""

_VISIBLE_SPECIALS = frozenset(
    {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}
)
"""Special tokens that are part of the output text (tool-call and reasoning markup), never hidden."""


class ModelEngine:
    """Serves one base model and the LoRA adapters attached to it, as ``options`` say."""

    def __init__(self, name: str, path: str, options: EngineOptions | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        options = options if options is not None else EngineOptions()
        self.name = name
        self.path = path
        self.max_batch_size = options.max_batch_size
        self.batch_window_s = options.batch_window_s
        self.default_max_tokens = options.default_max_tokens
        device = options.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = device
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        dtype = torch.float32 if device == "cpu" else "auto"
        model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        model = model.to(device)
        model.eval()
        self.host = LoraHost(model)
        self.registry = AdapterRegistry(options.max_loras)
        own = int(getattr(model.config, "max_position_embeddings", 2048))
        max_model_len = options.max_model_len
        self.max_context = min(own, max_model_len) if max_model_len is not None else own
        """Most tokens of prompt and completion in one request: the model's own context, or ``max_model_len``
        when that is less (as vLLM's ``--max-model-len``)."""
        self.longest_token_chars = _longest_token_chars(self.tokenizer)
        self.max_prompt_chars = self.max_context * self.longest_token_chars
        """No prompt longer than this fits the context: each token stands for at most
        ``longest_token_chars`` characters (for byte-level BPE its bytes, which a character takes one or
        more of)."""
        stop_ids = self._collect_stop_ids(model)
        self._hidden_ids = {
            int(i)
            for i in self.tokenizer.all_special_ids
            if self.tokenizer.convert_ids_to_tokens(int(i)) not in _VISIBLE_SPECIALS
        }
        self._lock = threading.RLock()
        self._pool = ThreadPoolExecutor(
            max_workers=options.max_concurrent_batches + 1, thread_name_prefix=f"engine-{name}"
        )
        self._slots = asyncio.Semaphore(options.max_concurrent_batches)
        self._waiting: deque[GenerationRequest] = deque()
        self._running: set[int] = set()
        """Ids of the requests in a running batch (the runner drops each as its last choice ends)."""
        self.runner = BatchRunner(
            name=name,
            host=self.host,
            device=device,
            decode=self.decode,
            lock=self._lock,
            stop_ids=stop_ids,
            pad_id=int(pad if (pad := self.tokenizer.pad_token_id) is not None else next(iter(stop_ids), 0)),
            running=self._running,
        )
        self._wake = asyncio.Event()
        self._scheduler: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self.base_parameter_count = self.host.parameter_count()
        self.adapter_loads = 0
        """Adapters loaded into the model so far (first loads, and reloads after an eviction)."""
        self.adapter_evictions = 0
        """Resident adapters evicted under the ``max_loras`` cap so far (unloads by name not counted)."""
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
            "batches_run": self.runner.batches_run,
            "largest_batch": self.runner.largest_batch,
            "adapter_loads": self.adapter_loads,
            "adapter_evictions": self.adapter_evictions,
            "tokens_generated": self.runner.tokens_generated,
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
            self.adapter_evictions += 1
        try:
            self.host.load(adapter.key, adapter.path)
        except Exception as exc:
            self.host.keys.discard(adapter.key)
            msg = f"Failed to load LoRA adapter '{adapter.name}': {exc}"
            raise BadRequestError(msg, param="lora_path") from exc
        self.registry.mark_resident(adapter)
        self.adapter_loads += 1

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
                self.adapter_evictions += 1

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
                await loop.run_in_executor(self._pool, self.runner.run, batch)
            finally:
                for req in batch:
                    self._running.discard(req.id)
                await loop.run_in_executor(self._pool, self._unpin, adapters)
        finally:
            self._slots.release()


def _longest_token_chars(tokenizer: Any) -> int:
    """Characters of the longest token in ``tokenizer``'s vocabulary, as written there (for byte-level BPE,
    one per byte; added and special tokens included)."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max((len(t) for t in tokens if isinstance(t, str)), default=1) or 1
