"""Episodes and rewards (`/v1/episodes`, `POST /v1/chat/completions/{id}/feedback`), through the official
`openai` SDK (`client.post/get` with `cast_to=object`) against a gateway whose engine serves tiny-chat:
making an episode mints an inference-only key where capture is on; the list filters; an episode's calls and
rewards; close (idempotent) and delete (calls, rewards and key gone); rewards append-only, once per
idempotency key, on the episode, a completion or a span of its tokens, long after close; thumbs; every
route scoped to the organisation; bad input refused in OpenAI's envelope with nothing stored; records past
their retention not shown."""

from __future__ import annotations

import asyncio
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import asyncpg
import httpx
import openai
import pytest

from tests.support.capture import capture_on, eventually
from tests.support.data import BASE
from tests.support.fixtures import gateway_fixture
from tests.support.stack import Admin, Tenant

gw = gateway_fixture("episodes")

ASK: Any = [{"role": "user", "content": "What is 2 + 3?"}]
CHAT: dict[str, Any] = {"model": BASE, "messages": ASK, "max_tokens": 5, "temperature": 0}
EPISODE_KEYS = {
    "id",
    "object",
    "created_at",
    "state",
    "metadata",
    "parent_episode_id",
    "idle_timeout_s",
    "on_idle",
    "last_call_at",
    "closed_at",
    "calls",
}
REWARD_KEYS = {
    "id",
    "object",
    "episode_id",
    "name",
    "value",
    "target",
    "source",
    "idempotency_key",
    "comment",
    "created_at",
}
CALL_KEYS = {
    "id",
    "created",
    "model",
    "served_version",
    "finish_reason",
    "usage",
    "previous_id",
    "prompt_prefix_tokens",
    "segment_break",
    "latency_ms",
}


# ------------------------------------------------------------------------------------------------- helpers


def _post(t: Tenant, path: str, body: dict[str, Any] | None = None, **kw: Any) -> Any:
    return t.client.post(path, body=body or {}, cast_to=object, **kw)


def _get(t: Tenant, path: str, **params: Any) -> Any:
    return t.client.get(path, cast_to=object, options={"params": params})


def _http(t: Tenant, key: str | None = None) -> httpx.Client:
    return httpx.Client(
        base_url=str(t.client.base_url), headers={"Authorization": f"Bearer {key or t.key}"}, timeout=60
    )


def _refused(resp: httpx.Response, status: int, param: str | None, code: str | None) -> dict[str, Any]:
    """The error of a refused request: its status and OpenAI's envelope, naming `param` with `code`."""
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert (error["param"], error["code"]) == (param, code), error
    return dict(error)


def _sql(database: str, query: str, *args: Any) -> list[asyncpg.Record]:
    async def run() -> list[asyncpg.Record]:
        conn = await asyncpg.connect(database)
        try:
            return await conn.fetch(query, *args)
        finally:
            await conn.close()

    return asyncio.run(run())


def _captured(t: Tenant, completion_id: str) -> dict[str, Any]:
    """The stored completion, once written."""

    def probe() -> dict[str, Any] | None:
        resp = _http(t).get(f"chat/completions/{completion_id}")
        return resp.json() if resp.status_code == 200 else None

    return eventually(probe, f"{completion_id} captured")


def _call(t: Tenant, episode_id: str, **kw: Any) -> str:
    """A chat call into `episode_id` (named by the header, with the organisation's key), once captured."""
    header = {"X-Episode-Id": episode_id}
    body = {**CHAT, **kw}
    if body.get("stream"):
        chunks = list(t.client.chat.completions.create(**body, extra_headers=header))  # read to its end
        completion_id = chunks[0].id
    else:
        completion_id = t.client.chat.completions.create(**body, extra_headers=header).id
    _captured(t, completion_id)
    return completion_id


def _tag() -> str:
    return secrets.token_hex(4)


@pytest.fixture(scope="module")
def capturing(gw_admin: Admin) -> Tenant:
    """An organisation with capture on (records kept 7 days)."""
    t = gw_admin.tenant("episodes-" + _tag())
    capture_on(gw_admin, t, retention_days=7)
    return t


@pytest.fixture(scope="module")
def other(gw_admin: Admin) -> Tenant:
    """Another organisation with capture on."""
    t = gw_admin.tenant("episodes-other-" + _tag())
    capture_on(gw_admin, t)
    return t


