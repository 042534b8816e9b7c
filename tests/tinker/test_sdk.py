"""The official `tinker` SDK against a running stack (gateway, worker, engine) on `tiny-chat`.

A training client is a LoRA adapter held by the worker's training process; these tests train it, compare its
log-probabilities with transformers + PEFT, sample from it through the chat engines, round-trip its state
and check tenancy, errors and a killed worker.
"""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import asyncpg
import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from gateway.db import create_pool
from gateway.tinker import store as tinker_store
from gateway.tinker.paths import parse_tinker_path, served_model_id, tinker_path
from tests.support.fixtures import gateway_fixture, worker_fixture
from tests.support.stack import Admin, GatewayServer, Tenant
from tests.support.tinker import datum, sampler_folder, sampler_versions

STALE_S = 4.0
BUDGET_PAUSE_S = 4
gw = gateway_fixture("tinker", own_database=True, stale_after_s=STALE_S, tinker_budget_pause_s=BUDGET_PAUSE_S)
worker = worker_fixture(
    autouse=True,
    TUNEGATE_STALE_AFTER_S=str(STALE_S),
    TUNEGATE_TRAINING_SLOTS="2",
    TUNEGATE_TINKER_IDLE_TIMEOUT_S="2",  # a finished test's model is saved and lets its slot go
)

DATA = [
    [5, 17, 42, 9, 33, 7, 61, 12],
    [8, 23, 4, 56, 19, 40, 11, 3],
]


def total_loss(out: types.ForwardBackwardOutput) -> float:
    return out.metrics["loss:sum"]


@pytest.mark.timeout(600)
def test_training_lowers_the_loss_and_forward_matches_peft(
    gw: GatewayServer, org: Tenant, service: tinker.ServiceClient
) -> None:
    caps = service.get_server_capabilities()
    assert [m.model_name for m in caps.supported_models] == ["tiny-chat"]
    tc = service.create_lora_training_client(base_model="tiny-chat", rank=4, seed=0)
    info = tc.get_info().model_data
    assert info.model_name == "tiny-chat"
    # the tokenizer a client loads is the model's directory on this one-machine stack, in the capabilities
    # too (for clients that load one by model name, as tinker-cookbook does)
    assert info.tokenizer_id == str(gw.settings.base_models["tiny-chat"].path)
    raw = httpx.get(f"{gw.url}/api/v1/get_server_capabilities", headers={"X-API-Key": "tml-" + org.key})
    assert raw.json()["supported_models"][0]["tokenizer_id"] == info.tokenizer_id
    assert tc.get_tokenizer().encode("What is 3 + 4?")
    data = [datum(t) for t in DATA]
    losses = []
    for _ in range(5):
        fb = tc.forward_backward(data, "cross_entropy")
        step = tc.optim_step(types.AdamParams(learning_rate=0.02))
        losses.append(total_loss(fb.result()))
        step.result()
    after = total_loss(tc.forward(data, "cross_entropy").result())
    assert losses[-1] < losses[0] and after < losses[0], (losses, after)

    # forward's log-probabilities are those of transformers + PEFT on the same weights
    saved = tc.save_weights_for_sampler("peft-check").result()
    adapter = sampler_folder(gw.settings.blob_dir, org.org_id, saved.path)
    out = tc.forward(data, "cross_entropy").result()
    expected = _peft_logprobs(gw.settings.base_models["tiny-chat"].path, adapter, DATA)
    for got, want in zip(out.loss_fn_outputs, expected, strict=True):
        np.testing.assert_allclose(got["logprobs"].to_numpy(), want, atol=1e-4)

    runs = service.create_rest_client().list_checkpoints(tc.model_id).result()
    assert saved.path in [c.tinker_path for c in runs.checkpoints]


def _peft_logprobs(base: Path, adapter: Path, rows: list[list[int]]) -> list[np.ndarray]:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), adapter
    )
    model.eval()
    out = []
    with torch.no_grad():
        for tokens in rows:
            logits = model(input_ids=torch.tensor([tokens[:-1]])).logits[0]
            lp = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
            out.append(lp.numpy())
    return out


