"""An eval's data, checked: the data source config, the testing criteria, a run's data source, its items,
and the chat messages rendered from each item.

Pure functions (no database, no network): the gateway checks a create with them, and the worker renders
the same messages from the same code, so a run that was accepted renders every item it was checked with.
Every refusal is an `InvalidRequest` whose `param` names the field, in OpenAI's envelope.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from envsdk.graders import enclosed, render_template
from gateway import wire
from gateway.errors import InvalidRequest
from gateway.evals.stored_source import check_nothing_sampled, check_stored_source, stored_config
from gateway.files.validation import iter_lines
from gateway.jobs.validation import check_grader

SAMPLE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "model": {"type": "string"},
        "output_text": {"type": "string"},
        "output_json": {"type": "object"},
        "output_tools": {"type": "array", "items": {"type": "object"}},
    },
    "required": ["model", "output_text"],
}
"""The `sample` namespace graders read (`{{ sample.output_text }}`, ...), as `envsdk.graders.make_sample`
builds it."""

INPUT_ROLES = ("user", "assistant", "system", "developer")
SAMPLING_KEYS = ("temperature", "top_p", "max_completion_tokens", "seed", "response_format", "tools")
"""`sampling_params` passed on to `/v1/chat/completions` (`reasoning_effort` is accepted and dropped)."""
FILE_PURPOSES = ("evals", "fine-tune")
DEFAULT_THRESHOLD = 0.5
"""`pass_threshold` of `python` and `multi` criteria that name none."""

_ITEM_VARIABLE = re.compile(r"^\s*item(?:\.[A-Za-z0-9_\-]+|\[\s*-?\d+\s*\])*\s*$")
_REFERENCE_PART = re.compile(r"\.([A-Za-z0-9_\-]+)|\[\s*(-?\d+)\s*\]")


# -- evals -----------------------------------------------------------------------------------------------


def check_data_source_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config as the eval shows it: `{"type": "custom", "schema": {item, sample?}}`, or
    `{"type": "stored_completions", "metadata", "schema": {item, sample}}` (the organisation's stored
    completions whose metadata holds every pair of `metadata`, `gateway.evals.stored`)."""
    kind = config.get("type")
    if kind == "stored_completions":
        return stored_config(config, SAMPLE_SCHEMA)
    if kind != "custom":
        raise InvalidRequest(
            f"data_source_config.type {kind!r} is not supported; use 'custom' or 'stored_completions' (logs "
            "are not kept by this gateway).",
            param="data_source_config.type",
            code="unsupported_data_source",
        )
    item_schema = config.get("item_schema")
    if not isinstance(item_schema, dict):
        raise InvalidRequest(
            "data_source_config.item_schema must be a JSON schema object.",
            param="data_source_config.item_schema",
        )
    required = item_schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(name, str) for name in required):
        raise InvalidRequest(
            "data_source_config.item_schema.required must be a list of property names.",
            param="data_source_config.item_schema.required",
        )
    with_sample = config.get("include_sample_schema", False)
    if not isinstance(with_sample, bool):
        raise InvalidRequest(
            "include_sample_schema must be a boolean.", param="data_source_config.include_sample_schema"
        )
    properties: dict[str, Any] = {"item": item_schema}
    if with_sample:
        properties["sample"] = SAMPLE_SCHEMA
    return {
        "type": "custom",
        "schema": {"type": "object", "properties": properties, "required": list(properties)},
    }