# ----------------------------------------------------------------------------------------------- episodes
def test_making_an_episode_mints_an_inference_only_key(
    gw_admin: Admin, capturing: Tenant, database: str
) -> None:
    tag = _tag()
    before = time.time()
    made = _post(
        capturing,
        "/episodes",
        {
            "id": f"run-{tag}",
            "metadata": {"task": "sums", "run": tag},
            "parent_episode_id": "root-1",
            "idle_timeout_s": 60,
            "on_idle": "close",
            "key_ttl_s": 600,
        },
    )
    assert set(made) == EPISODE_KEYS | {"key", "key_expires_at"}
    key = made.pop("key")
    assert key.startswith("sk-tg-")
    assert made.pop("key_expires_at") == pytest.approx(before + 600, abs=5)
    created_at = made.pop("created_at")
    assert created_at == pytest.approx(before, abs=5)
    assert made == {
        "id": f"run-{tag}",
        "object": "episode",
        "state": "open",
        "metadata": {"task": "sums", "run": tag},
        "parent_episode_id": "root-1",
        "idle_timeout_s": 60,
        "on_idle": "close",
        "last_call_at": None,
        "closed_at": None,
        "calls": 0,
    }
    # Kept as long as the capture setting keeps records (7 days here).
    expires = _sql(
        database,
        "SELECT expires_at FROM episodes WHERE organization_id = $1 AND id = $2",
        capturing.org_id,
        f"run-{tag}",
    )
    assert expires[0]["expires_at"].timestamp() == pytest.approx(created_at + 7 * 86400, abs=5)

    # Defaults: an id of its own, 15 minutes' idle timeout, abandoned when idle, a key for a day.
    plain = _post(capturing, "/episodes")
    assert plain["id"].startswith("ep_") and len(plain["id"]) > 10
    assert (plain["idle_timeout_s"], plain["on_idle"], plain["metadata"], plain["parent_episode_id"]) == (
        900,
        "abandon",
        {},
        None,
    )
    assert plain["key_expires_at"] == pytest.approx(time.time() + 86400, abs=5)

    # The admin lists the minted keys as kind `episode`, named after their episode.
    keys = gw_admin.http.get(
        f"/v1/admin/organizations/{capturing.org_id}/api_keys", params={"kind": "episode"}
    ).json()["data"]
    mine = {k["name"]: k for k in keys}
    assert {f"episode run-{tag}", f"episode {plain['id']}"} <= set(mine)
    assert {k["kind"] for k in keys} == {"episode"}
    assert mine[f"episode run-{tag}"]["expires_at"] == pytest.approx(before + 600, abs=5)

    # The key may chat; any other route is 403, making episodes included.
    episode_key = _http(capturing, key)
    chat = episode_key.post("chat/completions", json=CHAT)
    assert chat.status_code == 200, chat.text
    _refused(episode_key.get("files"), 403, None, "permission_denied")
    _refused(episode_key.post("episodes", json={}), 403, None, "permission_denied")
    _refused(episode_key.get(f"episodes/run-{tag}"), 403, None, "permission_denied")
    _refused(
        episode_key.post(f"episodes/run-{tag}/rewards", json={"name": "r", "value": 1}),
        403,
        None,
        "permission_denied",
    )
    chat_id = chat.json()["id"]
    _refused(
        episode_key.post(f"chat/completions/{chat_id}/feedback", json={"thumbs": "up"}),
        403,
        None,
        "permission_denied",
    )
    _refused(episode_key.get(f"chat/completions/{chat_id}"), 403, None, "permission_denied")
    with pytest.raises(openai.PermissionDeniedError):
        openai.OpenAI(base_url=str(capturing.client.base_url), api_key=key, max_retries=0).files.list()

    # An id the organisation has is 409; another organisation may use it.
    with pytest.raises(openai.ConflictError) as taken:
        _post(capturing, "/episodes", {"id": f"run-{tag}"})
    assert taken.value.code == "episode_exists" and taken.value.param == "id"
    assert len(_sql(database, "SELECT 1 FROM api_keys WHERE name = $1", f"episode run-{tag}")) == 1


def test_no_episode_where_capture_is_off(gw_admin: Admin, database: str) -> None:
    off = gw_admin.tenant("episodes-off-" + _tag())
    with pytest.raises(openai.PermissionDeniedError) as info:
        _post(off, "/episodes", {"id": "nope"})
    assert info.value.code == "capture_off"
    assert _sql(database, "SELECT 1 FROM episodes WHERE organization_id = $1", off.org_id) == []
    assert (
        _sql(database, "SELECT 1 FROM api_keys WHERE organization_id = $1 AND kind = 'episode'", off.org_id)
        == []
    )
    # A key of its own with capture on may.
    made = gw_admin.http.post(f"/v1/admin/organizations/{off.org_id}/api_keys", json={"name": "agent"}).json()
    assert gw_admin.http.post(f"/v1/admin/api_keys/{made['id']}/capture", json={"enabled": True}).is_success
    agent = Tenant(gw_admin.gateway_url, off.org_id, made["key"], made["id"])
    assert _post(agent, "/episodes", {"id": "yes"})["id"] == "yes"