@pytest.mark.timeout(600)
def test_sampler_weights_sample_and_answer_chat(
    gw: GatewayServer, org: Tenant, service: tinker.ServiceClient
) -> None:
    tc = service.create_lora_training_client(base_model="tiny-chat", rank=4, seed=1)
    tc.forward_backward([datum(t) for t in DATA], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=0.01)).result()
    sampler = tc.save_weights_and_get_sampling_client()
    res = sampler.sample(
        types.ModelInput.from_ints(DATA[0][:4]),
        num_samples=2,
        sampling_params=types.SamplingParams(max_tokens=5),
    ).result()
    assert len(res.sequences) == 2
    for seq in res.sequences:
        assert 1 <= len(seq.tokens) <= 5
        assert seq.logprobs is not None and len(seq.logprobs) == len(seq.tokens)
        assert all(lp <= 0 for lp in seq.logprobs)

    # stop token ids end a sequence at the first of them, which stays its last token
    prompt = types.ModelInput.from_ints(DATA[1][:4])
    greedy = types.SamplingParams(max_tokens=6, temperature=0.0)
    free = sampler.sample(prompt, 1, greedy).result().sequences[0].tokens
    stop = free[2]
    stopped = sampler.sample(prompt, 1, greedy.model_copy(update={"stop": [stop]})).result().sequences[0]
    assert stopped.tokens == free[: free.index(stop) + 1] and stopped.stop_reason == "stop"

    named = tc.save_weights_for_sampler("chat").result()
    model_id, _, name = parse_tinker_path(named.path) or ("", "", "")
    served = served_model_id("tiny-chat", org.org_id, model_id, name)
    reply = org.client.chat.completions.create(
        model=served, messages=[{"role": "user", "content": "1+1="}], max_tokens=4
    )
    assert reply.model == served and reply.usage is not None and reply.usage.completion_tokens > 0

    # Saved again under its name after another step: a new version in a folder of its own, served from the
    # next request on; the earlier version's files stay as they were.
    (first,) = sampler_versions(gw.settings.blob_dir, org.org_id, named.path)
    before = {p.name: p.read_bytes() for p in first.iterdir()}
    tc.forward_backward([datum(t) for t in DATA], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=0.01)).result()
    assert tc.save_weights_for_sampler("chat").result().path == named.path
    folders = sampler_versions(gw.settings.blob_dir, org.org_id, named.path)
    assert len(folders) == 2 and folders[0] == first
    assert {p.name: p.read_bytes() for p in first.iterdir()} == before
    again = org.client.chat.completions.create(
        model=served, messages=[{"role": "user", "content": "1+1="}], max_tokens=4
    )
    assert reply.system_fingerprint == first.name and again.system_fingerprint == folders[1].name


@pytest.mark.timeout(600)
def test_state_round_trips_with_the_optimizer(service: tinker.ServiceClient) -> None:
    tc = service.create_lora_training_client(base_model="tiny-chat", rank=4, seed=2)
    data = [datum(t) for t in DATA]
    adam = types.AdamParams(learning_rate=0.02)
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(adam).result()
    state = tc.save_state("after-one", ttl_seconds=7200).result().path
    listed = service.create_rest_client().list_checkpoints(tc.model_id).result().checkpoints
    expiry = {c.tinker_path: c.expires_at for c in listed}[state]
    assert expiry is not None and 7100 < expiry.timestamp() - time.time() <= 7200

    def next_step_loss(client: tinker.TrainingClient) -> float:
        client.forward_backward(data, "cross_entropy").result()
        client.optim_step(adam).result()
        return total_loss(client.forward(data, "cross_entropy").result())

    at_save = total_loss(tc.forward(data, "cross_entropy").result())
    continued = next_step_loss(tc)

    tc.load_state_with_optimizer(state).result()
    assert math.isclose(total_loss(tc.forward(data, "cross_entropy").result()), at_save, rel_tol=1e-5)
    assert math.isclose(next_step_loss(tc), continued, rel_tol=1e-4)

    # without the optimizer, Adam starts over: the same step lands elsewhere
    tc.load_state(state).result()
    assert not math.isclose(next_step_loss(tc), continued, rel_tol=1e-4)

    # a new training client from the saved state, with its optimizer
    restored = service.create_training_client_from_state_with_optimizer(state).result()
    assert math.isclose(next_step_loss(restored), continued, rel_tol=1e-4)


@pytest.mark.timeout(300)
def test_other_organisations_and_bad_requests(
    gw: GatewayServer, gw_admin: Admin, service: tinker.ServiceClient
) -> None:
    tc = service.create_lora_training_client(base_model="tiny-chat", rank=4)
    other = tinker.ServiceClient(base_url=gw.url, api_key="tml-" + gw_admin.tenant("tinker-other").key)
    with pytest.raises(tinker.NotFoundError):
        other.create_rest_client().get_training_run(tc.model_id).result()
    with pytest.raises(tinker.NotFoundError):
        other.create_rest_client().list_checkpoints(tc.model_id).result()

    with pytest.raises(tinker.BadRequestError, match="Unknown base model 'no-such-model'"):
        service.create_lora_training_client(base_model="no-such-model", rank=4).result()
    with pytest.raises(tinker.BadRequestError, match="Unknown loss function 'hinge'"):
        tc.forward_backward([datum(DATA[0])], "hinge").result()  # type: ignore[arg-type]


