"""Capture for one gateway: which requests are captured (`CapturePolicies`), the calls into closed episodes
refused, and the records written in the background (`CaptureWriter`).

The proxy calls `Capturer.begin` only for an organisation found in `CapturePolicies.orgs` or an episode key
(one dict lookup, which is all a request of an organisation without capture costs). A chat completion is
captured when it says `store: true` or is a call of an episode (`gateway.capture.recorder`); a text
completion when it is a call of an episode (`gateway.capture.text_capture`).
"""

from __future__ import annotations

import logging
import time

import asyncpg
from starlette.types import Scope

from gateway.capture import store
from gateway.capture.policy import CapturePolicies
from gateway.capture.protocol import DEFAULT_RETENTION_DAYS, check_metadata
from gateway.capture.recorder import CHAT_PATH, Capture, episode_of
from gateway.capture.text_capture import COMPLETIONS_PATH, TextCapture, check_one_prompt
from gateway.capture.writer import CaptureWriter
from gateway.errors import Conflict, InvalidRequest
from gateway.serving.engines import Target
from gateway.serving.protocol import ProxyRequest
from gateway.settings import Settings
from gateway.tenancy.keys import Principal

logger = logging.getLogger(__name__)

CLOSED_CHECK_S = 5.0
"""How often a gateway looks up whether an episode it serves was closed through another gateway."""


class Capturer:
    """Capture for one gateway: who captures (`policies`) and the writes (`writer`)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.policies = CapturePolicies()
        self.writer = CaptureWriter()
        self.closed: set[tuple[str, str]] = set()
        """Episodes known to be closed, by (organisation, episode id)."""
        self._checked: dict[tuple[str, str], float] = {}
        """When each episode seen lately was last looked up (`_check_open`)."""
        self._pool: asyncpg.Pool | None = None

    def mark_closed(self, org_id: str, episode_id: str) -> None:
        """An episode was closed (or deleted) through this gateway: calls into it are refused from now on."""
        if len(self.closed) > 100_000:  # bounded: those forgotten are looked up again (`_check_open`)
            self.closed.clear()
            self._checked.clear()
        self.closed.add((org_id, episode_id))

    async def begin(
        self, scope: Scope, who: Principal, proxy: ProxyRequest, target: Target
    ) -> Capture | None:
        """The capture of this request, or None (one dict lookup where capture is off). Every call of an
        episode key is captured into its episode; a call into a closed episode is a 409."""
        setting = self.policies.of(who.organization_id, who.api_key_id)
        path = scope["path"]
        if (setting is None and who.episode_id is None) or path not in (CHAT_PATH, COMPLETIONS_PATH):
            return None
        store_flag = proxy.body.get("store")
        if store_flag is not None and not isinstance(store_flag, bool):
            raise InvalidRequest(
                "Invalid value for 'store': expected a boolean.", param="store", code="invalid_value"
            )
        episode, parent = episode_of(scope["headers"])
        if who.episode_id is not None:
            episode = who.episode_id
        text = path == COMPLETIONS_PATH
        if episode is None and (text or not store_flag):
            return None
        metadata = check_metadata(proxy.body.get("metadata"))
        if text:
            check_one_prompt(proxy.body)
        if episode is not None:
            await self._check_open(who.organization_id, episode)
        kind = TextCapture if text else Capture
        return kind(
            writer=self.writer,
            who=who,
            proxy=proxy,
            target=target,
            metadata=metadata,
            stored=bool(store_flag) and not text,
            episode_id=episode,
            parent_episode_id=parent,
            retention_days=setting.retention_days if setting is not None else DEFAULT_RETENTION_DAYS,
            settings=self.settings,
        )

    async def _check_open(self, org_id: str, episode_id: str) -> None:
        """A 409 for a call into a closed episode: one closed through this gateway is known at once, one
        closed through another is looked up at most every `CLOSED_CHECK_S` per episode."""
        key = (org_id, episode_id)
        now = time.monotonic()
        if (
            key not in self.closed
            and self._pool is not None
            and now - self._checked.get(key, -1e9) > CLOSED_CHECK_S
        ):
            if len(self._checked) > 100_000:
                self._checked.clear()
            self._checked[key] = now
            try:
                if await store.episode_closed(self._pool, org_id=org_id, episode_id=episode_id):
                    self.closed.add(key)
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
                logger.warning("could not check whether episode %s is closed: %s", episode_id, exc)
        if key in self.closed:
            raise Conflict(
                f"The episode '{episode_id}' is closed: it takes no more calls (rewards are still welcome).",
                param="episode",
                code="episode_closed",
            )

    async def start(self, pool: asyncpg.Pool) -> None:
        """Load the settings, then keep them fresh and write records in the background."""
        self._pool = pool
        try:
            await self.policies.reload(pool)
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            logger.warning("could not read capture settings (capture off until they load): %s", exc)
        self.policies.start(pool)
        self.writer.start(pool)

    async def aclose(self) -> None:
        await self.policies.aclose()
        await self.writer.aclose()
