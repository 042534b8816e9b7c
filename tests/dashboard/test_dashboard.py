"""The dashboard in Chromium against a running gateway, engine and worker: sign-in and its session, a
reinforcement job's live curves and controls, the playground on its checkpoint and model, usage, the admin
page, and another organisation's job. One short job serves the whole module. The tests also write the
screenshots of docs/dashboard.md."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import httpx
import openai
import pytest
from playwright.sync_api import expect

from envsdk.archive import pack
from tests.dashboard.conftest import RESOURCE_404, ROOT, Tab
from tests.support.data import SAYS_YES, SFT
from tests.support.fixtures import gateway_fixture, worker_fixture
from tests.support.jobs import metrics, rl_job, upload_rows, wait_for
from tests.support.stack import Admin, GatewayServer, Tenant

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

gw = gateway_fixture("dashboard", own_database=True)
worker = worker_fixture(autouse=True, TUNEGATE_HEARTBEAT_INTERVAL_S="0.5")
OpenTab = Callable[[], Tab]
ARITHMETIC = ROOT / "examples" / "envs" / "arithmetic"


@pytest.fixture(scope="module")
def org(gw_admin: Admin) -> Tenant:
    return gw_admin.tenant("dash-org")


STEPS = 30


@pytest.fixture(scope="module")
def job(org: Tenant) -> Any:
    """A reinforcement job of thirty steps, checkpointed every four: long enough to watch, and still running
    when the pause test clicks on a busy machine or an idle one."""
    return rl_job(org, steps=STEPS, checkpoint_every=4, suffix="dash")


def plotted(page: Any, title: str) -> dict[str, Any]:
    """The data the chart `title` draws: uPlot's own arrays, by series label."""
    got: dict[str, Any] = page.evaluate(
        """title => {
          const fig = [...document.querySelectorAll('figure.chart')]
            .find(f => f.querySelector('figcaption').textContent === title);
          if (!fig) return null;
          const u = fig.uplot;
          return Object.fromEntries(u.series.map((s, i) => [i === 0 ? 'step' : s.label, u.data[i]]));
        }""",
        title,
    )
    return got or {}


def wait_points(page: Any, enough: Callable[[int], bool], timeout: float = 180) -> int:
    """Wait until the number of steps the job page has plotted is `enough`; returns it."""
    deadline = time.monotonic() + timeout
    while True:
        points = int(page.locator("#curves").get_attribute("data-points") or 0)
        if enough(points):
            return points
        assert time.monotonic() < deadline, f"the page plotted {points} steps"
        page.wait_for_timeout(300)


def test_sign_in_session_and_csrf(gw: GatewayServer, org: Tenant, job: Any, open_tab: OpenTab) -> None:
    tab = open_tab()
    page = tab.page
    page.goto("/dashboard/jobs")
    assert page.url.endswith("/dashboard/login")  # not signed in
    page.fill("#key", "sk-tg-not-a-key")
    page.click("#sign-in button[type=submit]")
    page.locator("#error", has_text="Incorrect API key provided").wait_for()
    tab.errors.clear()  # the refused sign-in's 401 is logged by the browser

    tab.sign_in(org.key)
    page.locator(f"a[href='/dashboard/jobs/{job.id}']").wait_for()
    assert job.id in page.locator("#app").inner_text()
    (cookie,) = tab.context.cookies()
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and org.key not in cookie["value"]
    assert page.evaluate("document.cookie") == ""  # out of scripts' reach
    assert page.evaluate("JSON.stringify(localStorage) + JSON.stringify(sessionStorage)") == "{}{}"
    tab.shot("jobs")

    # The browser's calls go through the session; a change without the CSRF header is refused.
    jar = {cookie["name"]: cookie["value"]}
    with httpx.Client(base_url=gw.url, cookies=jar) as http:
        listed = http.get("/dashboard/api/v1/fine_tuning/jobs")
        assert listed.status_code == 200 and [j["id"] for j in listed.json()["data"]] == [job.id]
        refused = http.post(f"/dashboard/api/v1/fine_tuning/jobs/{job.id}/pause")
        assert refused.status_code == 403 and refused.json()["error"]["code"] == "invalid_csrf_token"
        assert org.client.fine_tuning.jobs.retrieve(job.id).status != "paused"
        # A session's cookie works only for the dashboard's own paths.
        assert http.get("/v1/fine_tuning/jobs").status_code == 401
    assert tab.console_errors() == []

    # Signing out ends the session: the old cookie no longer works.
    page.click("#sign-out")
    page.wait_for_url("**/dashboard/login")
    with httpx.Client(base_url=gw.url, cookies=jar) as http:
        ended = http.get("/dashboard/api/v1/fine_tuning/jobs")
    assert ended.status_code == 401 and ended.json()["error"]["code"] == "no_dashboard_session"


