"""The two error types of envsdk: a bad package, and a sandbox that failed.

Both carry a short machine-readable ``code`` beside the human message so that the gateway and the
trainer can map them to their own error envelopes without parsing text.
"""

from __future__ import annotations


class EnvSDKError(Exception):
    """Base class: ``code`` is a short stable identifier, ``message`` the explanation."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.message = message
        self.code = code

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"


class PackageError(EnvSDKError):
    """An environment package (archive or directory) is malformed or unsafe.

    Codes: ``bad_archive``, ``unsafe_path``, ``special_file``, ``too_many_entries``, ``too_large``,
    ``compression_ratio``, ``header_too_large``, ``missing_manifest``, ``invalid_manifest``,
    ``entrypoint_error``, ``symlink``; ``invalid_requirements`` and ``requirements_build_failed``
    (:class:`envsdk.venvs.RequirementsError`).
    """


class SandboxError(EnvSDKError):
    """The sandboxed process failed.

    Codes: ``unavailable`` (no sandbox backend), ``unsandboxed_refused``, ``start_failed``, ``timeout``,
    ``memory``, ``cpu_limit``, ``crashed``, ``protocol_error``, ``not_running``, ``remote_error``,
    ``entrypoint_error``.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message, code)