def test_bad_episodes_are_400s_naming_the_field_and_store_nothing(capturing: Tenant, database: str) -> None:
    http = _http(capturing)
    tag = _tag()
    cases: list[tuple[dict[str, Any], str]] = [
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k" * 65: "v"}}, "metadata"),
        ({"metadata": {"k": "v" * 513}}, "metadata.k"),
        ({"metadata": {"k": 1}}, "metadata.k"),
        ({"metadata": "tags"}, "metadata"),
        ({"id": ""}, "id"),
        ({"id": "e" * 257}, "id"),
        ({"id": "a/b"}, "id"),
        ({"id": " padded"}, "id"),
        ({"idle_timeout_s": 0}, "idle_timeout_s"),
        ({"idle_timeout_s": 86401}, "idle_timeout_s"),
        ({"on_idle": "sleep"}, "on_idle"),
        ({"key_ttl_s": 59}, "key_ttl_s"),
        ({"key_ttl_s": 604801}, "key_ttl_s"),
        ({"parent_episode_id": "p" * 257}, "parent_episode_id"),
    ]
    for body, param in cases:
        error = _refused(
            http.post("episodes", json={"id": f"bad-{tag}", **body}), 400, param, "invalid_value"
        )
        assert error["message"], body
    rows = _sql(
        database,
        "SELECT id FROM episodes WHERE organization_id = $1 AND id LIKE $2",
        capturing.org_id,
        f"%{tag}%",
    )
    assert rows == []
    assert _sql(database, "SELECT 1 FROM api_keys WHERE name LIKE $1", f"%{tag}%") == []
    # Unknown episodes are 404 on every route.
    for method, path, body in [
        ("GET", "episodes/nope", None),
        ("POST", "episodes/nope/close", None),
        ("DELETE", "episodes/nope", None),
        ("GET", "episodes/nope/rewards", None),
        ("POST", "episodes/nope/rewards", {"name": "r", "value": 1}),
    ]:
        error = _refused(http.request(method, path, json=body), 404, "episode_id", "not_found")
        assert error["message"] == "No episode found with id 'nope'."
    _refused(
        http.post("chat/completions/nope/feedback", json={"thumbs": "up"}), 404, "completion_id", "not_found"
    )


def test_list_filters_pages_and_states(capturing: Tenant, database: str) -> None:
    tag = _tag()
    ids = [f"list-{tag}-{i}" for i in range(4)]
    start = int(time.time())
    _post(capturing, "/episodes", {"id": ids[0], "metadata": {"run": tag, "task": "a"}})
    _post(capturing, "/episodes", {"id": ids[1], "metadata": {"run": tag, "task": "b"}, "idle_timeout_s": 1})
    _post(
        capturing,
        "/episodes",
        {"id": ids[2], "metadata": {"run": tag, "task": "a"}, "idle_timeout_s": 1, "on_idle": "close"},
    )
    _post(capturing, "/episodes", {"id": ids[3], "metadata": {"run": tag, "task": "b"}})
    closed = _post(capturing, f"/episodes/{ids[3]}/close")
    _call(capturing, ids[0])  # a call of the base model, captured by the header into the episode
    time.sleep(1.5)  # the two with a second's idle timeout go idle

    def listed(**params: Any) -> list[str]:
        page = _get(capturing, "/episodes", **{"metadata[run]": tag, **params})
        assert set(page) == {"object", "data", "first_id", "last_id", "has_more"} and page["object"] == "list"
        assert all(set(e) == EPISODE_KEYS for e in page["data"])
        return [e["id"] for e in page["data"]]

    assert listed() == ids
    assert listed(order="desc") == ids[::-1]
    every = {e["id"]: e for e in _get(capturing, "/episodes", **{"metadata[run]": tag})["data"]}
    assert [every[i]["state"] for i in ids] == ["open", "abandoned", "closed", "closed"]
    assert [every[i]["calls"] for i in ids] == [1, 0, 0, 0]
    # Gone idle with on_idle "close": closed when it went idle (a second after it was made: it had no call).
    assert every[ids[2]]["closed_at"] in (every[ids[2]]["created_at"] + 1, every[ids[2]]["created_at"] + 2)
    assert every[ids[1]]["closed_at"] is None and every[ids[3]]["closed_at"] == closed["closed_at"]

    assert listed(state="open") == [ids[0]]
    assert listed(state="abandoned") == [ids[1]]
    assert listed(state="closed") == [ids[2], ids[3]]
    assert listed(**{"metadata[task]": "a"}) == [ids[0], ids[2]]
    assert listed(**{"metadata[task]": "b"}, state="closed") == [ids[3]]
    assert listed(**{"metadata[task]": "c"}) == []
    assert listed(model=BASE) == [ids[0]]
    assert listed(model="ft:tiny-chat:other") == []

    # Pages: after, limit, has_more.
    page = _get(capturing, "/episodes", **{"metadata[run]": tag, "limit": 3})
    assert [e["id"] for e in page["data"]] == ids[:3] and page["has_more"] is True
    assert (page["first_id"], page["last_id"]) == (ids[0], ids[2])
    rest = _get(capturing, "/episodes", **{"metadata[run]": tag, "limit": 3, "after": ids[2]})
    assert [e["id"] for e in rest["data"]] == [ids[3]] and rest["has_more"] is False
    assert listed(after=ids[1], order="desc") == [ids[0]]

    # Time: strictly after / before the given second (their creation times moved a minute apart here).
    for minutes, episode in enumerate(ids):
        _sql(
            database,
            "UPDATE episodes SET created_at = to_timestamp($3) + interval '0.5 s' WHERE organization_id = $1 "
            "AND id = $2",
            capturing.org_id,
            episode,
            start + 60 * minutes,
        )
    assert listed(created_after=start + 60) == ids[1:]
    assert listed(created_after=start + 61) == ids[2:]
    assert listed(created_before=start + 60) == ids[:1]
    assert listed(created_before=start + 61) == ids[:2]
    assert listed(created_after=start + 59, created_before=start + 121) == ids[1:3]

    # Bad filters are 400s naming them.
    http = _http(capturing)
    for params, param in [
        ({"limit": 0}, "limit"),
        ({"limit": 101}, "limit"),
        ({"order": "sideways"}, "order"),
        ({"state": "sleeping"}, "state"),
        ({"created_after": "yesterday"}, "created_after"),
        ({"created_after": 10**15}, "created_after"),
        ({"created_before": -1}, "created_before"),
        ({"metadata[" + "k" * 65 + "]": "v"}, "metadata"),
    ]:
        _refused(http.get("episodes", params=params), 400, param, "invalid_value")


