"""The Evals API's `stored_completions` data source, through the official `openai` SDK: an organisation with
capture on makes chat completions with `store: true` and metadata (on the base model and on a fine-tuned
one, in two batches a second apart); evals with a `stored_completions` config grade the stored answers
themselves, or sample a model anew over their inputs; the metadata, model, time and limit filters select
exactly the completions they name; another organisation's completions are never read; bad sources are 400s
naming the field.

The module has a database, a gateway (tiny-chat on the module's engine) and a worker of its own.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest

from gateway.capture import store as capture_store
from gateway.db import create_pool
from gateway.evals import stored
from gateway.evals.stored_source import STORED_ITEM_SCHEMA
from tests.support.capture import capture_on, eventually
from tests.support.data import BASE
from tests.support.engine import make_lora_adapter, register_model
from tests.support.fixtures import gateway_fixture, worker_fixture
from tests.support.stack import Admin, GatewayServer, Tenant

WORKER_ENV = {"TUNEGATE_REQUEUE_INTERVAL_S": "2", "TUNEGATE_HEARTBEAT_INTERVAL_S": "0.5"}
gw = gateway_fixture("evals-stored", own_database=True, auth_cache_ttl_s=1.0)
worker = worker_fixture(autouse=True, **WORKER_ENV)

STORED: Any = {"type": "stored_completions", "metadata": {"task": "sums"}}
V1: Any = {
    "type": "string_check",
    "name": "prompt v1",
    "input": "{{ item.metadata.prompt }}",
    "reference": "v1",
    "operation": "eq",
}
ANY_TEXT: Any = {
    "type": "string_check",
    "name": "has its id",
    "input": "{{ item.id }}",
    "reference": "{{ item.id }}",
    "operation": "eq",
}
"""Passes every item: for runs whose point is which items they have."""
FINAL = ("completed", "failed", "canceled")


def _ask(t: Tenant, model: str, n: int, metadata: dict[str, str], **extra: Any) -> dict[str, Any]:
    """One stored chat completion of `model`, as the client got it, with its request's messages."""
    messages = [
        {"role": "system", "content": "Answer with the number only."},
        {"role": "user", "content": f"What is {n} + {n}?"},
    ]
    reply = t.client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0, store=True, metadata=metadata, **extra
    )
    return {"reply": reply.to_dict(), "messages": messages, "metadata": metadata, "model": model}


class Captured:
    """The module's stored completions: `org`'s (with a fine-tuned model `ft`), `other`'s, and the second
    that divides the first batch from the second (`mark`)."""

    def __init__(self, org: Tenant, other: Tenant, ft: str) -> None:
        self.org, self.other, self.ft = org, other, ft
        self.first: list[dict[str, Any]] = []
        self.second: list[dict[str, Any]] = []
        self.theirs: list[dict[str, Any]] = []
        self.mark = 0

    @property
    def sums(self) -> list[dict[str, Any]]:
        """`org`'s completions of the task `sums`, oldest first."""
        return [c for c in self.first + self.second if c["metadata"].get("task") == "sums"]

    def ids(self, pick: Callable[[dict[str, Any]], bool] = lambda c: True) -> list[str]:
        return [c["reply"]["id"] for c in self.sums if pick(c)]


