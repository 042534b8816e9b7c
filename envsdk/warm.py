"""The warm sandboxes of an env server (:mod:`envsdk.server`), kept by organisation, package and config.

Each organisation's package (and config) gets up to ``capacity`` sandboxes, started on demand and kept warm,
never shared with another organisation, even for the same package: a package keeps what it saw in its
process's memory. Each sandbox runs one call at a time. A multi-turn episode stays in the sandbox that
``reset`` it until it is done or closed, or that sandbox dies. A package unused for ``IDLE_PACKAGE_S`` with
no episode open has its sandboxes stopped; they start again on its next call.

Packages come from the organisation's namespace in Redis (:func:`envsdk.remote_wire.package_key`), checked
against their hash and unpacked once per organisation under the server's data directory.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from envsdk.errors import SandboxError
from envsdk.manifest import Maxima
from envsdk.remote_wire import encode, get_bytes, package_key
from envsdk.sandbox import Sandbox

IDLE_PACKAGE_S = 600.0
"""A package unused this long, with no episode open, has its sandboxes stopped (started again on demand)."""
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass
class Slot:
    """One sandbox of a :class:`Warm` and whether a call holds it."""

    sandbox: Sandbox
    busy: bool = False


@dataclass
class Warm:
    """The sandboxes of one organisation's package and config: up to ``capacity``, each running one call at a
    time."""

    package_dir: Path
    config: dict[str, Any]
    slots: list[Slot] = field(default_factory=list)
    episodes: dict[str, int] = field(default_factory=dict)
    """Open episode -> index of the slot whose sandbox holds it."""
    last_used: float = field(default_factory=time.monotonic)


class WarmSandboxes:
    """The sandboxes an env server keeps warm (see the module); safe to use from its serving threads.

    A call takes a slot with :meth:`acquire` (the episode's own, else an idle one) and gives it back with
    :meth:`release`; :meth:`hold` and :meth:`end` record which slot holds an episode.
    """

    def __init__(
        self,
        client: redis.Redis,
        *,
        pool: str,
        capacity: int,
        data_dir: Path,
        maxima: Maxima,
        allow_unsandboxed: bool,
    ) -> None:
        self.redis = client
        self.pool = pool
        self.capacity = capacity
        self.data_dir = data_dir
        self.maxima = maxima
        self.allow_unsandboxed = allow_unsandboxed
        self._lock = threading.Condition()
        self._warm: dict[tuple[str, str, str], Warm] = {}
        self._package_locks: dict[tuple[str, str], threading.Lock] = {}

    # -- what is warm ------------------------------------------------------------------------------
    def packages(self, org: str | None = None) -> list[str]:
        """Hashes of the packages warm here, of ``org`` only when given (another organisation's hashes are
        all it would need to run them)."""
        with self._lock:
            return sorted({sha for o, sha, _ in self._warm if org is None or o == org})

    def open_episodes(self) -> int:
        """Multi-turn episodes held open in these sandboxes."""
        with self._lock:
            return sum(len(w.episodes) for w in self._warm.values())

    # -- one call ----------------------------------------------------------------------------------
    def warm_for(self, org: str, sha256: str, config: dict[str, Any]) -> Warm:
        """The sandboxes of ``org``'s package and config: an organisation's calls never run in a sandbox
        that served another's."""
        key = (org, sha256, encode(sorted(config.items())))
        with self._lock:
            warm = self._warm.get(key)
            if warm is not None:
                warm.last_used = time.monotonic()  # not stopped as idle under the call about to use it
                return warm
        package_dir = self._package(org, sha256)
        with self._lock:
            return self._warm.setdefault(key, Warm(package_dir, config))

    def acquire(self, warm: Warm, episode: str | None) -> tuple[int, Slot]:
        """The slot for a call: the episode's own, else an idle one (a new one while under capacity). Blocks
        until one is free."""
        with self._lock:
            while True:
                if episode is not None and episode in warm.episodes:
                    index = warm.episodes[episode]
                    if not warm.slots[index].busy:
                        break
                else:
                    idle = [i for i, s in enumerate(warm.slots) if not s.busy]
                    if idle:
                        index = min(idle, key=lambda i: sum(1 for v in warm.episodes.values() if v == i))
                        break
                    if len(warm.slots) < self.capacity:
                        warm.slots.append(Slot(self._sandbox(warm)))
                        index = len(warm.slots) - 1
                        break
                self._lock.wait(0.5)
            slot = warm.slots[index]
            slot.busy = True
            warm.last_used = time.monotonic()
            return index, slot

    def release(self, slot: Slot) -> None:
        """The call on ``slot`` is over: the slot is free for the next."""
        with self._lock:
            slot.busy = False
            self._lock.notify_all()

    def hold(self, warm: Warm, episode: str, index: int) -> None:
        """``episode`` was reset (or resumed) in slot ``index``: its next calls go there."""
        with self._lock:
            warm.episodes[episode] = index

    def end(self, warm: Warm, episode: str) -> None:
        """``episode`` is done or closed: its slot no longer holds it."""
        with self._lock:
            warm.episodes.pop(episode, None)

    def forget_slot_episodes(self, warm: Warm, index: int) -> None:
        """A sandbox that failed a call was killed: the episodes it held are gone."""
        if warm.slots[index].sandbox.running:
            return
        with self._lock:
            for episode in [e for e, i in warm.episodes.items() if i == index]:
                del warm.episodes[episode]

    # -- stopping ----------------------------------------------------------------------------------
    def stop_idle(self) -> None:
        """Stop the sandboxes of packages unused for ``IDLE_PACKAGE_S`` (none of their episodes open)."""
        idle: list[Slot] = []
        with self._lock:
            for key, warm in list(self._warm.items()):
                quiet = time.monotonic() - warm.last_used > IDLE_PACKAGE_S
                if quiet and not warm.episodes and not any(s.busy for s in warm.slots):
                    idle += warm.slots
                    del self._warm[key]
        for slot in idle:
            slot.sandbox.close()

    def close(self) -> None:
        """Stop every sandbox (the server is stopping)."""
        with self._lock:
            slots = [s for w in self._warm.values() for s in w.slots]
            self._warm.clear()
        for slot in slots:
            slot.sandbox.close()

    # -- packages ----------------------------------------------------------------------------------
    def _sandbox(self, warm: Warm) -> Sandbox:
        return Sandbox(
            warm.package_dir,
            config=warm.config,
            maxima=self.maxima,
            allow_unsandboxed=self.allow_unsandboxed,
        )

    def _package(self, org: str, sha256: str) -> Path:
        """``org``'s unpacked package of this content hash, fetched from its namespace and checked the first
        time. Unpacked once per organisation: an organisation that names another's hash (its servers' list
        shows none) finds nothing it did not store itself."""
        from envsdk.archive import safe_extract

        if not _SHA256.fullmatch(sha256):  # it names a folder here: a hash, never a path
            raise SandboxError("package_invalid", "a request named a package by something not a sha256")
        packages = self.data_dir / "packages" / org
        target = packages / sha256
        with self._lock:
            lock = self._package_locks.setdefault((org, sha256), threading.Lock())
        with lock:
            if target.is_dir():
                return target
            data = get_bytes(self.redis, package_key(self.pool, org, sha256))
            if data is None:
                raise SandboxError("package_missing", f"package {sha256} is not in the pool's store")
            if hashlib.sha256(data).hexdigest() != sha256:
                raise SandboxError("package_corrupt", f"package {sha256} does not match its hash")
            staging = packages / f".{sha256}.{uuid.uuid4().hex[:6]}"
            staging.mkdir(parents=True)
            archive = staging / "package.tar.gz"
            archive.write_bytes(data)
            unpacked = staging / "package"
            safe_extract(archive, unpacked)
            for path in (self.data_dir, self.data_dir / "packages", packages, staging):
                path.chmod(0o755)  # the sandbox's own uid reads the package
            try:
                unpacked.rename(target)
            except OSError:  # another server sharing this data dir unpacked it first
                if not target.is_dir():
                    raise
            shutil.rmtree(staging, ignore_errors=True)
            return target