def test_curves_grow_with_the_metrics_events(org: Tenant, job: Any, open_tab: OpenTab) -> None:
    tab = open_tab()
    page = tab.sign_in(org.key)
    page.goto(f"/dashboard/jobs/{job.id}")
    first = wait_points(page, lambda n: n >= 2)
    wait_points(page, lambda n: n > first)
    shown = plotted(page, "Reward")
    assert len(shown["step"]) > first  # the curve grew while the page stayed open
    # Every plotted point is a metrics event of the job, as the API returns it, in step order.
    events = {m["step"]: m for m in metrics(org, job.id)}
    assert shown["step"] == sorted(shown["step"]) and set(shown["step"]) <= set(events)
    assert shown["reward_mean"] == [events[s]["reward_mean"] for s in shown["step"]]
    loss = plotted(page, "Loss")
    assert loss["train_loss"] == [events[s].get("train_loss") for s in loss["step"]]
    tab.shot("job")
    # Half a laptop's screen: nothing runs off the side. And the same page in dark colours.
    page.set_viewport_size({"width": 640, "height": 900})
    page.wait_for_timeout(300)
    assert page.evaluate("document.documentElement.scrollWidth") <= 640
    page.emulate_media(color_scheme="dark")
    page.reload()
    wait_points(page, lambda n: n >= 2)
    tab.shot("job-dark")
    assert tab.console_errors() == []


def test_pause_and_resume_from_the_page(org: Tenant, open_tab: OpenTab) -> None:
    # A job of its own, opened as soon as it runs (the module's job may be done by now on a fast machine). A
    # running job's trainer takes seconds to start, far longer than the click.
    job = rl_job(org, steps=STEPS, checkpoint_every=4, suffix="pause")
    deadline = time.monotonic() + 600
    while (status := org.client.fine_tuning.jobs.retrieve(job.id).status) != "running":
        assert status in ("validating_files", "queued") and time.monotonic() < deadline, status
        time.sleep(0.2)
    tab = open_tab()
    page = tab.sign_in(org.key)
    page.goto(f"/dashboard/jobs/{job.id}")
    page.click("#pause-job")
    page.locator("#job-status", has_text="paused").wait_for()
    assert org.client.fine_tuning.jobs.retrieve(job.id).status == "paused"
    page.click("#resume-job")
    page.locator("#pause-job").wait_for()  # queued or running again
    assert org.client.fine_tuning.jobs.retrieve(job.id).status in ("queued", "running", "succeeded")
    done = wait_for(org, job.id, timeout=600)
    assert done.status == "succeeded", done.error
    page.locator("#job-status", has_text="succeeded").wait_for()
    assert [m["step"] for m in metrics(org, job.id)] == list(range(1, STEPS + 1))
    assert tab.console_errors() == []


def _answer(page: Any, pane: int) -> str:
    answer = page.locator(f"#chat-{pane} .assistant[data-done='true']").last
    answer.wait_for(timeout=120_000)
    assert "bad" not in (answer.get_attribute("class") or "")
    return str(answer.inner_text())


def test_chat_with_a_checkpoint(org: Tenant, job: Any, open_tab: OpenTab) -> None:
    tab = open_tab()
    page = tab.sign_in(org.key)
    page.goto(f"/dashboard/jobs/{job.id}")
    link = page.locator("a.chat-link").first
    model = unquote((link.get_attribute("href") or "").split("model=")[1])
    assert ":ckpt-step-" in model
    link.click()
    page.wait_for_url("**/dashboard/playground?model=*")
    assert ":ckpt-step-" in page.locator("#model-0").input_value()
    page.fill("#prompt", "Say yes.")
    page.press("#prompt", "Control+Enter")
    assert _answer(page, 0).strip()
    assert tab.console_errors() == []


def test_base_and_fine_tuned_side_by_side(org: Tenant, job: Any, open_tab: OpenTab) -> None:
    tuned = org.client.fine_tuning.jobs.retrieve(job.id).fine_tuned_model
    tab = open_tab()
    page = tab.sign_in(org.key)
    page.goto(f"/dashboard/jobs/{job.id}")
    page.click(f"a[href^='/dashboard/playground?model=']:has-text('{tuned}')")
    page.wait_for_url("**compare=tiny-chat")
    assert page.locator("#model-0").input_value() == tuned
    assert page.locator("#model-1").input_value() == "tiny-chat"
    page.fill("#max-tokens", "12")
    page.fill("#temperature", "0")
    page.fill("#prompt", "Is the sky blue?")
    page.click("#send")
    assert _answer(page, 0).strip() and _answer(page, 1).strip()
    tab.shot("playground")
    assert tab.console_errors() == []