@pytest.fixture(scope="module")
def captured(gw: GatewayServer, gw_admin: Admin, tiny_model_dir: Path, tmp_path_factory: Any) -> Captured:
    org = gw_admin.tenant("stored-" + secrets.token_hex(3))
    other = gw_admin.tenant("stored-other-" + secrets.token_hex(3))
    for t in (org, other):
        capture_on(gw_admin, t)
    adapter = str(make_lora_adapter(tiny_model_dir, tmp_path_factory.mktemp("lora"), seed=5))
    ft = f"ft:{BASE}:{org.org_id}:stored:ftjob-{secrets.token_hex(6)}"
    register_model(gw.settings.database_url or "", org.org_id, ft, adapter)
    c = Captured(org, other, ft)
    c.first = [_ask(org, BASE, n, {"task": "sums", "prompt": "v1"}) for n in (1, 2, 3)]
    c.first.append(_ask(org, ft, 4, {"task": "sums", "prompt": "v1"}))
    c.first.append(_ask(org, BASE, 5, {"task": "other", "prompt": "v1"}))
    c.theirs = [_ask(other, BASE, n, {"task": "sums", "prompt": "v1"}) for n in (6, 7)]
    c.mark = int(time.time()) + 1
    time.sleep(c.mark - time.time() + 0.05)  # the second batch is made from the second `mark` on
    c.second = [_ask(org, BASE, n, {"task": "sums", "prompt": "v2"}) for n in (8, 9)]
    for t, made in ((org, c.first + c.second), (other, c.theirs)):
        _stored_all(t, [m["reply"]["id"] for m in made])
    return c


def _stored_all(t: Tenant, ids: list[str], *, only: bool = True) -> None:
    """Wait until the organisation's stored completions are `ids` (`only`), or include them (captures are
    written in batches)."""

    def probe() -> bool | None:
        have = [c.id for c in t.client.chat.completions.list(limit=100)]
        return (have == ids if only else set(ids) <= set(have)) or None

    eventually(probe, f"{ids} stored")


def _run(t: Tenant, eval_id: str, source: dict[str, Any], **extra: Any) -> Any:
    run = t.client.evals.runs.create(
        eval_id,
        data_source={"type": "completions", "source": {"type": "stored_completions", **source}, **extra},
    )
    deadline = time.monotonic() + 240
    while (run := t.client.evals.runs.retrieve(run.id, eval_id=eval_id)).status not in FINAL:
        assert time.monotonic() < deadline, f"run {run.id} stuck in {run.status}"
        time.sleep(0.3)
    assert run.status == "completed", run.error
    return run


def _items(t: Tenant, eval_id: str, run_id: str) -> list[Any]:
    return list(t.client.evals.runs.output_items.list(run_id, eval_id=eval_id, limit=3))


def _item_ids(t: Tenant, eval_id: str, run_id: str) -> list[str]:
    return [i.datasource_item["id"] for i in _items(t, eval_id, run_id)]


def _answer(c: dict[str, Any]) -> str:
    return str(c["reply"]["choices"][0]["message"]["content"])


# -------------------------------------------------------------------------------------------------- runs
def test_a_run_grades_the_stored_answers_themselves(captured: Captured) -> None:
    org = captured.org
    answers = {c["reply"]["id"]: _answer(c) for c in captured.sums}
    same: Any = {
        "type": "python",
        "name": "the stored answer",
        "source": f"ANSWERS = {json.dumps(answers)}\n\n"
        "def grade(sample, item):\n    return 1.0 if ANSWERS[item['id']] == sample['output_text'] else 0.0\n",
    }
    ev = org.client.evals.create(name="stored", data_source_config=STORED, testing_criteria=[V1, same])
    assert ev.data_source_config.type == "stored_completions"
    assert ev.data_source_config.metadata == {"task": "sums"}
    schema = ev.data_source_config.schema_
    assert schema["required"] == ["item", "sample"]
    assert schema["properties"]["item"] == STORED_ITEM_SCHEMA  # type: ignore[index]
    assert org.client.evals.retrieve(ev.id).to_dict() == ev.to_dict()

    run = _run(org, ev.id, {})
    # every completion of the task `sums` (the eval's metadata), this organisation's only, oldest first
    assert run.model == "" and run.data_source.model is None and run.data_source.input_messages is None
    assert run.data_source.source.to_dict() == {
        "type": "stored_completions",
        "metadata": None,
        "model": None,
        "created_after": None,
        "created_before": None,
        "limit": None,
    }
    assert "_stored_completion_ids" not in run.to_dict()["data_source"]
    assert run.result_counts.to_dict() == {"total": 6, "errored": 0, "failed": 2, "passed": 4}
    assert [(r.testing_criteria, r.passed, r.failed) for r in run.per_testing_criteria_results] == [
        ("prompt v1", 4, 2),
        ("the stored answer", 6, 0),
    ]
    assert run.per_model_usage == []  # nothing sampled, no model graders
    items = _items(org, ev.id, run.id)
    assert [i.datasource_item_id for i in items] == list(range(6))
    for item, c in zip(items, captured.sums, strict=True):
        reply = c["reply"]
        assert item.datasource_item == {
            "id": reply["id"],
            "model": c["model"],
            "created": reply["created"],
            "metadata": c["metadata"],
            "input": c["messages"],
        }
        assert item.status == ("pass" if c["metadata"]["prompt"] == "v1" else "fail")
        assert item.sample.output[0].content == _answer(c) and item.sample.output[0].role == "assistant"
        assert [m.to_dict() for m in item.sample.input] == c["messages"]
        assert (
            item.sample.model == c["model"]
            and item.sample.finish_reason == reply["choices"][0]["finish_reason"]
        )
        usage = reply["usage"]
        assert item.sample.usage.to_dict() == {
            "prompt_tokens": usage["prompt_tokens"],
            "completion_tokens": usage["completion_tokens"],
            "total_tokens": usage["total_tokens"],
            "cached_tokens": 0,
        }
        assert item.sample.temperature == 0 and item.sample.max_completion_tokens == 8
        assert item.sample.error is None
        assert [r.score for r in item.results] == [float(c["metadata"]["prompt"] == "v1"), 1.0]