def test_a_lora_rank_the_engines_cannot_serve_is_refused(
    gw: GatewayServer, org: Tenant, service: tinker.ServiceClient
) -> None:
    """The SDK allows ranks up to 256, the engines serve adapters up to `engine_max_lora_rank`: a higher rank
    is a 400 naming `lora_config.rank` at create (as a job's `lora_r` is), and a new model from a checkpoint
    of such a rank (saved while the server served it) a 400 naming `path`; neither records a model. The
    largest servable rank is taken."""
    limit = gw.settings.engine_max_lora_rank
    with pytest.raises(tinker.BadRequestError, match=f"A rank of {limit + 1} is above"):
        service.create_lora_training_client(base_model="tiny-chat", rank=limit + 1).result()
    session_id = service.holder.get_session_id()
    http = httpx.Client(base_url=f"{gw.url}/api/v1", headers={"X-API-Key": "tml-" + org.key})
    body = {"session_id": session_id, "model_seq_id": 9000, "base_model": "tiny-chat"}
    refused = http.post("/create_model", json={**body, "lora_config": {"rank": 128}})
    assert refused.status_code == 400
    assert refused.json() == {
        "error": {
            "message": f"A rank of 128 is above the largest adapter rank this server serves ({limit}): the "
            "fine-tuned model could not be used. Choose a rank of at most that.",
            "type": "invalid_request_error",
            "param": "lora_config.rank",
            "code": "invalid_value",
        }
    }

    wide = asyncio.run(_checkpoint_of_rank(gw, org, session_id, 128))
    with pytest.raises(tinker.BadRequestError, match="rank 128, above the largest adapter rank"):
        service.create_training_client_from_state(wide).result()
    refused = http.post("/load_weights", json={"session_id": session_id, "model_seq_id": 9002, "path": wide})
    assert refused.status_code == 400
    assert refused.json() == {
        "error": {
            "message": f"This checkpoint's adapter has rank 128, above the largest adapter rank this server "
            f"serves ({limit}): a model made from it could not be used.",
            "type": "invalid_request_error",
            "param": "path",
            "code": "invalid_value",
        }
    }
    assert asyncio.run(_models_of(gw, session_id, 9000)) == [f"{session_id}:train:9001"]

    taken = http.post("/create_model", json={**body, "lora_config": {"rank": limit}})
    assert taken.status_code == 200, taken.text
    assert taken.json()["model_id"] == f"{session_id}:train:9000"


async def _checkpoint_of_rank(gw: GatewayServer, org: Tenant, session_id: str, rank: int) -> str:
    """A training checkpoint of a model of `rank` in the session (model 9001), as a server that served
    adapters of that rank saved it; its `tinker://` path."""
    assert gw.settings.database_url is not None
    pool = await create_pool(gw.settings.database_url, max_size=1)
    model_id = f"{session_id}:train:9001"
    try:
        await tinker_store.create_model(
            pool, model_id=model_id, org_id=org.org_id, key_id=org.key_id, session_id=session_id,
            base_model="tiny-chat", rank=rank, lora_config={"rank": rank}, metadata=None,
        )  # fmt: skip
        await tinker_store.add_checkpoint(
            pool, org_id=org.org_id, model_id=model_id, kind="training", name="wide", path="/saved/wide",
            served_model=None, with_optimizer=True, size_bytes=None, base_model="tiny-chat",
        )  # fmt: skip
    finally:
        await pool.close()
    return tinker_path(model_id, "training", "wide")


async def _models_of(gw: GatewayServer, session_id: str, from_seq: int) -> list[str]:
    """The session's models numbered `from_seq` and up."""
    assert gw.settings.database_url is not None
    conn = await asyncpg.connect(gw.settings.database_url)
    try:
        rows = await conn.fetch("SELECT id FROM tinker_models WHERE session_id = $1 ORDER BY id", session_id)
    finally:
        await conn.close()
    return [r["id"] for r in rows if int(r["id"].rsplit(":", 1)[1]) >= from_seq]


def test_a_session_records_how_its_client_finished(gw: GatewayServer, gw_admin: Admin, org: Tenant) -> None:
    with tinker.ServiceClient(base_url=gw.url, api_key="tml-" + org.key) as client:
        client.create_sampling_client(base_model="tiny-chat")  # opens the session
        session_id = client.holder.get_session_id()
    # leaving the block reported `success`; a later report does not replace it
    http = httpx.Client(base_url=f"{gw.url}/api/v1", headers={"X-API-Key": "tml-" + org.key})
    again = http.post(f"/sessions/{session_id}/finish", json={"reason": {"type": "errored"}, "detail": "x"})
    assert again.status_code == 200
    assert asyncio.run(_finish_of(gw, session_id)) == ("success", None)
    other = gw_admin.tenant("tinker-finish-other")
    refused = httpx.post(
        f"{gw.url}/api/v1/sessions/{session_id}/finish",
        json={"reason": {"type": "interrupted"}},
        headers={"X-API-Key": "tml-" + other.key},
    )
    assert refused.status_code == 404 and refused.json()["error"]["type"] == "invalid_request_error"
    assert http.post("/sessions/ts-none/finish", json={"reason": {"type": "success"}}).status_code == 404


