"""Who captures: every organisation's and key's capture setting, held in memory.

The request path looks its organisation up in `CapturePolicies.orgs`: one dict lookup, which finds nothing
for an organisation with capture off (only organisations with a setting that turns capture on for someone
are held); `of(org_id, key_id)` then tells whether it is on for the request's key. The admin API changes
this gateway's copy at once; every gateway reloads the whole table every `REFRESH_S` in the background (a
few rows per organisation that opted in), so others see a change within that, and no request ever waits on
the database for it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import asyncpg

from gateway import tasks
from gateway.capture import store

logger = logging.getLogger(__name__)

REFRESH_S = 5.0
"""How often each gateway reloads the settings (how long another gateway's change takes to reach it)."""


@dataclass(frozen=True, slots=True)
class CaptureSetting:
    """Capture of one organisation or key: on or off, and how long records are kept (None: for ever)."""

    enabled: bool
    retention_days: int | None


@dataclass(slots=True)
class OrgCapture:
    """The settings of one organisation: its own, and those of its keys that have one (which win)."""

    org: CaptureSetting | None = None
    keys: dict[str, CaptureSetting] = field(default_factory=dict)

    def of_key(self, key_id: str) -> CaptureSetting | None:
        """The setting that holds for `key_id` when capture is on for it, else None."""
        setting = self.keys.get(key_id, self.org)
        return setting if setting is not None and setting.enabled else None

    def captures(self) -> bool:
        """Whether capture is on for anyone in the organisation."""
        return bool(self.org and self.org.enabled) or any(s.enabled for s in self.keys.values())


class CapturePolicies:
    """The settings of every organisation for which capture is on somewhere."""

    def __init__(self) -> None:
        self.orgs: dict[str, OrgCapture] = {}
        """The organisations for which capture is on for someone (their own setting or a key's)."""
        self._task: asyncio.Task[None] | None = None
        self._version = 0
        """Changes made here so far: a reload that saw one land while it read does not replace the map."""

    def of(self, org_id: str, key_id: str) -> CaptureSetting | None:
        """The capture setting of a request of `key_id` when capture is on for it, else None."""
        entry = self.orgs.get(org_id)
        return None if entry is None else entry.of_key(key_id)

    def put(self, row: store.SettingRow) -> None:
        """One setting changed on this gateway (the admin API): in force at once."""
        self._version += 1
        entry = self.orgs.get(row.organization_id) or OrgCapture()
        setting = CaptureSetting(row.enabled, row.retention_days)
        if row.api_key_id:
            entry.keys[row.api_key_id] = setting
        else:
            entry.org = setting
        self._place(row.organization_id, entry)

    def _place(self, org_id: str, entry: OrgCapture) -> None:
        if entry.captures():
            self.orgs[org_id] = entry
        else:
            self.orgs.pop(org_id, None)

    async def reload(self, pool: asyncpg.Pool) -> None:
        """Read every setting again and replace the map."""
        version = self._version
        orgs: dict[str, OrgCapture] = {}
        for row in await store.all_settings(pool):
            entry = orgs.setdefault(row.organization_id, OrgCapture())
            setting = CaptureSetting(row.enabled, row.retention_days)
            if row.api_key_id:
                entry.keys[row.api_key_id] = setting
            else:
                entry.org = setting
        if version == self._version:
            self.orgs = {org_id: entry for org_id, entry in orgs.items() if entry.captures()}

    def start(self, pool: asyncpg.Pool) -> None:
        """Reload every `REFRESH_S` in the background (the caller loads once first: `reload`)."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(pool), name="capture-settings")

    async def _run(self, pool: asyncpg.Pool) -> None:
        while True:
            await asyncio.sleep(REFRESH_S)
            try:
                await self.reload(pool)
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
                logger.warning("could not read capture settings (the last ones stay in force): %s", exc)

    async def aclose(self) -> None:
        await tasks.stop(self._task)
        self._task = None