def test_usage_shows_the_jobs_cost(org: Tenant, job: Any, open_tab: OpenTab) -> None:
    cost = org.client.fine_tuning.jobs.retrieve(job.id).usage["cost_usd"]  # type: ignore[attr-defined]
    assert cost > 0
    tab = open_tab()
    page = tab.sign_in(org.key)
    page.goto("/dashboard/usage")
    row = page.locator("#job-costs tr", has_text=job.id)
    row.wait_for()
    assert f"${cost:.4f}" in row.inner_text()
    page.locator("figure.chart").first.wait_for()
    tab.shot("usage")
    assert tab.console_errors() == []


COST_FIELDS = {"job-cost-accrued": "accrued", "job-cost-projected": "projected_total"}


def _shown_costs(page: Any) -> dict[str, tuple[str, float | None]]:
    """Each cost the job page shows: its text, and the number it was made from (`data-usd`)."""
    got: dict[str, tuple[str, float | None]] = {}
    for dd in page.locator("dd[id^='job-cost-']").all():
        raw = dd.get_attribute("data-usd")
        got[str(dd.get_attribute("id"))] = (dd.inner_text().strip(), None if raw is None else float(raw))
    return got


def _api_costs(org: Tenant, job_id: str) -> dict[str, tuple[str, float | None]]:
    """The same costs from the API's job, as the page should show them."""
    extra = org.client.fine_tuning.jobs.retrieve(job_id).model_extra or {}
    values = {
        **{k: extra["cost"][name] for k, name in COST_FIELDS.items()},
        "job-cost-estimated": extra.get("estimated_cost"),
    }
    if "max_cost" in extra:
        values["job-cost-max"] = extra["max_cost"]
    return {k: ("—" if v is None else f"${v:.4f}", v) for k, v in values.items()}


def test_the_job_page_shows_the_jobs_cost(org: Tenant, job: Any, open_tab: OpenTab) -> None:
    done = wait_for(org, job.id, timeout=600)  # its cost moves no more
    assert done.status == "succeeded", done.error
    tab = open_tab()
    page = tab.sign_in(org.key)
    page.goto(f"/dashboard/jobs/{job.id}")
    page.locator("#job-status", has_text="succeeded").wait_for()
    shown, api = _shown_costs(page), _api_costs(org, job.id)
    assert shown == api and set(shown) == {"job-cost-accrued", "job-cost-projected", "job-cost-estimated"}
    accrued = api["job-cost-accrued"][1]
    assert accrued is not None and accrued > 0 and api["job-cost-projected"][1] == accrued  # ended: all spent
    assert (api["job-cost-estimated"][1] or 0) > 0  # estimated when it was queued

    # A job with a max_cost, paused as soon as it is made: its cost against the limit, as the API has it.
    capped = org.client.fine_tuning.jobs.create(
        model="tiny-chat", training_file=upload_rows(org, SFT), suffix="capped", extra_body={"max_cost": 0.25}
    )
    org.client.fine_tuning.jobs.pause(capped.id)
    wait_for(org, capped.id, ("paused",))
    page.goto(f"/dashboard/jobs/{capped.id}")
    page.locator("#job-status", has_text="paused").wait_for()
    deadline = time.monotonic() + 60
    while (shown := _shown_costs(page)) != (api := _api_costs(org, capped.id)):  # the page polls every 1.5 s
        assert time.monotonic() < deadline, (shown, api)
        page.wait_for_timeout(300)
    assert shown["job-cost-max"] == ("$0.2500", 0.25)
    bar = page.locator("#job-cost-max progress")
    assert float(bar.get_attribute("max") or 0) == 0.25
    assert float(bar.get_attribute("value") or -1) == min(api["job-cost-accrued"][1] or 0, 0.25)
    assert tab.console_errors() == []
    org.client.fine_tuning.jobs.cancel(capped.id)


