"""The ``unshare`` backend's file-system view: the same new root bubblewrap builds, made by envsdk itself.

Started by :class:`envsdk.sandbox.Sandbox` as root, as PID 1 of fresh mount, network, PID, IPC and UTS
namespaces (``unshare --mount --net --pid --ipc --uts --fork``), with one argument: a JSON object
``{"root", "mounts", "env", "chdir", "argv"}``. It

* makes every mount private (nothing it mounts reaches the host), mounts a tmpfs on ``root`` (an empty
  directory the caller made) and builds the view there, in order: ``dir``, ``ro-bind`` (a bind remounted
  read-only, nosuid and nodev), ``tmpfs`` (with a size: the scratch's quota), ``symlink``, ``proc`` (of
  the new PID namespace) and ``dev`` (a tmpfs holding binds of ``null``, ``zero``, ``full``, ``random``
  and ``urandom``);
* moves that tree onto ``/`` and ``chroot``s into it, so that nothing of the host is left but what was
  bound (no ``/etc``, no data dir, no blob store);
* sets ``no_new_privs`` (a set-uid file in ``/usr`` gives nothing) and starts ``argv`` with exactly
  ``env``; the runner then drops to the sandbox's own uid before it imports user code;
* stays as the namespace's init, as bubblewrap's does: it reaps orphans and, when the runner ends, exits
  with its status (``128 + N`` when signal ``N`` killed it, so that the host tells a CPU-time kill from a
  crash); the kernel then kills whatever is left in the namespace.

Stdlib only; nothing here runs user code. Any failure exits with status 111 and a message on stderr.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
from typing import Any

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_MOVE = 8192
MS_REC = 16384
MS_PRIVATE = 1 << 18
PR_SET_NO_NEW_PRIVS = 38
DEV_NODES = ("null", "zero", "full", "random", "urandom")

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    def enc(value: str | None) -> bytes | None:
        return None if value is None else os.fsencode(value)

    if _libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {source or fstype} on {target}: {os.strerror(errno)}")


def _mountpoint(path: str, like: str) -> None:
    """An empty directory or file at ``path`` to mount ``like`` (a directory or a file) on."""
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    if os.path.isdir(like):
        os.makedirs(path, mode=0o755, exist_ok=True)
    elif not os.path.exists(path):
        with open(path, "w"):
            pass


def _ro_bind(source: str, target: str) -> None:
    _mountpoint(target, source)
    _mount(source, target, None, MS_BIND)
    _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _dev(target: str) -> None:
    os.makedirs(target, mode=0o755, exist_ok=True)
    _mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k")
    for name in DEV_NODES:
        node = os.path.join(target, name)
        with open(node, "w"):
            pass
        _mount(f"/dev/{name}", node, None, MS_BIND)
    for name, link in (("fd", "fd"), ("stdin", "fd/0"), ("stdout", "fd/1"), ("stderr", "fd/2")):
        os.symlink(f"/proc/self/{link}", os.path.join(target, name))


def build(root: str, mounts: list[dict[str, Any]]) -> None:
    """Build the view described by ``mounts`` under ``root``
    (see :func:`envsdk.sandbox_backends.file_system_view`)."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    for item in mounts:
        kind, dest = item["kind"], root + item["dest"]
        if kind == "dir":
            os.makedirs(dest, exist_ok=True)
            os.chmod(dest, item.get("perms", 0o755))
        elif kind == "ro-bind":
            _ro_bind(item["source"], dest)
        elif kind == "tmpfs":
            os.makedirs(dest, mode=0o755, exist_ok=True)
            mode = item.get("perms", 0o755)
            _mount("tmpfs", dest, "tmpfs", MS_NOSUID | MS_NODEV, f"mode={mode:o},size={int(item['size'])}")
        elif kind == "symlink":
            os.makedirs(os.path.dirname(dest), mode=0o755, exist_ok=True)
            os.symlink(item["source"], dest)
        elif kind == "proc":
            os.makedirs(dest, mode=0o755, exist_ok=True)
            _mount("proc", dest, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
        elif kind == "dev":
            _dev(dest)
        else:
            raise ValueError(f"unknown mount kind {kind!r}")
    os.chdir(root)
    _mount(root, "/", None, MS_MOVE)
    os.chroot(".")
    os.chdir("/")


def _init(child: int) -> int:
    """PID 1 of the sandbox: reap every process, and end as ``child`` (the runner) ended."""
    for fd in (0, 1):
        os.close(fd)  # the channel is the runner's alone: its end is the host's EOF
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            return 111
        if pid != child:
            continue
        if os.WIFSIGNALED(status):
            number = os.WTERMSIG(status)
            print(
                f"envsdk sandbox: the environment process was killed by {signal.Signals(number).name}",
                file=sys.stderr,
                flush=True,
            )
            return 128 + number
        return os.waitstatus_to_exitcode(status)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        plan = json.loads(args[0])
        build(plan["root"], plan["mounts"])
        os.chdir(plan.get("chdir") or "/")
        if _libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        command = plan["argv"]
        child = os.fork()
        if child == 0:
            try:
                os.execve(command[0], command, plan["env"])
            finally:
                os._exit(111)
    except Exception as exc:  # noqa: BLE001 - the reason goes to the sandbox's stderr
        print(f"envsdk sandbox: cannot confine the file system: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 111
    return _init(child)


if __name__ == "__main__":
    raise SystemExit(main())
