"""Version ids of adapters: derived from their content, so one id always means the same weights.

A version is `v-` and 24 hex digits of the sha256 of the adapter's `adapter_config.json` and its weight
files (each framed by its name and size, in name order). Engines are given versions as adapter names, never
the names users call (`ft:…`, checkpoints, aliases): a name that comes to mean other weights (a moved alias,
a Tinker sampler saved again under its name) is a new version on the engines, never stale weights held under
an old name (vLLM keys its prefix cache by the adapter's name).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

VERSION_RE = re.compile(r"v-[0-9a-f]{24}")
"""The shape of a version id."""
WEIGHT_SUFFIXES = frozenset({".safetensors", ".bin", ".pt", ".pth"})
"""Files of an adapter directory that hold weights (hashed with its `adapter_config.json`)."""
_CHUNK = 1 << 20


def is_version(name: str) -> bool:
    return VERSION_RE.fullmatch(name) is not None


def adapter_version(path: str | Path) -> str:
    """The version id of the adapter in directory `path` (blocking: reads every weight file; run it in a
    thread). Raises `OSError` when its `adapter_config.json` cannot be read."""
    root = Path(path)
    weights = sorted(p for p in root.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    digest = hashlib.sha256()
    for file in [root / "adapter_config.json", *weights]:
        with file.open("rb") as fh:
            digest.update(b"%s\0%d\0" % (file.name.encode(), file.stat().st_size))
            while chunk := fh.read(_CHUNK):
                digest.update(chunk)
    return "v-" + digest.hexdigest()[:24]


def path_version(path: str) -> str:
    """A stand-in version for an adapter the gateway cannot read (the engines may see files it does not):
    derived from its path, never stored, so the content's version replaces it once the files are readable."""
    return "v-" + hashlib.sha256(b"path\0" + path.encode()).hexdigest()[:24]