def test_metadata_model_time_and_limit_select_the_completions(captured: Captured) -> None:
    org = captured.org
    ev = org.client.evals.create(name="selects", data_source_config=STORED, testing_criteria=[ANY_TEXT])
    first = lambda c: c in captured.first  # noqa: E731
    cases: list[tuple[dict[str, Any], list[str]]] = [
        ({"metadata": {"prompt": "v2"}}, captured.ids(lambda c: c["metadata"]["prompt"] == "v2")),
        ({"model": captured.ft}, captured.ids(lambda c: c["model"] == captured.ft)),
        (
            {"model": BASE, "metadata": {"prompt": "v1"}},
            captured.ids(lambda c: c["model"] == BASE and first(c)),
        ),
        ({"created_after": captured.mark}, captured.ids(lambda c: not first(c))),
        ({"created_before": captured.mark}, captured.ids(first)),
        ({"limit": 3}, captured.ids()[-3:]),  # the newest three, oldest first
    ]
    for source, expected in cases:
        run = _run(org, ev.id, source)
        assert _item_ids(org, ev.id, run.id) == expected, source
        assert run.result_counts.total == len(expected) and run.result_counts.passed == len(expected)
        shown = run.data_source.source.to_dict()
        assert {k: shown[k] for k in source} == source
    # the eval's own metadata and the run's both hold: a task the eval does not cover selects nothing
    err = _bad(
        lambda: org.client.evals.runs.create(ev.id, data_source=_stored({"metadata": {"task": "other"}}))
    )
    assert err.param == "data_source.source"
    # an eval of every stored completion (no metadata) reads the other task too
    every = org.client.evals.create(
        data_source_config={"type": "stored_completions"}, testing_criteria=[ANY_TEXT]
    )
    run = _run(org, every.id, {"metadata": {"task": "other"}})
    assert _item_ids(org, every.id, run.id) == [c["reply"]["id"] for c in captured.first[4:5]]


def test_a_run_samples_a_model_anew_over_the_stored_inputs(captured: Captured) -> None:
    org = captured.org
    ev = org.client.evals.create(data_source_config=STORED, testing_criteria=[ANY_TEXT])
    run = _run(
        org,
        ev.id,
        {"metadata": {"prompt": "v2"}},
        model=BASE,
        input_messages={"type": "item_reference", "item_reference": "item.input"},
        sampling_params={"temperature": 0, "max_completion_tokens": 8},
    )
    assert run.model == BASE and run.data_source.model == BASE
    items = _items(org, ev.id, run.id)
    v2 = [c for c in captured.sums if c["metadata"]["prompt"] == "v2"]
    # greedy, the same model and messages: the same answers as were stored
    assert [i.sample.output[0].content for i in items] == [_answer(c) for c in v2]
    assert [[m.to_dict() for m in i.sample.input] for i in items] == [c["messages"] for c in v2]
    assert [u.model_name for u in run.per_model_usage] == [BASE]
    assert run.per_model_usage[0].invocation_count == 2