def test_an_episode_with_its_calls_close_and_delete(capturing: Tenant, database: str) -> None:
    episode = f"calls-{_tag()}"
    _post(capturing, "/episodes", {"id": episode, "metadata": {"k": "v"}})
    first = _call(capturing, episode)
    second = _call(capturing, episode, stream=True, max_tokens=3)
    got = _get(capturing, f"/episodes/{episode}")
    assert set(got) == EPISODE_KEYS | {"rewards"}
    assert got["state"] == "open" and got["rewards"] == [] and got["metadata"] == {"k": "v"}
    assert [c["id"] for c in got["calls"]] == [first, second]
    for call, max_tokens in zip(got["calls"], (5, 3), strict=True):
        assert set(call) == CALL_KEYS
        stored = _captured(capturing, call["id"])
        assert call["created"] == stored["created"] and call["usage"] == stored["usage"]
        assert call["model"] == BASE == call["served_version"]
        assert call["finish_reason"] == stored["choices"][0]["finish_reason"]
        assert call["usage"]["completion_tokens"] <= max_tokens
        assert isinstance(call["latency_ms"], int) and call["latency_ms"] >= 0
        assert isinstance(call["prompt_prefix_tokens"], int)

    # Close: closed at once; closing again answers the episode as it was closed.
    closed = _post(capturing, f"/episodes/{episode}/close")
    assert set(closed) == EPISODE_KEYS and closed["state"] == "closed" and closed["calls"] == 2
    assert closed["closed_at"] == pytest.approx(time.time(), abs=5)
    time.sleep(1.1)
    assert _post(capturing, f"/episodes/{episode}/close") == closed
    assert _get(capturing, f"/episodes/{episode}")["closed_at"] == closed["closed_at"]
    # Rewards are taken after close.
    reward = _post(capturing, f"/episodes/{episode}/rewards", {"name": "score", "value": 0.5})
    assert reward["episode_id"] == episode

    # Delete: the episode, its calls and rewards, and its key.
    key = _post(capturing, "/episodes", {"id": f"{episode}-keyed"})
    _post(capturing, f"/episodes/{episode}-keyed/rewards", {"name": "score", "value": 1})
    gone = capturing.client.delete(f"/episodes/{episode}", cast_to=object)
    assert gone == {"id": episode, "object": "episode.deleted", "deleted": True}
    gone_keyed = capturing.client.delete(f"/episodes/{episode}-keyed", cast_to=object)
    assert gone_keyed == {"id": f"{episode}-keyed", "object": "episode.deleted", "deleted": True}
    http = _http(capturing)
    for path in (f"episodes/{episode}", f"episodes/{episode}-keyed", f"chat/completions/{first}"):
        assert http.get(path).status_code == 404, path
    assert http.delete(f"episodes/{episode}").status_code == 404
    assert (
        _sql(
            database,
            "SELECT 1 FROM episode_rewards WHERE organization_id = $1 AND episode_id LIKE $2",
            capturing.org_id,
            f"{episode}%",
        )
        == []
    )
    assert _sql(database, "SELECT 1 FROM captured_completions WHERE id = ANY($1)", [first, second]) == []
    revoked = _http(capturing, key["key"]).post("chat/completions", json=CHAT)
    _refused(revoked, 401, None, "invalid_api_key")