async def _finish_of(gw: GatewayServer, session_id: str) -> tuple[str, str | None]:
    assert gw.settings.database_url is not None
    conn = await asyncpg.connect(gw.settings.database_url)
    try:
        row = await conn.fetchrow(
            "SELECT finish_reason, finish_detail FROM tinker_sessions WHERE id = $1", session_id
        )
    finally:
        await conn.close()
    return row["finish_reason"], row["finish_detail"]


def test_an_unknown_or_revoked_key_is_refused(gw: GatewayServer, gw_admin: Admin) -> None:
    with pytest.raises(tinker.AuthenticationError):
        tinker.ServiceClient(base_url=gw.url, api_key="tml-sk-tg-unknown").get_server_capabilities()
    org = gw_admin.tenant("tinker-revoked")
    works = tinker.ServiceClient(base_url=gw.url, api_key="tml-" + org.key)
    assert works.get_server_capabilities().supported_models
    gw_admin.http.delete(f"/v1/admin/api_keys/{org.key_id}").raise_for_status()
    with pytest.raises(tinker.AuthenticationError):
        tinker.ServiceClient(base_url=gw.url, api_key="tml-" + org.key).get_server_capabilities()


@pytest.mark.timeout(300)
def test_training_and_sampling_tokens_are_metered(
    gw: GatewayServer, gw_admin: Admin, service: tinker.ServiceClient
) -> None:
    org = gw_admin.tenant("tinker-metered")
    client = tinker.ServiceClient(base_url=gw.url, api_key="tml-" + org.key)
    start = int(time.time()) - 5
    tc = client.create_lora_training_client(base_model="tiny-chat", rank=4)
    tc.forward_backward([datum(t) for t in DATA], "cross_entropy").result()
    sampler = tc.save_weights_and_get_sampling_client()
    sampled = sampler.sample(
        types.ModelInput.from_ints(DATA[0][:4]),
        num_samples=2,
        sampling_params=types.SamplingParams(max_tokens=3),
    ).result()
    out_tokens = sum(len(s.tokens) for s in sampled.sequences)

    deadline = time.monotonic() + 60
    while True:
        page = httpx.get(
            f"{gw.url}/v1/organization/usage/completions",
            params={"start_time": start, "bucket_width": "1h", "group_by": "model"},
            headers={"Authorization": f"Bearer {org.key}"},
        ).json()
        by_model = {r["model"]: r for b in page["data"] for r in b["results"]}
        trained = by_model.get(f"tinker-forward_backward:{tc.model_id}")
        served = [r for m, r in by_model.items() if m.startswith("ft:tiny-chat:")]
        if (trained and served) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert trained is not None and trained["input_tokens"] == sum(len(t) - 1 for t in DATA), by_model
    assert served and served[0]["input_tokens"] == 4 and served[0]["output_tokens"] == out_tokens, by_model


@pytest.mark.timeout(300)
def test_training_tokens_are_held_to_the_budget(gw: GatewayServer, gw_admin: Admin) -> None:
    """A spent budget is the SDK's billing status (402): it holds the loop, retrying, for the server's
    `tinker_budget_pause_s`, then raises `BillingError`; a budget raised meanwhile lets the loop go on."""
    org = gw_admin.tenant("tinker-budget")
    billing = f"/v1/admin/organizations/{org.org_id}/billing"
    data = [datum(t) for t in DATA]

    def training_client() -> tinker.TrainingClient:
        client = tinker.ServiceClient(base_url=gw.url, api_key="tml-" + org.key)
        return client.create_lora_training_client(base_model="tiny-chat", rank=4)

    tc = training_client()
    assert gw_admin.http.post(billing, json={"monthly_budget_usd": 0.0}).status_code == 200
    with pytest.raises(tinker.BillingError, match="budget") as caught:
        tc.forward_backward(data, "cross_entropy").result()
    assert caught.value.status_code == 402
    assert caught.value.body["error"]["code"] == "insufficient_quota"  # type: ignore[index]

    held = training_client().forward_backward(data, "cross_entropy")  # a new client: a new incident
    time.sleep(1.0)  # the loop is held on the spent budget ...
    assert gw_admin.http.post(billing, json={"monthly_budget_usd": 100.0}).status_code == 200
    out = held.result()  # ... and goes on once it is raised
    assert out.metrics["loss:sum"] > 0