async def test_a_later_turn_of_an_episode_is_an_item_with_its_whole_messages(
    gw: GatewayServer, captured: Captured
) -> None:
    """An episode's second turn is stored as a delta on its first (`messages_prefix`); its item's `input`
    and its sample's are its whole messages."""
    org = captured.org
    header = {"X-Episode-Id": "ep-" + secrets.token_hex(4)}
    asked: Any = dict(model=BASE, max_tokens=8, temperature=0, store=True, metadata={"task": "episode"})
    first: Any = [{"role": "user", "content": "What is 2 + 2?"}]
    one = org.client.chat.completions.create(messages=first, extra_headers=header, **asked)
    reply = {"role": "assistant", "content": one.choices[0].message.content}
    second: Any = [*first, reply, {"role": "user", "content": "And 3 + 3?"}]
    two = org.client.chat.completions.create(messages=second, extra_headers=header, **asked)
    ids = [one.id, two.id]
    _stored_all(org, ids, only=False)
    pool = await create_pool(gw.settings.database_url or "", min_size=1, max_size=1)
    try:
        kept = await capture_store.by_ids(pool, org_id=org.org_id, ids=ids)  # as stored (`codec`)
    finally:
        await pool.close()
    kept.sort(key=lambda r: ids.index(r.id))
    assert [(r.id, r.messages_prefix, r.request["messages"]) for r in kept] == [
        (one.id, 0, first),
        (two.id, 1, second[1:]),  # the second turn keeps the messages after the first turn's
    ]
    ev = org.client.evals.create(
        data_source_config={"type": "stored_completions", "metadata": {"task": "episode"}},
        testing_criteria=[ANY_TEXT],
    )
    run = _run(org, ev.id, {})
    items = _items(org, ev.id, run.id)
    assert [i.datasource_item["id"] for i in items] == ids
    assert [i.datasource_item["input"] for i in items] == [first, second]
    assert [[m.to_dict() for m in i.sample.input] for i in items] == [first, second]


# ------------------------------------------------------------------------------------------------ tenancy
async def test_another_organisations_completions_are_never_read(
    gw: GatewayServer, captured: Captured
) -> None:
    other = captured.other
    ev = other.client.evals.create(data_source_config=STORED, testing_criteria=[ANY_TEXT])
    run = _run(other, ev.id, {})
    assert _item_ids(other, ev.id, run.id) == [c["reply"]["id"] for c in captured.theirs]
    with pytest.raises(openai.NotFoundError):
        captured.org.client.evals.runs.create(ev.id, data_source=_stored({}))
    # the worker reads the run's organisation's completions only: another's id reads as gone, as a deleted one
    mine, theirs = captured.ids()[0], captured.theirs[0]["reply"]["id"]
    deleted = _ask(captured.org, BASE, 11, {"task": "gone"})["reply"]["id"]
    _stored_all(captured.org, [deleted], only=False)
    assert captured.org.client.chat.completions.delete(deleted).deleted is True
    pool = await create_pool(gw.settings.database_url or "", min_size=1, max_size=1)
    try:
        rows = await stored.rows_by_ids(pool, org_id=captured.org.org_id, ids=[theirs, mine, deleted])
    finally:
        await pool.close()
    assert [r.item["id"] for r in rows] == [theirs, mine, deleted]
    assert [r.item.keys() == {"id"} for r in rows] == [True, False, True]
    assert rows[1].record is not None and rows[1].record["error"] is None
    for gone in (rows[0], rows[2]):
        assert gone.record is not None and gone.record["output"] == []
        assert gone.record["error"]["code"] == "stored_completion_not_found"


