"""Dashboard pages, sign-in and sign-out, and the job page's metrics; `install` adds it all to the app."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Cookie, FastAPI, Header, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from gateway.dashboard import sessions, store
from gateway.dashboard.proxy import PREFIX, api_proxy
from gateway.deps import ResourcesDep
from gateway.errors import PermissionDenied, not_found
from gateway.limits import service as limits_service
from gateway.limits.protocol import OrgLimits
from gateway.protocol import OpenAIBaseModel

HERE = Path(__file__).resolve().parent
templates = Jinja2Templates(directory=HERE / "templates")
router = APIRouter(prefix="/dashboard", include_in_schema=False)
CookieDep = Annotated[str | None, Cookie(alias=sessions.COOKIE)]

PAGES = {
    "jobs": "Fine-tuning jobs",
    "playground": "Playground",
    "files": "Files and environments",
    "models": "Models and aliases",
    "usage": "Usage and costs",
    "evals": "Evals",
    "admin": "Administration",
}
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; "
        "frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
    ),
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}
ADMIN_PAGES = ("admin",)
"""What the admin key sees besides usage (any organisation's); the other pages are an organisation's."""
MAX_POINTS = 2000
"""A curve is drawn from at most this many points; a longer job's metrics are thinned evenly."""


def install(app: FastAPI) -> None:
    """The dashboard's routes, its static files and its way into the API."""
    app.include_router(router)
    app.mount("/dashboard/static", StaticFiles(directory=HERE / "static"), name="dashboard-static")
    app.mount(PREFIX, api_proxy)


def _page(request: Request, template: str, session: sessions.Session | None, **context: Any) -> Response:
    return templates.TemplateResponse(
        request,
        template,
        {"session": session, "pages": PAGES, "admin_pages": ADMIN_PAGES, **context},
        headers=SECURITY_HEADERS,
    )


@router.get("/login")
async def login_page(request: Request) -> Response:
    return _page(request, "login.html", None, page="login", title="Sign in")


class SignIn(OpenAIBaseModel):
    key: str


@router.post("/session")
async def create_session(body: SignIn, request: Request, res: ResourcesDep) -> Response:
    """Sign in: the key is checked and a session cookie set (HttpOnly, SameSite=Strict)."""
    cookie, _ = await sessions.sign_in(res, body.key)
    response = Response(status_code=204)
    response.set_cookie(
        sessions.COOKIE,
        cookie,
        max_age=int(sessions.TTL_S),
        path="/dashboard",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return response


@router.delete("/session")
async def delete_session(
    res: ResourcesDep,
    cookie: CookieDep = None,
    csrf: Annotated[str | None, Header(alias=sessions.CSRF_HEADER)] = None,
) -> Response:
    """Sign out: the session row goes, and so does the cookie."""
    session = await sessions.require(res, cookie)
    sessions.check_csrf(session, csrf)
    await sessions.sign_out(res, cookie)
    response = Response(status_code=204)
    response.delete_cookie(sessions.COOKIE, path="/dashboard")
    return response


class Curves(OpenAIBaseModel):
    """A job's metrics as columns: `steps` and one list per metric (null where a step lacks it)."""

    object: str = "dashboard.job.metrics"
    cursor: int
    """Pass as `after` to get only what came since."""
    count: int
    """Metrics events read (before thinning)."""
    stride: int
    total_steps: int | None
    steps: list[float | None]
    series: dict[str, list[float | None]]


@router.get("/data/jobs/{job_id}/metrics")
async def job_metrics(
    job_id: str,
    res: ResourcesDep,
    cookie: CookieDep = None,
    after: Annotated[int, Query(ge=0)] = 0,
    points: Annotated[int, Query(ge=10, le=10_000)] = MAX_POINTS,
) -> Curves:
    """The job page's curves: the job's metrics events after the cursor `after`, as columns."""
    session = await sessions.require(res, cookie)
    org = session.organization_id
    if org is None:
        raise PermissionDenied("Sign in with an organisation's key to see its jobs.")
    async with res.pool.acquire() as conn:
        if not await store.job_exists(conn, org_id=org, job_id=job_id):
            raise not_found("fine-tuning job", job_id, param="job_id")
        kept, count, stride, cursor = await store.job_metrics(
            conn, org_id=org, job_id=job_id, after_seq=after, points=points
        )
    numeric = {k for r in kept for k, v in r.items() if isinstance(v, int | float)}
    names = sorted(numeric - {"step", "total_steps"})
    return Curves(
        cursor=cursor,
        count=count,
        stride=stride,
        total_steps=kept[-1].get("total_steps") if kept else None,
        steps=[r.get("step") for r in kept],
        series={n: [v if isinstance(v := r.get(n), int | float) else None for r in kept] for n in names},
    )


@router.get("")
async def home(res: ResourcesDep, cookie: CookieDep = None) -> Response:
    """The first page: jobs for an organisation, administration for the admin key."""
    session = await sessions.lookup(res, cookie)
    where = "login" if session is None else "admin" if session.is_admin else "jobs"
    return RedirectResponse(f"/dashboard/{where}", status_code=303)


async def _signed_in(res: ResourcesDep, cookie: str | None) -> sessions.Session | Response:
    """The session, or the way to the sign-in page."""
    session = await sessions.lookup(res, cookie)
    if session is None:
        return RedirectResponse("/dashboard/login", status_code=303)
    return session


@router.get("/jobs/{job_id}", response_class=HTMLResponse)
async def job_page(job_id: str, request: Request, res: ResourcesDep, cookie: CookieDep = None) -> Response:
    session = await _signed_in(res, cookie)
    if isinstance(session, Response):
        return session
    return _page(request, "page.html", session, page="job", title="Job", job_id=job_id)


@router.get("/{page}", response_class=HTMLResponse)
async def page(page: str, request: Request, res: ResourcesDep, cookie: CookieDep = None) -> Response:
    if page not in PAGES:
        raise not_found("dashboard page", page)
    session = await _signed_in(res, cookie)
    if isinstance(session, Response):
        return session
    return _page(request, "page.html", session, page=page, title=PAGES[page])


@router.get("/data/limits")
async def own_limits(res: ResourcesDep, cookie: CookieDep = None) -> OrgLimits:
    """The signed-in organisation's own rate limits, budget and month-to-date spend (the usage page): the
    admin API shows them to the admin key only."""
    session = await sessions.require(res, cookie)
    if session.organization_id is None:
        raise PermissionDenied("The admin key reads limits through the admin page.")
    return await limits_service.get_limits(res, session.organization_id)