def check_testing_criteria(criteria: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each criterion checked as a grader (the code that will grade with it; the service then checks sizes
    and parses python sources off the loop, `gateway.graders.checks`), with a unique name (its type when it
    has none) and a numeric `pass_threshold` where one is given or needed."""
    if not criteria:
        raise InvalidRequest("testing_criteria must hold at least one grader.", param="testing_criteria")
    out: list[dict[str, Any]] = []
    names: set[str] = set()
    for i, criterion in enumerate(criteria):
        param = f"testing_criteria[{i}]"
        check_grader(criterion, param)
        criterion = dict(criterion)
        criterion.setdefault("name", criterion["type"])
        if criterion["name"] in names:
            raise InvalidRequest(
                f"Two testing criteria are named {criterion['name']!r}; names must be unique.",
                param=f"{param}.name",
            )
        names.add(criterion["name"])
        threshold = criterion.get("pass_threshold")
        if threshold is None and criterion["type"] == "text_similarity":
            raise InvalidRequest(
                "A text_similarity criterion needs a pass_threshold.", param=f"{param}.pass_threshold"
            )
        if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, int | float)):
            raise InvalidRequest("pass_threshold must be a number.", param=f"{param}.pass_threshold")
        out.append(criterion)
    return out


def pass_threshold(criterion: dict[str, Any]) -> float:
    """The score a criterion passes at: its `pass_threshold`, else 1 for `string_check` and `label_model`
    (their scores are 0 or 1), the middle of `range` for `score_model`, 0.5 for `python` and `multi`."""
    given = criterion.get("pass_threshold")
    if given is not None:
        return float(given)
    kind = criterion.get("type")
    if kind in ("string_check", "label_model"):
        return 1.0
    if kind == "score_model":
        low, high = criterion.get("range") or [0, 1]
        return (float(low) + float(high)) / 2
    return DEFAULT_THRESHOLD


# -- runs ------------------------------------------------------------------------------------------------


@dataclass
class Row:
    """One data source item, and the sample it carries (jsonl runs, stored completions) or None (sampled by
    the run)."""

    item: dict[str, Any]
    sample: dict[str, Any] | None = None
    """What graders read as `{{ sample.* }}` (a jsonl item's `sample` as given)."""
    record: dict[str, Any] | None = None
    """The output item's `sample` made already (a stored completion's: `gateway.evals.samples`)."""


@dataclass
class RunSource:
    """A run's checked data source."""

    type: str
    """`completions` or `jsonl`."""
    source: dict[str, Any]
    """`{"type": "file_id", "id"}`, `{"type": "file_content", "content": [...]}` or a `stored_completions`
    source with every filter (`gateway.evals.stored_source`)."""
    model: str = ""
    """The model sampled; empty for stored completions graded as they were answered."""
    input_messages: dict[str, Any] | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    """The chat parameters sent with every item."""

    @property
    def file_id(self) -> str | None:
        return self.source["id"] if self.source["type"] == "file_id" else None

    @property
    def stored(self) -> bool:
        """Whether the items are the organisation's stored completions."""
        return bool(self.source["type"] == "stored_completions")


def _unsupported(what: str, value: Any, param: str, supported: str) -> InvalidRequest:
    return InvalidRequest(
        f"{what} {value!r} is not supported; use {supported}.", param=param, code="unsupported_data_source"
    )


def check_run_source(ds: dict[str, Any]) -> RunSource:
    """The data source of a run create, checked field by field (its items are checked by `check_rows`, or
    for stored completions by the service as it selects them)."""
    kind = ds.get("type")
    if kind not in ("completions", "jsonl"):
        raise _unsupported("data_source.type", kind, "data_source.type", "'completions' or 'jsonl'")
    source = ds.get("source")
    if not isinstance(source, dict):
        raise InvalidRequest("data_source.source must be an object.", param="data_source.source")
    if source.get("type") == "file_id":
        if not isinstance(source.get("id"), str) or not source["id"]:
            raise InvalidRequest("data_source.source.id must name a file.", param="data_source.source.id")
        source = {"type": "file_id", "id": source["id"]}
    elif source.get("type") == "file_content":
        if not isinstance(source.get("content"), list) or not source["content"]:
            raise InvalidRequest(
                "data_source.source.content must be a non-empty list of {'item': {...}}.",
                param="data_source.source.content",
            )
        source = {"type": "file_content", "content": source["content"]}
    elif source.get("type") == "stored_completions" and kind == "completions":
        source = check_stored_source(source)
    else:
        supported = "'file_id' or 'file_content'" + (
            " or 'stored_completions'" if kind == "completions" else ""
        )
        raise _unsupported(
            "data_source.source.type", source.get("type"), "data_source.source.type", supported
        )
    run = RunSource(type=kind, source=source)
    if kind == "jsonl":
        return run
    model = ds.get("model")
    if run.stored and model is None:  # the stored answers themselves are graded
        check_nothing_sampled(ds)
        return run
    if not isinstance(model, str) or not model:
        raise InvalidRequest("data_source.model must name the model to sample.", param="data_source.model")
    run.model = model
    run.input_messages = _check_input_messages(ds.get("input_messages"))
    run.sampling = _check_sampling(ds.get("sampling_params"))
    return run


def _check_input_messages(value: Any) -> dict[str, Any]:
    param = "data_source.input_messages"
    if not isinstance(value, dict):
        raise InvalidRequest(
            "data_source.input_messages must be a template or an item_reference.", param=param
        )
    if value.get("type") == "item_reference":
        ref = value.get("item_reference")
        path = _reference_path(ref) if isinstance(ref, str) else None
        if path is None:
            raise InvalidRequest(
                "item_reference must name a list of messages in the item, e.g. 'item.messages'.",
                param=f"{param}.item_reference",
            )
        return {"type": "item_reference", "item_reference": ref}
    if value.get("type") != "template":
        raise InvalidRequest(
            "data_source.input_messages.type must be 'template' or 'item_reference'.", param=f"{param}.type"
        )
    template = value.get("template")
    if not isinstance(template, list) or not template:
        raise InvalidRequest(
            "data_source.input_messages.template must be a non-empty list of messages.",
            param=f"{param}.template",
        )
    for i, message in enumerate(template):
        where = f"{param}.template[{i}]"
        if not isinstance(message, dict) or message.get("role") not in INPUT_ROLES:
            raise InvalidRequest(
                f"Each message needs a role among {', '.join(INPUT_ROLES)}.", param=f"{where}.role"
            )
        for text in _texts(message.get("content"), f"{where}.content"):
            for variable in enclosed(text, "{{", "}}"):  # one pass (a regex would be quadratic)
                if not _ITEM_VARIABLE.match(variable):
                    raise InvalidRequest(
                        f"Unknown template variable '{{{{{variable}}}}}': input messages may refer to the "
                        "item only, as {{ item.name }}.",
                        param=f"{where}.content",
                        code="invalid_template",
                    )
    return {"type": "template", "template": template}


def _texts(content: Any, param: str) -> list[str]:
    """The text pieces of a message's content: a string, or a list of `input_text`/`output_text` parts."""
    if isinstance(content, str):
        return [content]
    if isinstance(content, dict):
        content = [content]
    if isinstance(content, list) and content:
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                texts.append(part["text"])
            else:
                raise InvalidRequest("Only text content is supported in input messages.", param=param)
        return texts
    raise InvalidRequest("A message's content must be a string or a list of text parts.", param=param)


def _check_sampling(value: Any) -> dict[str, Any]:
    param = "data_source.sampling_params"
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequest("sampling_params must be an object.", param=param)
    out: dict[str, Any] = {}
    for key, v in value.items():
        p = f"{param}.{key}"
        if key == "reasoning_effort":
            continue
        if key not in SAMPLING_KEYS:
            raise InvalidRequest(f"Unknown sampling parameter '{key}'.", param=p)
        if v is None:
            continue
        number = isinstance(v, int | float) and not isinstance(v, bool)
        if key == "temperature" and not (number and 0 <= v <= 2):
            raise InvalidRequest("temperature must be a number from 0 to 2.", param=p)
        if key == "top_p" and not (number and 0 < v <= 1):
            raise InvalidRequest("top_p must be a number above 0 and at most 1.", param=p)
        if key == "max_completion_tokens" and not (number and int(v) == v and v >= 1):
            raise InvalidRequest("max_completion_tokens must be a positive integer.", param=p)
        if key == "seed" and not (number and int(v) == v):
            raise InvalidRequest("seed must be an integer.", param=p)
        if key == "response_format" and not isinstance(v, dict):
            raise InvalidRequest("response_format must be an object.", param=p)
        if key == "tools" and not isinstance(v, list):
            raise InvalidRequest("tools must be a list of function tools.", param=p)
        out[key] = v
    return out


def _reference_path(ref: str) -> list[str | int] | None:
    """`item.a.b[0]` (or `{{ item.a.b[0] }}`) as a path into the item; None when it is not one."""
    ref = ref.strip()
    if ref.startswith("{{") and ref.endswith("}}"):
        ref = ref[2:-2].strip()
    if not _ITEM_VARIABLE.match(ref) or ref == "item":
        return None
    return [int(index) if index else key for key, index in _REFERENCE_PART.findall(ref[len("item") :])]


# -- items -----------------------------------------------------------------------------------------------


def rows_of_content(content: list[Any]) -> list[Row]:
    """The rows of a `file_content` source: `{"item": {...}, "sample"?: {...}}` each."""
    rows = []
    for i, entry in enumerate(content):
        if not isinstance(entry, dict) or not isinstance(entry.get("item"), dict):
            raise InvalidRequest(
                "Each entry of content must be {'item': {...}}.", param=f"data_source.source.content[{i}]"
            )
        sample = entry.get("sample")
        rows.append(Row(entry["item"], sample if isinstance(sample, dict) else None))
    return rows


def iter_rows_of_file(
    path: Path, *, max_line_bytes: int, max_depth: int = wire.DEFAULT_MAX_DEPTH
) -> Iterator[Row]:
    """The rows of a JSONL file, one at a time as the file is read (blocking: iterate in a thread), so that a
    file of any size is checked in the memory of one read chunk and one line. A line is `{"item": {...},
    "sample"?: {...}}` as OpenAI writes them, or a bare item (a fine-tuning file's rows can be evaluated as
    they are). An `evals` upload is not checked on upload: a line that is not a JSON object, or breaks the
    gateway's JSON rules (`gateway.wire`), is a 400 naming it."""
    for lineno, raw in iter_lines(path, max_line_bytes=max_line_bytes):
        try:
            value = wire.loads(raw, max_depth=max_depth)
        except InvalidRequest as exc:
            message = f"Line {lineno} of the file: {exc.message}"
            raise InvalidRequest(message, param="data_source.source.id", code="invalid_file") from None
        except ValueError as exc:  # not JSON, or not UTF-8
            value, reason = None, f"not valid JSON ({exc})"
        else:
            reason = "not a JSON object"
        if not isinstance(value, dict):
            raise InvalidRequest(
                f"Line {lineno} of the file is {reason}.", param="data_source.source.id", code="invalid_file"
            )
        if isinstance(value.get("item"), dict) and set(value) <= {"item", "sample"}:
            sample = value.get("sample")
            yield Row(value["item"], sample if isinstance(sample, dict) else None)
        else:
            yield Row(value)


def required_properties(item_schema: dict[str, Any]) -> list[str]:
    """The properties an object item must have: the schema's `required` names. Eval creates check that
    `required` is a list of names; an eval stored before that check with anything else there requires
    nothing (a run create never fails on it)."""
    if item_schema.get("type", "object") != "object":
        return []
    required = item_schema.get("required")
    return [name for name in required if isinstance(name, str)] if isinstance(required, list) else []


def check_rows(run: RunSource, rows: Iterable[Row], item_schema: dict[str, Any]) -> int:
    """Every item against the eval's item schema (its `required` properties) and the run's messages, one
    at a time (`rows` may be read from a file as it goes); returns how many there are."""
    source_param = "data_source.source.id" if run.file_id else "data_source.source.content"
    required = required_properties(item_schema)
    count = 0
    for index, row in enumerate(rows):
        count += 1
        missing = [k for k in required if k not in row.item]
        if missing:
            raise InvalidRequest(
                f"Item {index} lacks the properties the eval's item_schema requires: {', '.join(missing)}.",
                param=source_param,
                code="invalid_item",
            )
        if run.type == "jsonl" and (row.sample is None or not isinstance(row.sample.get("output_text"), str)):
            raise InvalidRequest(
                f"Item {index} has no sample: the items of a jsonl run carry "
                "{'sample': {'output_text': ...}}.",
                param=source_param,
                code="invalid_item",
            )
        if run.input_messages is not None:
            render_messages(run.input_messages, row.item, index=index)
    if count == 0:
        raise InvalidRequest("The data source has no items.", param=source_param)
    return count


def render_messages(
    input_messages: dict[str, Any], item: dict[str, Any], *, index: int = 0
) -> list[dict[str, Any]]:
    """The chat messages of one item: the template rendered (graders' `{{ item.x }}` syntax), or the list of
    messages the item reference points at. A variable the item lacks is a 400 naming the message."""
    param = "data_source.input_messages"
    if input_messages["type"] == "item_reference":
        path = _reference_path(input_messages["item_reference"]) or []
        value: Any = item
        for part in path:
            try:
                value = value[part]
            except (KeyError, IndexError, TypeError):
                value = None
                break
        if not isinstance(value, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in value
        ):
            raise InvalidRequest(
                f"Item {index}: {input_messages['item_reference']} is not a list of messages.",
                param=f"{param}.item_reference",
                code="invalid_template",
            )
        return [dict(m) for m in value]
    messages = []
    for i, message in enumerate(input_messages["template"]):
        where = f"{param}.template[{i}].content"
        texts = [_render(text, item, index, where) for text in _texts(message.get("content"), where)]
        messages.append({"role": message["role"], "content": "\n".join(texts)})
    return messages


def _render(text: str, item: dict[str, Any], index: int, param: str) -> str:
    try:
        return render_template(text, {}, item)
    except Exception as exc:  # envsdk reports a variable the item lacks with an error type of its own
        raise InvalidRequest(f"Item {index}: {exc}.", param=param, code="invalid_template") from None
