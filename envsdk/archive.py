"""Environment package archives: reproducible packing, safe extraction, and the upload check.

* :func:`pack` -- a directory -> a byte-for-byte reproducible ``.tar.gz`` (sorted entries, fixed
  mtime/uid/gid/mode, gzip mtime 0; ``__pycache__``, ``*.pyc`` and dotfiles left out) and its sha256.
* :func:`safe_extract` -- extracts an untrusted archive: caps on entries, total bytes and compression
  ratio, bytes counted while writing, and tarfile's ``data`` filter (no ``..``, no absolute paths, no
  links pointing out, no devices). Extension headers (GNU long names and links, pax headers) are capped
  at ``MAX_EXTENDED_HEADER_BYTES`` before they are read, and at ``MAX_EXTENDED_HEADER_RUN`` in a row;
  sparse members are refused.
* :func:`inspect_package` -- what the gateway runs on upload: extract, validate the manifest, then start
  the package in the sandbox to check that its entrypoint imports and is an environment class. User
  code is never imported in the calling process. Blocking: call it from a worker thread.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import logging
import os
import shutil
import stat
import tarfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from envsdk.errors import PackageError, SandboxError
from envsdk.manifest import MANIFEST_NAME, Limits, Manifest, load_manifest

if TYPE_CHECKING:
    from envsdk.venvs import VenvBuilder

logger = logging.getLogger(__name__)

FIXED_MTIME = 0
DEFAULT_MAX_ENTRIES = 2000
DEFAULT_MAX_TOTAL_BYTES = 100 * 1024 * 1024
DEFAULT_MAX_RATIO = 200.0
CHUNK = 1024 * 1024
MAX_EXTENDED_HEADER_BYTES = 64 * 1024
"""Largest GNU long-name / long-link or pax header: tarfile reads one whole into memory, so its declared
size is checked first (a name longer than PATH_MAX has no place in a package anyway)."""
MAX_EXTENDED_HEADER_RUN = 8
"""Most extension headers in front of one member (tarfile handles each one by recursion)."""
SHOWN_NAME_CHARS = 200
"""Longest member name quoted in an error message."""
_EXTENDED_TYPES = {
    tarfile.GNUTYPE_LONGNAME: "GNU long-name",
    tarfile.GNUTYPE_LONGLINK: "GNU long-link",
    tarfile.XHDTYPE: "pax",
    tarfile.XGLTYPE: "pax global",
    tarfile.SOLARIS_XHDTYPE: "pax",
}


def _shown(name: str) -> str:
    """A member name for an error message: quoted, and cut to `SHOWN_NAME_CHARS`."""
    text = repr(name)
    return text if len(text) <= SHOWN_NAME_CHARS else text[: SHOWN_NAME_CHARS - 4] + "...'"


class _BoundedTarInfo(tarfile.TarInfo):
    """tarfile's member header with the checks tarfile leaves out: an extension header's declared size
    against `MAX_EXTENDED_HEADER_BYTES` before its bytes are read, runs of extension headers against
    `MAX_EXTENDED_HEADER_RUN`, and no sparse members (tarfile's documented way to extend header handling
    is a `TarInfo` subclass with its own `_proc_member`)."""

    def _proc_member(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        kind = _EXTENDED_TYPES.get(self.type)
        if kind is None:
            if self.type == tarfile.GNUTYPE_SPARSE:
                raise PackageError("refused a sparse member: packages hold plain files", "special_file")
            return super()._proc_member(tarfile_)  # type: ignore[misc]
        if self.size > MAX_EXTENDED_HEADER_BYTES:
            raise PackageError(
                f"refused a {kind} header of {self.size} bytes (at most {MAX_EXTENDED_HEADER_BYTES})",
                "header_too_large",
            )
        run = getattr(tarfile_, "_extended_header_run", 0) + 1
        if run > MAX_EXTENDED_HEADER_RUN:
            raise PackageError(
                f"refused more than {MAX_EXTENDED_HEADER_RUN} extension headers in a row", "header_too_large"
            )
        tarfile_._extended_header_run = run  # type: ignore[attr-defined]
        try:
            return super()._proc_member(tarfile_)  # type: ignore[misc]
        finally:
            tarfile_._extended_header_run = run - 1  # type: ignore[attr-defined]


def _skip(name: str) -> bool:
    return name.startswith(".") or name == "__pycache__" or name.endswith((".pyc", ".pyo"))


def pack(src_dir: Path, out_path: Path | None = None) -> tuple[Path, str]:
    """Pack ``src_dir`` into a reproducible ``.tar.gz``; returns (path, sha256 hex).

    The default output is ``<name>-<version>.tar.gz`` in the current directory. Symlinks are refused
    (a package holds plain files only).
    """
    src = Path(src_dir).resolve()
    manifest = load_manifest(src)
    out = (
        Path(out_path) if out_path is not None else Path.cwd() / f"{manifest.name}-{manifest.version}.tar.gz"
    )
    out_resolved = out.resolve()
    entries: list[tuple[str, Path]] = []
    for root, dirs, files in os.walk(src):
        dirs[:] = sorted(d for d in dirs if not _skip(d))
        root_path = Path(root)
        for name in sorted(dirs + files):
            path = root_path / name
            if _skip(name) or path.resolve() == out_resolved and not path.is_symlink():
                continue
            if path.is_symlink():
                raise PackageError(
                    f"{path.relative_to(src)} is a symlink; packages hold plain files", "symlink"
                )
            entries.append((path.relative_to(src).as_posix(), path))
    entries.sort(key=lambda item: item[0])
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for arcname, path in entries:
            info = tarfile.TarInfo(arcname)
            info.mtime = FIXED_MTIME
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            if path.is_dir():
                info.type = tarfile.DIRTYPE
                info.mode = 0o755
                tar.addfile(info)
            elif path.is_file():
                data = path.read_bytes()
                info.size = len(data)
                info.mode = 0o755 if path.stat().st_mode & stat.S_IXUSR else 0o644
                tar.addfile(info, io.BytesIO(data))
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
        gz.write(buffer.getvalue())
    digest = hashlib.sha256(out.read_bytes()).hexdigest()
    logger.info("packed %s (%d entries) -> %s sha256=%s", src, len(entries), out, digest)
    return out, digest


def safe_extract(
    archive_path: Path,
    dest: Path,
    *,
    max_entries: int = DEFAULT_MAX_ENTRIES,
    max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES,
    max_ratio: float = DEFAULT_MAX_RATIO,
) -> None:
    """Extract an untrusted tar(.gz) archive into ``dest`` or raise :class:`PackageError`.

    ``max_ratio`` bounds (uncompressed bytes) / (archive bytes): a compression bomb is refused when
    its headers announce it, and at the latest when the bytes written cross either bound.
    """
    archive = Path(archive_path)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    dest_real = dest.resolve()
    compressed = max(archive.stat().st_size, 1)
    budget = min(max_total_bytes, int(max_ratio * compressed))
    written = 0
    entries = 0
    try:
        tar = tarfile.open(archive, mode="r:*", tarinfo=_BoundedTarInfo)
    except (tarfile.TarError, OSError, EOFError, RecursionError) as exc:
        raise PackageError(f"not a tar or tar.gz archive: {exc}", "bad_archive") from exc
    with tar:
        try:
            for member in tar:
                entries += 1
                if entries > max_entries:
                    raise PackageError(f"archive has more than {max_entries} entries", "too_many_entries")
                _check_member(member, dest_real)
                try:
                    member = tarfile.data_filter(member, str(dest_real))
                except tarfile.FilterError as exc:
                    raise PackageError(
                        f"refused entry {_shown(member.name)}: {exc}"[:1000], "unsafe_path"
                    ) from exc
                if member.isfile():
                    if written + member.size > max_total_bytes:
                        raise PackageError(
                            f"archive expands beyond {max_total_bytes} bytes ({_shown(member.name)})",
                            "too_large",
                        )
                    if written + member.size > budget:
                        shown = _shown(member.name)
                        raise PackageError(
                            f"archive expands more than {max_ratio:g} times its size ({shown}): "
                            "refusing a compression bomb",
                            "compression_ratio",
                        )
                    written += _write_member(tar, member, dest_real, budget - written)
                else:
                    tar.extract(member, dest_real, filter="data")
        except PackageError:
            raise
        except (tarfile.TarError, OSError, EOFError, RecursionError, zlib_error()) as exc:
            raise PackageError(f"corrupt archive: {exc}"[:1000], "bad_archive") from exc
    logger.info("extracted %s: %d entries, %d bytes", archive, entries, written)


def zlib_error() -> type[Exception]:
    import zlib

    return zlib.error


def _check_member(member: tarfile.TarInfo, dest: Path) -> None:
    """Refusals with precise messages (the data filter below is the second line of defence)."""
    name = member.name
    shown = _shown(name)
    if name.startswith("/") or os.path.isabs(name):
        raise PackageError(f"refused entry {shown}: absolute path", "unsafe_path")
    if ".." in Path(name).parts:
        raise PackageError(f"refused entry {shown}: '..' in path", "unsafe_path")
    if member.ischr() or member.isblk() or member.isfifo() or member.isdev():
        raise PackageError(f"refused entry {shown}: device or fifo", "special_file")
    if not (member.isfile() or member.isdir() or member.issym() or member.islnk()):
        raise PackageError(f"refused entry {shown}: unsupported entry type", "special_file")
    if member.issym() or member.islnk():
        base = dest / Path(name).parent if member.issym() else dest
        target = (base / member.linkname).resolve()
        if os.path.isabs(member.linkname) or not target.is_relative_to(dest):
            raise PackageError(
                f"refused entry {shown}: link to {_shown(member.linkname)} points outside the package",
                "unsafe_path",
            )


def _write_member(tar: tarfile.TarFile, member: tarfile.TarInfo, dest: Path, budget: int) -> int:
    target = dest / member.name
    if not target.resolve().is_relative_to(dest):
        raise PackageError(
            f"refused entry {_shown(member.name)}: resolves outside the package", "unsafe_path"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    source = tar.extractfile(member)
    if source is None:
        raise PackageError(f"cannot read entry {_shown(member.name)}", "bad_archive")
    count = 0
    with source, open(target, "wb") as out:
        while chunk := source.read(CHUNK):
            count += len(chunk)
            if count > budget:
                raise PackageError(
                    f"archive expands beyond its limits ({_shown(member.name)})", "compression_ratio"
                )
            out.write(chunk)
    os.chmod(target, 0o755 if (member.mode or 0) & 0o100 else 0o644)
    return count


def inspect_package(
    archive_path: Path,
    workdir: Path,
    *,
    max_entries: int = DEFAULT_MAX_ENTRIES,
    max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES,
    max_ratio: float = DEFAULT_MAX_RATIO,
    limits: Limits | None = None,
    config: dict[str, Any] | None = None,
    allow_unsandboxed: bool = False,
    venvs: VenvBuilder | None = None,
) -> Manifest:
    """Check an uploaded package; returns its manifest or raises :class:`PackageError`.

    Extracts into ``workdir/package`` (``workdir`` is the caller's to delete), validates
    ``environment.toml``, then starts the package in a :class:`~envsdk.sandbox.Sandbox` (``limits``, when
    given, caps the manifest's) and asks it to ``describe`` itself: import errors, a missing class or a
    class that is not an environment come back as ``entrypoint_error``. A package with ``requirements``
    has its venv built first (by ``venvs``, else the process's default builder; cached per requirement
    set): a set that cannot be built raises ``requirements_build_failed`` with pip's reason.
    """
    from envsdk.sandbox import Sandbox

    package_dir = Path(workdir) / "package"
    if package_dir.exists():
        shutil.rmtree(package_dir)
    safe_extract(
        archive_path,
        package_dir,
        max_entries=max_entries,
        max_total_bytes=max_total_bytes,
        max_ratio=max_ratio,
    )
    if not (package_dir / MANIFEST_NAME).exists():
        raise PackageError(f"{MANIFEST_NAME} not found at the archive's top level", "missing_manifest")
    manifest = load_manifest(package_dir)
    effective = manifest.limits.capped(limits) if limits is not None else manifest.limits
    try:
        with Sandbox(
            package_dir, config=config, limits=effective, allow_unsandboxed=allow_unsandboxed, venvs=venvs
        ) as sandbox:
            info = sandbox.info
    except SandboxError as exc:
        if exc.code in ("entrypoint_error", "start_failed", "timeout", "memory", "crashed", "protocol_error"):
            raise PackageError(
                f"entrypoint {manifest.entrypoint!r}: {exc.message}", "entrypoint_error"
            ) from exc
        raise
    logger.info("package %s %s ok: %s", manifest.name, manifest.version, info)
    return manifest
