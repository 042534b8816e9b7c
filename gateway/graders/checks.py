"""A grader checked the way the gateway can afford: sizes first, and no long parse on the event loop.

`check_grader` runs `envsdk.graders.validate_grader` with the settings' caps (`grader_max_source_bytes`,
`grader_max_text_chars`), so nothing over them is parsed at all. `ast.parse` of a python source holds the
interpreter's lock for its whole run (a quarter of a second for 256 KiB), so sources longer than
`INLINE_SOURCE_CHARS` are parsed in the CPU pool (`gateway.offload`, as one of the organisation's calls);
shorter ones, the usual case, are parsed in place. Every refusal is a 400 whose `param` names the field.
Used by `graders/{run,validate}`, job creates (a reinforcement grader) and eval creates (testing criteria).
"""

from __future__ import annotations

from typing import Any

from envsdk.graders import GraderError, python_sources, validate_grader
from envsdk.python_grader import source_problems
from gateway.deps import Resources
from gateway.errors import InvalidRequest

INLINE_SOURCE_CHARS = 4096
"""Python sources up to this long are parsed on the event loop (a few milliseconds at most)."""


def _invalid(exc: GraderError, param: str) -> InvalidRequest:
    return InvalidRequest(exc.message, param=exc.param or param, code=exc.code)


async def check_grader(res: Resources, org_id: str, grader: Any, param: str = "grader") -> None:
    """A 400 naming the field unless `grader` is valid and within the settings' caps."""
    settings = res.settings
    sources = python_sources(grader, param)
    large = any(isinstance(source, str) and len(source) > INLINE_SOURCE_CHARS for _, source in sources)
    try:
        validate_grader(
            grader,
            param=param,
            max_source_bytes=settings.grader_max_source_bytes,
            max_text_chars=settings.grader_max_text_chars,
            parse_sources=not large,  # everything else here and now; sizes too, so the pool gets no more
        )
    except GraderError as exc:
        raise _invalid(exc, param) from None
    if large:
        problems = await res.offload.cpu(org_id, source_problems, [source for _, source in sources])
        for (where, _), problem in zip(sources, problems, strict=True):
            if problem is not None:
                raise InvalidRequest(problem, param=where, code="invalid_grader")