# -------------------------------------------------------------------------------------------- bad input
def _stored(source: dict[str, Any], **extra: Any) -> Any:
    return {"type": "completions", "source": {"type": "stored_completions", **source}, **extra}


def _bad(call: Callable[[], Any]) -> Any:
    with pytest.raises(openai.BadRequestError) as err:
        call()
    body = err.value.body
    assert isinstance(body, dict) and set(body) >= {"message", "type", "param", "code"}
    assert err.value.status_code == 400 and body["type"] == "invalid_request_error"
    return err.value


def test_bad_stored_sources_are_400s_naming_the_field(captured: Captured, gw_admin: Admin) -> None:
    org = captured.org
    configs: list[tuple[Any, str]] = [
        ({"type": "stored_completions", "metadata": {"k": "v" * 600}}, "data_source_config.metadata.k"),
        ({"type": "stored_completions", "metadata": "sums"}, "data_source_config.metadata"),
        ({"type": "logs"}, "data_source_config.type"),
    ]
    for config, param in configs:
        err = _bad(
            lambda config=config: org.client.evals.create(data_source_config=config, testing_criteria=[V1])
        )
        assert err.param == param, err.message

    ev = org.client.evals.create(data_source_config=STORED, testing_criteria=[ANY_TEXT])
    sample = {"type": "item_reference", "item_reference": "item.input"}
    missing = {"type": "template", "template": [{"role": "user", "content": "{{ item.metadata.missing }}"}]}
    runs: list[tuple[Any, str, str | None]] = [
        (_stored({"metadata": {"k": 5}}), "data_source.source.metadata.k", None),
        (_stored({"metadata": ["task"]}), "data_source.source.metadata", None),
        (_stored({"model": ""}), "data_source.source.model", None),
        (_stored({"model": 5}), "data_source.source.model", None),
        (_stored({"created_after": "yesterday"}), "data_source.source.created_after", None),
        (_stored({"created_before": -1}), "data_source.source.created_before", None),
        (_stored({"created_after": 100, "created_before": 100}), "data_source.source.created_before", None),
        (_stored({"limit": 0}), "data_source.source.limit", None),
        (_stored({"limit": True}), "data_source.source.limit", None),
        (_stored({"limit": 10_001}), "data_source.source.limit", None),
        (_stored({"metadata": {"task": "nothing"}}), "data_source.source", None),
        (_stored({}, input_messages=sample), "data_source.model", None),
        (_stored({}, sampling_params={"temperature": 0}), "data_source.model", None),
        (_stored({}, model=BASE), "data_source.input_messages", None),
        (
            _stored({}, model=BASE, input_messages=missing),
            "data_source.input_messages.template[0].content",
            "invalid_template",
        ),  # fmt: skip
        (
            {"type": "jsonl", "source": {"type": "stored_completions"}},
            "data_source.source.type",
            "unsupported_data_source",
        ),
    ]
    for data_source, param, code in runs:
        err = _bad(lambda ds=data_source: org.client.evals.runs.create(ev.id, data_source=ds))
        assert (err.param, err.code if code else None) == (param, code), err.message
    # an eval whose items need a property stored completions lack
    custom: Any = {
        "type": "custom",
        "item_schema": {
            "type": "object",
            "properties": {"question": {"type": "string"}},
            "required": ["question"],
        },
    }
    needs = org.client.evals.create(data_source_config=custom, testing_criteria=[ANY_TEXT])
    err = _bad(lambda: org.client.evals.runs.create(needs.id, data_source=_stored({})))
    assert (err.param, err.code) == ("data_source.source", "invalid_item")
    # an organisation that stored nothing has nothing to grade
    empty = gw_admin.tenant("stored-empty-" + secrets.token_hex(3))
    theirs = empty.client.evals.create(data_source_config=STORED, testing_criteria=[ANY_TEXT])
    err = _bad(lambda: empty.client.evals.runs.create(theirs.id, data_source=_stored({})))
    assert err.param == "data_source.source"
    for e in (ev, needs):
        assert org.client.evals.runs.list(e.id).data == []  # nothing was stored
