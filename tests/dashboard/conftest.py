"""The dashboard in a real browser: Debian's chromium driven by Playwright, against the module's gateway."""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Browser, BrowserContext, Page, sync_playwright

ROOT = Path(__file__).resolve().parents[2]
SHOTS = ROOT / "docs" / "dashboard"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
RESOURCE_404 = "Failed to load resource: the server responded with a status of 404"


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    assert Path(CHROMIUM).exists(), "the dashboard tests need Debian's chromium (scripts/install adds it)"
    with sync_playwright() as p:
        launched = p.chromium.launch(executable_path=CHROMIUM)
        yield launched
        launched.close()


class Tab:
    """A browser context signed in (or not) to a gateway's dashboard, and the console errors of its pages."""

    def __init__(self, browser: Browser, base_url: str) -> None:
        self.context: BrowserContext = browser.new_context(
            base_url=base_url, viewport={"width": 1280, "height": 860}, color_scheme="light"
        )
        self.context.set_default_timeout(30_000)
        self.page: Page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"uncaught: {e}"))

    def sign_in(self, key: str) -> Page:
        self.page.goto("/dashboard/login")
        self.page.fill("#key", key)
        self.page.press("#key", "Enter")  # the keyboard is enough
        self.page.wait_for_url(re.compile(r".*/dashboard/(jobs|admin)$"))
        return self.page

    def shot(self, name: str) -> None:
        SHOTS.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(SHOTS / f"{name}.png"), full_page=True)

    def console_errors(self, allowed: tuple[str, ...] = ()) -> list[str]:
        return [e for e in self.errors if not any(e.startswith(a) for a in allowed)]


@pytest.fixture
def open_tab(browser: Browser, gw: Any) -> Iterator[Callable[[], Tab]]:
    """`open_tab()`: a new browser context on the module's gateway `gw`, closed after the test."""
    made: list[Tab] = []

    def new() -> Tab:
        made.append(Tab(browser, gw.url))
        return made[-1]

    yield new
    for tab in made:
        tab.context.close()
