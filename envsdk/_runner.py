"""The sandboxed child: reads JSON-lines requests, answers them from an :class:`~envsdk.host.EnvHost`.

Started by :class:`envsdk.sandbox.Sandbox` as ``python -S -B -m envsdk._runner [--rlimits SPEC]
[--drop-uid N --drop-gid N] [--site DIR] PACKAGE_DIR`` (``--site``: the site-packages of the package's
requirements, added after the privileges are dropped and the rlimits set). Before any user code is
imported it

* moves the RPC channel to private duplicates of fds 0 and 1, points fd 0 at ``/dev/null`` and fd 1 at
  stderr, so that ``print()`` and ``os.write(1, ...)`` from user code cannot corrupt the channel;
* drops to an unprivileged uid/gid when asked (used when the sandbox is entered as root, so that
  ``RLIMIT_NPROC`` applies), then sets its rlimits.

The first request must be ``init`` (``{"entrypoint", "config", "max_turns"}``); it answers with
``describe``'s result. Stdlib only.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any, BinaryIO

MAX_LINE = 64 * 1024 * 1024
READ_BUFFER = 1024 * 1024
"""Requests are read through a buffer this large (a whole batch in one or a few reads)."""


def _protect_channel() -> tuple[BinaryIO, BinaryIO]:
    rpc_in = os.fdopen(os.dup(0), "rb", buffering=READ_BUFFER)
    rpc_out = os.fdopen(os.dup(1), "wb", buffering=0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    sys.stdin = open(os.devnull)  # noqa: SIM115 - lives as long as the process
    sys.stdout = sys.stderr
    return rpc_in, rpc_out


def _drop_privileges(uid: int, gid: int) -> None:
    os.setgroups([])
    os.setgid(gid)
    os.setuid(uid)
    if os.getuid() != uid or os.geteuid() != uid:
        raise SystemExit("could not drop privileges")


def _set_rlimits(spec: str) -> None:
    """``as=N,cpu=N,nofile=N,nproc=N,fsize=N,core=N`` -> setrlimit (CPU: hard limit one second later),
    each at most the hard limit the process already has."""
    import resource

    names = {
        "as": resource.RLIMIT_AS,
        "cpu": resource.RLIMIT_CPU,
        "nofile": resource.RLIMIT_NOFILE,
        "nproc": resource.RLIMIT_NPROC,
        "fsize": resource.RLIMIT_FSIZE,
        "core": resource.RLIMIT_CORE,
    }
    for item in filter(None, spec.split(",")):
        key, _, value = item.partition("=")
        ceiling = resource.getrlimit(names[key])[1]  # an unprivileged process cannot go above its hard limit
        soft = int(value) if ceiling == resource.RLIM_INFINITY else min(int(value), ceiling)
        hard = soft + 1 if key == "cpu" else soft
        if ceiling != resource.RLIM_INFINITY:
            hard = min(hard, ceiling)
        resource.setrlimit(names[key], (soft, hard))


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    uid = gid = None
    rlimits = ""
    sites: list[str] = []
    while args and args[0].startswith("--"):
        flag, value = args.pop(0), args.pop(0)
        if flag == "--drop-uid":
            uid = int(value)
        elif flag == "--drop-gid":
            gid = int(value)
        elif flag == "--rlimits":
            rlimits = value
        elif flag == "--site":
            sites.append(value)
    package_dir = args[0] if args else "."
    rpc_in, rpc_out = _protect_channel()
    if uid is not None:
        _drop_privileges(uid, gid if gid is not None else uid)
    _set_rlimits(rlimits)
    if sites:  # the requirements' venv (read-only): its packages and their .pth files, after the stdlib
        import site

        for directory in sites:
            site.addsitedir(directory)
    sys.path.insert(0, package_dir)
    sys.dont_write_bytecode = True
    owner = os.getpid()

    from envsdk.host import EnvHost, RemoteError
    from envsdk.types import error_text

    def send(message: dict[str, Any]) -> None:
        if os.getpid() != owner:  # a fork of this process made by user code must not answer
            os._exit(0)
        try:
            line = dumps(message)
        except (TypeError, ValueError) as exc:
            line = json.dumps(
                {"id": message.get("id"), "error": {"code": "bad_result", "message": error_text(exc)}}
            )
        rpc_out.write(line.encode() + b"\n")

    dumps = json.JSONEncoder(allow_nan=False, separators=(",", ":")).encode
    loads = json.loads
    loop = asyncio.new_event_loop()
    host: EnvHost | None = None
    while True:
        raw = rpc_in.readline(MAX_LINE)
        if not raw:
            return 0
        try:
            request = loads(raw)
            rid, method, params = request.get("id"), request["method"], request.get("params") or {}
        except Exception as exc:
            send({"id": None, "error": {"code": "protocol_error", "message": error_text(exc)}})
            continue
        try:
            if method == "init":
                host = EnvHost.from_entrypoint(
                    params["entrypoint"],
                    params.get("config"),
                    max_turns=params.get("max_turns"),
                    format=params.get("format") or "envsdk",
                    options=params.get("format_options"),
                )
                method, params = "describe", {}
            if host is None:
                raise RemoteError("not_initialised", "the first request must be 'init'")
            if method == "rewards":  # the hot path: no coroutine unless a reward is async
                result = host.rewards(params["tasks"], params["items"], loop)
            else:
                result = loop.run_until_complete(host.handle(method, params))
            send({"id": rid, "result": result})
        except RemoteError as exc:
            send({"id": rid, "error": {"code": exc.code, "message": exc.message}})
        except MemoryError as exc:
            send({"id": rid, "error": {"code": "memory", "message": error_text(exc)}})
        except Exception as exc:
            send({"id": rid, "error": {"code": "remote_error", "message": error_text(exc)}})


if __name__ == "__main__":
    raise SystemExit(main())