# ------------------------------------------------------------------------------------------------ rewards
def test_rewards_on_the_episode_a_completion_and_a_span(capturing: Tenant, database: str) -> None:
    episode = f"rewards-{_tag()}"
    _post(capturing, "/episodes", {"id": episode})
    call = _call(capturing, episode)
    sampled = len(_captured(capturing, call)["capture"]["choices"][0]["token_ids"])
    assert sampled >= 2
    path = f"/episodes/{episode}/rewards"
    before = time.time()

    whole = _post(capturing, path, {"name": "solved", "value": 1})
    assert set(whole) == REWARD_KEYS and whole["id"].startswith("rwd_")
    assert whole["created_at"] == pytest.approx(before, abs=5)
    assert {k: v for k, v in whole.items() if k not in ("id", "created_at")} == {
        "object": "episode.reward",
        "episode_id": episode,
        "name": "solved",
        "value": 1.0,
        "target": {"type": "episode"},
        "source": None,
        "idempotency_key": None,
        "comment": None,
    }
    on_call = _post(
        capturing,
        path,
        {
            "name": "judge",
            "value": -0.25,
            "target": {"type": "completion", "completion_id": call},
            "source": "j1",
        },
    )
    assert on_call["target"] == {"type": "completion", "completion_id": call} and on_call["source"] == "j1"
    span_target = {"type": "span", "completion_id": call, "start": 0, "end": sampled}
    span = _post(capturing, path, {"name": "tokens", "value": 1e6, "target": span_target})
    assert span["target"] == span_target and span["value"] == 1e6

    # An idempotency key counts once, in the body or as the Idempotency-Key header.
    keyed = _post(capturing, path, {"name": "late", "value": 0.5, "idempotency_key": "k1"})
    again = _post(capturing, path, {"name": "late", "value": 0.9, "idempotency_key": "k1"})
    assert again == keyed and keyed["idempotency_key"] == "k1" and keyed["value"] == 0.5
    by_header = _post(
        capturing, path, {"name": "late", "value": 0.5}, options={"headers": {"Idempotency-Key": "k2"}}
    )
    assert by_header["idempotency_key"] == "k2"
    assert _post(capturing, path, {"name": "late", "value": 0.5, "idempotency_key": "k2"}) == by_header
    raw = _http(capturing).post(
        path.lstrip("/"), json={"name": "late", "value": 7}, headers={"Idempotency-Key": "k2"}
    )
    assert raw.status_code == 200 and raw.json() == by_header

    # Listed in the order posted, once each; paged.
    posted = [whole, on_call, span, keyed, by_header]
    listed = _get(capturing, path)
    assert listed == {
        "object": "list",
        "data": posted,
        "first_id": whole["id"],
        "last_id": by_header["id"],
        "has_more": False,
    }
    page = _get(capturing, path, limit=2, after=on_call["id"])
    assert page["data"] == [span, keyed] and page["has_more"] is True
    assert _get(capturing, path, order="desc", limit=1)["data"] == [by_header]
    assert _get(capturing, f"/episodes/{episode}")["rewards"] == posted

    # A day after close (the clock moved: the episode made and closed a day earlier): still taken.
    closed = _post(capturing, f"/episodes/{episode}/close")
    _sql(
        database,
        "UPDATE episodes SET created_at = created_at - interval '1 day', "
        "closed_at = closed_at - interval '1 day' WHERE organization_id = $1 AND id = $2",
        capturing.org_id,
        episode,
    )
    late = _post(capturing, path, {"name": "review", "value": 2, "idempotency_key": "day-later"})
    assert late["episode_id"] == episode
    assert late["created_at"] - _get(capturing, f"/episodes/{episode}")["closed_at"] == pytest.approx(
        86400, abs=5
    )
    assert closed["closed_at"] - _get(capturing, f"/episodes/{episode}")["closed_at"] == 86400
    assert _post(capturing, path, {"name": "review", "value": 3, "idempotency_key": "day-later"}) == late
    assert _get(capturing, path)["data"] == [*posted, late]


def test_bad_rewards_are_400s_naming_the_field_and_store_nothing(capturing: Tenant) -> None:
    episode = f"bad-rewards-{_tag()}"
    _post(capturing, "/episodes", {"id": episode})
    call = _call(capturing, episode)
    sampled = len(_captured(capturing, call)["capture"]["choices"][0]["token_ids"])
    elsewhere = f"{episode}-b"
    _post(capturing, "/episodes", {"id": elsewhere})
    other_call = _call(capturing, elsewhere)
    http = _http(capturing)
    path = f"episodes/{episode}/rewards"

    def raw(text: str) -> httpx.Response:
        return http.post(path, content=text, headers={"Content-Type": "application/json"})

    # NaN and infinities as JSON's extensions write them, and numbers too large for a float.
    for text in (
        '{"name": "r", "value": NaN}',
        '{"name": "r", "value": Infinity}',
        '{"name": "r", "value": -Infinity}',
        '{"name": "r", "value": 1e400}',
    ):
        _refused(raw(text), 400, "value", "invalid_value")
    cases: list[tuple[dict[str, Any], str]] = [
        ({"name": "r", "value": "1"}, "value"),
        ({"name": "r", "value": True}, "value"),
        ({"name": "r", "value": None}, "value"),
        ({"name": "r", "value": [1]}, "value"),
        ({"name": "r", "value": 1e6 + 1}, "value"),
        ({"name": "r", "value": -1000001}, "value"),
        ({"name": "r"}, "value"),
        ({"value": 1}, "name"),
        ({"name": "", "value": 1}, "name"),
        ({"name": "n" * 65, "value": 1}, "name"),
        ({"name": "r", "value": 1, "source": "s" * 257}, "source"),
        ({"name": "r", "value": 1, "idempotency_key": "k" * 257}, "idempotency_key"),
        ({"name": "r", "value": 1, "target": {"type": "turn"}}, "target.type"),
        ({"name": "r", "value": 1, "target": {"type": "completion"}}, "target.completion_id"),
        (
            {"name": "r", "value": 1, "target": {"type": "completion", "completion_id": "nope"}},
            "target.completion_id",
        ),
        (
            {"name": "r", "value": 1, "target": {"type": "completion", "completion_id": other_call}},
            "target.completion_id",
        ),
        (
            {"name": "r", "value": 1, "target": {"type": "completion", "completion_id": call, "start": 0}},
            "target.start",
        ),
        (
            {"name": "r", "value": 1, "target": {"type": "episode", "completion_id": call}},
            "target.completion_id",
        ),
        (
            {"name": "r", "value": 1, "target": {"type": "span", "completion_id": call, "end": 1}},
            "target.start",
        ),
        (
            {"name": "r", "value": 1, "target": {"type": "span", "completion_id": call, "start": 0}},
            "target.end",
        ),
        (
            {
                "name": "r",
                "value": 1,
                "target": {"type": "span", "completion_id": call, "start": -1, "end": 1},
            },
            "target.start",
        ),
        (
            {
                "name": "r",
                "value": 1,
                "target": {"type": "span", "completion_id": call, "start": 1, "end": 1},
            },
            "target.end",
        ),
        (
            {
                "name": "r",
                "value": 1,
                "target": {"type": "span", "completion_id": call, "start": 0, "end": sampled + 1},
            },
            "target.end",
        ),
        (
            {
                "name": "r",
                "value": 1,
                "target": {"type": "span", "completion_id": other_call, "start": 0, "end": 1},
            },
            "target.completion_id",
        ),
    ]
    for body, param in cases:
        _refused(http.post(path, json=body), 400, param, "invalid_value")
    _refused(
        http.post(
            path, json={"name": "r", "value": 1, "idempotency_key": "a"}, headers={"Idempotency-Key": "b"}
        ),
        400,
        "idempotency_key",
        "invalid_value",
    )
    assert _get(capturing, f"/episodes/{episode}/rewards")["data"] == []
    assert _get(capturing, f"/episodes/{episode}")["rewards"] == []
    # The bounds themselves are fine.
    assert _post(capturing, f"/{path}", {"name": "n" * 64, "value": -1e6})["value"] == -1e6


