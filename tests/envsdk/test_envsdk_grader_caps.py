"""Graders held to sizes before any work: sources and texts over their caps are refused unparsed and
unscored, nothing a client writes escapes as an unexpected exception, and the scans of model output and
templates take one pass however the text is made."""

from __future__ import annotations

import random
import re
from typing import Any

import pytest

from envsdk.graders import (
    GraderError,
    check_texts,
    computes_only,
    enclosed,
    grade,
    parse_tool_calls,
    python_sources,
    validate_grader,
)
from envsdk.python_grader import source_problem, source_problems

GRADE = "def grade(sample, item):\n    return 1.0\n"


def python(source: Any) -> dict[str, Any]:
    return {"type": "python", "name": "py", "source": source}


def similarity(reference: str, metric: str = "fuzzy_match") -> dict[str, Any]:
    return {
        "type": "text_similarity",
        "input": "{{ sample.output_text }}",
        "reference": reference,
        "evaluation_metric": metric,
    }


def test_a_source_over_the_cap_is_refused_by_its_size() -> None:
    huge = GRADE + "x = (\n" * 400_000  # never parsed: the parse would fail only after seconds
    with pytest.raises(GraderError) as err:
        validate_grader(python(huge), max_source_bytes=256 * 1024)
    assert err.value.param == "grader.source" and err.value.code == "string_above_max_length"
    assert "262144" in err.value.message
    # bytes, not characters: 70,000 four-byte characters are over 256 KiB
    wide = GRADE + "# " + "\U0001f600" * 70_000
    assert "bytes" in (source_problem(wide, max_bytes=256 * 1024) or "")
    validate_grader(python(GRADE), max_source_bytes=256 * 1024)


@pytest.mark.parametrize(
    "source",
    [
        GRADE + "x = " + "+".join(["1"] * 200_000),  # deeper than the parser recurses
        GRADE + "x = 1\0\n",  # a NUL byte
        "def grade(:\n",
    ],
)
def test_sources_the_parser_gives_up_on_are_refused_with_the_field(source: str) -> None:
    with pytest.raises(GraderError) as err:
        validate_grader(python(source))
    assert err.value.param == "grader.source" and "not valid Python" in err.value.message


def test_sources_can_be_parsed_elsewhere() -> None:
    sub = {"type": "multi", "graders": {"a": python(GRADE), "b": python("x = 1")}, "calculate_output": "a"}
    assert python_sources(sub) == [("grader.graders.a.source", GRADE), ("grader.graders.b.source", "x = 1")]
    validate_grader(sub, parse_sources=False)  # the shape alone
    problems = source_problems([GRADE, "x = 1", "def grade(:"])
    assert problems[0] is None and "grade(sample, item)" in str(problems[1])
    assert "not valid Python" in str(problems[2])


def test_formulas_are_capped_and_never_escape_as_recursion() -> None:
    subs = {"a": similarity("x")}
    for formula in ("a + " * 400 + "a", "(" * 5000 + "a" + ")" * 5000, "+".join(["a"] * 200_000)):
        with pytest.raises(GraderError) as err:
            validate_grader({"type": "multi", "graders": subs, "calculate_output": formula})
        assert err.value.param == "grader.calculate_output"


def test_texts_over_the_cap_are_refused_before_scoring() -> None:
    long = "lorem ipsum " * 100_000
    with pytest.raises(GraderError) as err:
        validate_grader(similarity(long), max_text_chars=32_768)
    assert err.value.param == "grader.reference" and err.value.code == "string_above_max_length"
    # variables do not count against the literal text; what they bring is checked once filled in
    validate_grader(similarity("{{ item.ref }}" * 5_000), max_text_chars=32_768)
    grader = similarity("{{ item.ref }}", "rouge_l")
    with pytest.raises(GraderError) as err:
        check_texts(grader, "lorem", {"ref": long}, max_text_chars=32_768)
    assert err.value.param == "grader.reference"
    with pytest.raises(GraderError) as err:
        check_texts(grader, long, {"ref": "lorem"}, max_text_chars=32_768)
    assert err.value.param == "grader.input"
    check_texts(grader, "lorem", {"ref": "lorem ipsum"}, max_text_chars=32_768)
    # while grading (training, eval runs): an error of the sample, reward 0, nothing compared
    graded = grade(grader, long, {"ref": long}, max_text_chars=32_768)
    assert graded.reward == 0.0 and graded.errors["other_error"] and "32768" in str(graded.details)
    assert grade(grader, "lorem", {"ref": "lorem ipsum"}, max_text_chars=32_768).reward > 0
    assert computes_only(grader) and not computes_only(python(GRADE))


def test_scans_take_one_pass_and_find_what_the_regex_found() -> None:
    lazy = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
    variable = re.compile(r"\{\{(.*?)\}\}", re.DOTALL)
    atoms = ["<tool_call>", "</tool_call>", " ", "\n", "x", "{{", "}}", "{", '{"name": "f"}']
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 10)))
        assert enclosed(text, "<tool_call>", "</tool_call>") == lazy.findall(text)
        assert enclosed(text, "{{", "}}") == [v.strip() for v in variable.findall(text)]
    # a megabyte of openings: minutes for the lazy regex
    assert parse_tool_calls("<tool_call>" * 100_000) == []
    assert enclosed("{{" * 500_000, "{{", "}}") == []
    call = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    assert parse_tool_calls(call + "<tool_call>" * 100_000)[0]["function"]["name"] == "f"