def test_files_and_an_environment_tested_from_the_page(
    org: Tenant, open_tab: OpenTab, tmp_path: Path
) -> None:
    archive, _ = pack(ARITHMETIC, tmp_path / "arithmetic.tar.gz")
    env = org.client.files.create(file=(archive.name, archive.read_bytes()), purpose="environment")
    rows = [json.loads(line) for line in (ARITHMETIC / "tasks.jsonl").read_text().splitlines()[:3]]
    tasks = upload_rows(org, rows, name="tasks.jsonl")
    tab = open_tab()
    page = tab.sign_in(org.key)
    page.goto("/dashboard/files")
    row = page.locator("#app tr", has_text=env.id)
    assert "environment" in row.inner_text() and tasks in page.locator("#app").inner_text()
    row.locator("button", has_text="Open").click()
    page.locator("#manifest", has_text="arithmetic_env:ArithmeticEnv").wait_for()
    page.select_option("#task-file", tasks)
    expect(page.locator("#tasks")).to_have_value(re.compile("What is 9 \\+ 3"))
    page.select_option("#env-model", "tiny-chat")
    page.click("#test-env")
    rewards = page.locator("#env-results tbody tr")
    rewards.nth(2).wait_for(timeout=120_000)
    assert rewards.count() == 3
    for i in range(3):  # each task's reward, as environments/run scored it
        assert 0.0 <= float(rewards.nth(i).locator("td").nth(1).inner_text()) <= 1.0
    tab.shot("files")
    assert tab.console_errors() == []


def test_evals_show_runs_and_pass_rates(org: Tenant, open_tab: OpenTab) -> None:
    ev = org.client.evals.create(
        name="says yes",
        data_source_config={
            "type": "custom",
            "item_schema": {"type": "object", "properties": {"question": {"type": "string"}}},
            "include_sample_schema": True,
        },
        testing_criteria=[SAYS_YES],
    )
    items = [{"item": {"question": q}} for q in ("Is the sky blue?", "Say yes.", "Is water wet?")]
    run = org.client.evals.runs.create(
        ev.id,
        name="base",
        data_source={
            "type": "completions",
            "model": "tiny-chat",
            "source": {"type": "file_content", "content": items},
            "input_messages": {
                "type": "template",
                "template": [{"role": "user", "content": "{{ item.question }}"}],
            },
            "sampling_params": {"temperature": 0, "max_completion_tokens": 8},
        },
    )
    deadline = time.monotonic() + 180
    while (done := org.client.evals.runs.retrieve(run.id, eval_id=ev.id)).status not in (
        "completed",
        "failed",
    ):
        assert time.monotonic() < deadline, done.status
        time.sleep(0.3)
    assert done.status == "completed", done.error
    counts = done.result_counts
    tab = open_tab()
    page = tab.sign_in(org.key)
    page.goto("/dashboard/evals")
    row = page.locator("#app tr", has_text="completed")
    row.wait_for()
    assert f"{100 * counts.passed / counts.total:.1f} %" in row.inner_text()
    assert f"{counts.passed} / {counts.failed} / {counts.errored}" in row.inner_text()
    assert tab.console_errors() == []


def test_another_organisations_job_is_not_found(
    gw: GatewayServer, gw_admin: Admin, job: Any, open_tab: OpenTab
) -> None:
    other = gw_admin.tenant("dash-other")
    tab = open_tab()
    page = tab.sign_in(other.key)
    page.locator("#app", has_text="No fine-tuning jobs yet").wait_for()
    page.goto(f"/dashboard/jobs/{job.id}")
    page.locator("#error", has_text="Not found").wait_for()
    assert "Not found: No fine-tuning job found" in page.locator("#error").inner_text()
    assert page.locator("figure.chart").count() == 0
    jar = {c["name"]: c["value"] for c in tab.context.cookies()}
    with httpx.Client(base_url=gw.url, cookies=jar) as http:  # the routes behind the page say the same
        for path in (
            f"/dashboard/data/jobs/{job.id}/metrics",
            f"/dashboard/api/v1/fine_tuning/jobs/{job.id}/events",
        ):
            answer = http.get(path)
            assert (
                answer.status_code == 404 and "No fine-tuning job found" in answer.json()["error"]["message"]
            )
    assert tab.console_errors(allowed=(RESOURCE_404,)) == []


def test_admin_creates_and_revokes_a_key(
    gw: GatewayServer, gw_admin: Admin, org: Tenant, open_tab: OpenTab
) -> None:
    tab = open_tab()
    page = tab.sign_in(gw_admin.http.headers["Authorization"].split(" ", 1)[1])
    page.goto("/dashboard/admin")
    page.select_option("#org", org.org_id)
    page.fill("#new-key-name", "from-the-dashboard")
    tab.shot("admin")
    page.click("#create-key")
    key = page.locator(".key-once").inner_text().strip()
    assert key.startswith("sk-tg-")
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0)
    assert client.models.list().data

    # A session of that key, open before the revocation, ends at its next request.
    holder = open_tab()
    holder.sign_in(key)
    row = page.locator("#keys tr", has_text="from-the-dashboard")
    page.once("dialog", lambda d: d.accept())
    row.locator("button", has_text="Revoke").click()
    row.locator("text=revoked").wait_for()
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    holder.page.goto("/dashboard/jobs")
    assert holder.page.url.endswith("/dashboard/login")
    assert tab.console_errors() == [] and holder.console_errors() == []