def test_thumbs_on_a_completion(capturing: Tenant) -> None:
    episode = f"thumbs-{_tag()}"
    _post(capturing, "/episodes", {"id": episode})
    call = _call(capturing, episode)
    up = _post(capturing, f"/chat/completions/{call}/feedback", {"thumbs": "up", "comment": "right answer"})
    assert set(up) == REWARD_KEYS
    assert {k: v for k, v in up.items() if k not in ("id", "created_at")} == {
        "object": "episode.reward",
        "episode_id": episode,
        "name": "thumbs",
        "value": 1.0,
        "target": {"type": "completion", "completion_id": call},
        "source": None,
        "idempotency_key": None,
        "comment": "right answer",
    }
    down = _post(capturing, f"/chat/completions/{call}/feedback", {"thumbs": "down"})
    assert (down["value"], down["comment"], down["episode_id"]) == (-1.0, None, episode)
    assert _get(capturing, f"/episodes/{episode}")["rewards"] == [up, down]
    # With an Idempotency-Key header, thumbs count once.
    once = {"headers": {"Idempotency-Key": f"thumbs-{call}"}}
    keyed = _post(capturing, f"/chat/completions/{call}/feedback", {"thumbs": "up"}, options=once)
    assert keyed["idempotency_key"] == f"thumbs-{call}"
    assert _post(capturing, f"/chat/completions/{call}/feedback", {"thumbs": "down"}, options=once) == keyed
    assert _get(capturing, f"/episodes/{episode}")["rewards"] == [up, down, keyed]

    # A completion outside any episode (store: true) takes thumbs too, in no episode.
    stored = capturing.client.chat.completions.create(**CHAT, store=True)
    _captured(capturing, stored.id)
    lone = _post(capturing, f"/chat/completions/{stored.id}/feedback", {"thumbs": "up"})
    assert lone["episode_id"] is None and lone["target"] == {"type": "completion", "completion_id": stored.id}

    http = _http(capturing)
    for body, param in [
        ({"thumbs": "sideways"}, "thumbs"),
        ({}, "thumbs"),
        ({"thumbs": 1}, "thumbs"),
        ({"thumbs": "up", "comment": "c" * 1025}, "comment"),
    ]:
        _refused(http.post(f"chat/completions/{call}/feedback", json=body), 400, param, "invalid_value")
    assert _get(capturing, f"/episodes/{episode}")["rewards"] == [up, down, keyed]


# ------------------------------------------------------------------------------------------------- tenants
def test_another_organisations_episodes_completions_and_rewards_are_404(
    capturing: Tenant, other: Tenant, database: str
) -> None:
    episode = f"mine-{_tag()}"
    _post(capturing, "/episodes", {"id": episode, "metadata": {"owner": "me"}})
    call = _call(capturing, episode)
    reward = _post(capturing, f"/episodes/{episode}/rewards", {"name": "r", "value": 1})
    http = _http(other)
    not_episode = {"message": f"No episode found with id '{episode}'.", "param": "episode_id"}
    for method, path, body in [
        ("GET", f"episodes/{episode}", None),
        ("POST", f"episodes/{episode}/close", None),
        ("DELETE", f"episodes/{episode}", None),
        ("GET", f"episodes/{episode}/rewards", None),
        ("POST", f"episodes/{episode}/rewards", {"name": "r", "value": 1}),
        (
            "POST",
            f"episodes/{episode}/rewards",
            {"name": "r", "value": 1, "target": {"type": "completion", "completion_id": call}},
        ),
    ]:
        error = _refused(http.request(method, path, json=body), 404, "episode_id", "not_found")
        assert {k: error[k] for k in not_episode} == not_episode
    error = _refused(
        http.post(f"chat/completions/{call}/feedback", json={"thumbs": "down"}),
        404,
        "completion_id",
        "not_found",
    )
    assert error["message"] == f"No chat completion found with id '{call}'."
    assert _get(other, "/episodes", **{"metadata[owner]": "me"})["data"] == []
    assert _get(other, "/episodes", after=episode)["data"] == []
    assert _get(other, "/episodes", model=BASE)["data"] == []

    # The same id is another organisation's own episode; a reward there cannot target my completion.
    theirs = _post(other, "/episodes", {"id": episode})
    assert theirs["calls"] == 0
    _refused(
        http.post(
            f"episodes/{episode}/rewards",
            json={"name": "r", "value": 1, "target": {"type": "completion", "completion_id": call}},
        ),
        400,
        "target.completion_id",
        "invalid_value",
    )
    assert other.client.delete(f"/episodes/{episode}", cast_to=object)["deleted"] is True

    # Mine is untouched.
    mine = _get(capturing, f"/episodes/{episode}")
    assert mine["state"] == "open" and [c["id"] for c in mine["calls"]] == [call]
    assert mine["rewards"] == [reward]
    assert len(_sql(database, "SELECT 1 FROM episode_rewards WHERE id = $1", reward["id"])) == 1


def test_records_past_retention_are_not_shown(capturing: Tenant, database: str) -> None:
    episode = f"old-{_tag()}"
    _post(capturing, "/episodes", {"id": episode, "metadata": {"age": episode}})
    call = _call(capturing, episode)
    _post(capturing, f"/episodes/{episode}/rewards", {"name": "r", "value": 1})
    _sql(
        database,
        "UPDATE episodes SET expires_at = now() - interval '1 s' WHERE organization_id = $1 AND id = $2",
        capturing.org_id,
        episode,
    )
    http = _http(capturing)
    for method, path, body in [
        ("GET", f"episodes/{episode}", None),
        ("POST", f"episodes/{episode}/close", None),
        ("DELETE", f"episodes/{episode}", None),
        ("GET", f"episodes/{episode}/rewards", None),
        ("POST", f"episodes/{episode}/rewards", {"name": "r", "value": 1}),
    ]:
        _refused(http.request(method, path, json=body), 404, "episode_id", "not_found")
    assert _get(capturing, "/episodes", **{"metadata[age]": episode})["data"] == []
    # A call past its retention is no longer among its episode's calls, nor takes thumbs.
    _sql(
        database,
        "UPDATE episodes SET expires_at = NULL WHERE organization_id = $1 AND id = $2",
        capturing.org_id,
        episode,
    )
    assert [c["id"] for c in _get(capturing, f"/episodes/{episode}")["calls"]] == [call]
    _sql(
        database,
        "UPDATE captured_completions SET expires_at = now() - interval '1 s' "
        "WHERE organization_id = $1 AND id = $2",
        capturing.org_id,
        call,
    )
    shown = _get(capturing, f"/episodes/{episode}")
    assert shown["calls"] == [] and len(shown["rewards"]) == 1
    assert _get(capturing, "/episodes", **{"metadata[age]": episode})["data"][0]["calls"] == 0
    _refused(
        http.post(f"chat/completions/{call}/feedback", json={"thumbs": "up"}),
        404,
        "completion_id",
        "not_found",
    )
    # The sweep deletes what is past its retention: the call, then the episode with its rewards.
    _sql(
        database,
        "UPDATE episodes SET expires_at = now() - interval '1 s' WHERE organization_id = $1 AND id = $2",
        capturing.org_id,
        episode,
    )

    async def sweep() -> None:
        from gateway.capture import store
        from gateway.db import create_pool

        pool = await create_pool(database, max_size=1)
        try:
            await store.purge_expired(pool, most=100_000)
        finally:
            await pool.close()

    asyncio.run(sweep())
    for table, key in (
        ("episodes", "id"),
        ("episode_rewards", "episode_id"),
        ("captured_completions", "episode_id"),
    ):
        left = _sql(
            database,
            f"SELECT 1 FROM {table} WHERE organization_id = $1 AND {key} = $2",
            capturing.org_id,
            episode,
        )
        assert left == [], table


# ------------------------------------------------------------------------------------------ episode keys
def _episode_client(t: Tenant, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=str(t.client.base_url), api_key=key, max_retries=0, timeout=120)


def _episode_when(t: Tenant, episode_id: str, what: str, ready: Callable[[dict[str, Any]], bool]) -> Any:
    """`GET /v1/episodes/{id}` once it is found and `ready` holds of it."""

    def probe() -> dict[str, Any] | None:
        resp = _http(t).get(f"episodes/{episode_id}")
        got = resp.json() if resp.status_code == 200 else None
        return got if got is not None and ready(got) else None

    return eventually(probe, what)


def test_an_episode_keys_calls_are_its_calls_until_it_closes(capturing: Tenant) -> None:
    made = _post(capturing, "/episodes", {"id": f"agent-{_tag()}", "metadata": {"agent": "sdk"}})
    episode = made["id"]
    agent = _episode_client(capturing, made["key"])
    first = agent.chat.completions.create(**CHAT)
    turn = [*ASK, {"role": "assistant", "content": first.choices[0].message.content}]
    turn.append({"role": "user", "content": "And 3 + 4?"})
    second = "".join(
        c.choices[0].delta.content or ""
        for c in agent.chat.completions.create(**{**CHAT, "messages": turn}, stream=True)
        if c.choices
    )
    assert second
    got = _episode_when(capturing, episode, "two calls", lambda e: len(e["calls"]) == 2)
    calls = got["calls"]
    assert calls[0]["id"] == first.id and calls[0]["previous_id"] is None
    assert calls[0]["prompt_prefix_tokens"] == 0 and calls[0]["usage"] == first.usage.to_dict()
    # The second turn extends the first one's ids: a delta on it, no break.
    assert calls[1]["previous_id"] == first.id and calls[1]["segment_break"] is None
    assert first.usage is not None
    assert calls[1]["prompt_prefix_tokens"] == first.usage.prompt_tokens + first.usage.completion_tokens
    assert got["state"] == "open" and got["last_call_at"] >= got["created_at"]
    assert _get(capturing, "/episodes", **{"metadata[agent]": "sdk"})["data"][0]["calls"] == 2
    stored = _captured(capturing, first.id)
    assert stored["capture"]["episode_id"] == episode and stored["capture"]["api_key_id"] != capturing.key_id

    # Closed: a call into it is a 409 at once, streamed or not; rewards are still taken.
    _post(capturing, f"/episodes/{episode}/close")
    for stream in (False, True):
        with pytest.raises(openai.ConflictError) as info:
            agent.chat.completions.create(**CHAT, stream=stream)
        assert info.value.code == "episode_closed"
    raw = _http(capturing, made["key"]).post("chat/completions", json=CHAT)
    _refused(raw, 409, "episode", "episode_closed")
    assert _post(capturing, f"/episodes/{episode}/rewards", {"name": "done", "value": 1})["value"] == 1.0
    time.sleep(1.5)  # a refused call is not captured
    assert len(_get(capturing, f"/episodes/{episode}")["calls"]) == 2

    # An episode named by a header alone is made by its first call.
    named = f"named-{_tag()}"
    call = capturing.client.chat.completions.create(
        **CHAT, extra_headers={"X-Episode-Id": named, "X-Parent-Episode-Id": episode}
    )
    got = _episode_when(capturing, named, "the named episode", lambda e: len(e["calls"]) == 1)
    assert got["calls"][0]["id"] == call.id and got["parent_episode_id"] == episode
    assert (got["state"], got["idle_timeout_s"], got["on_idle"], got["metadata"]) == (
        "open",
        900,
        "abandon",
        {},
    )


AGENT = """
import sys

import openai

client = openai.OpenAI(base_url=sys.argv[1], api_key=sys.argv[2], max_retries=0)
messages = [{"role": "user", "content": "Count with me: 1, 2"}]
while True:
    text = ""
    for chunk in client.chat.completions.create(
        model=sys.argv[3], messages=messages, max_tokens=6, temperature=0, stream=True
    ):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Go on."}]
    print("turn", flush=True)
"""


def test_an_agent_killed_mid_episode_leaves_it_abandoned_with_its_calls(capturing: Tenant) -> None:
    made = _post(capturing, "/episodes", {"id": f"killed-{_tag()}", "idle_timeout_s": 2})
    episode = made["id"]
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT, str(capturing.client.base_url), made["key"], BASE],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        seen = _episode_when(capturing, episode, "two calls captured", lambda e: len(e["calls"]) >= 2)
        assert seen["state"] == "open"
    finally:
        agent.send_signal(signal.SIGKILL)
        agent.wait(timeout=30)
    assert agent.returncode == -signal.SIGKILL
    ended = _episode_when(capturing, episode, "abandoned", lambda e: e["state"] == "abandoned")
    kept = [c["id"] for c in ended["calls"]]
    assert kept[: len(seen["calls"])] == [c["id"] for c in seen["calls"]]
    assert ended["closed_at"] is None and ended["last_call_at"] is not None
    time.sleep(2.5)  # nothing more comes: it stays abandoned, with the same calls
    again = _get(capturing, f"/episodes/{episode}")
    assert again["state"] == "abandoned" and [c["id"] for c in again["calls"]] == kept
    assert [e["id"] for e in _get(capturing, "/episodes", state="abandoned", limit=100)["data"]].count(
        episode
    ) == 1
    # Rewards are taken for it as for any.
    assert _post(capturing, f"/episodes/{episode}/rewards", {"name": "partial", "value": 0.2})["value"] == 0.2
