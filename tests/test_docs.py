"""The docs stay true to the code: every setting documented (and nothing else), every route in api.md,
and every relative link pointing at a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

from gateway.app import create_app
from gateway.settings import Settings
from tunegate.settings_doc import env_name, field_docs, settings_markdown

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def test_every_setting_has_a_docstring() -> None:
    docs = field_docs()
    missing = [name for name in Settings.model_fields if not docs.get(name)]
    assert missing == [], f"settings without a docstring under them: {missing}"


def test_settings_page_lists_exactly_the_settings() -> None:
    page = (DOCS / "settings.md").read_text()
    documented = set(re.findall(r"^\| `(TUNEGATE_[A-Z0-9_]+)` \|", page, flags=re.M))
    expected = {env_name(name) for name in Settings.model_fields}
    regenerate = "regenerate it: python -m tunegate docs-settings > docs/settings.md"
    assert documented - expected == set(), f"documented but not in Settings ({regenerate})"
    assert expected - documented == set(), f"in Settings but not documented ({regenerate})"


def test_settings_page_generator_covers_every_field() -> None:
    text = settings_markdown()
    for name in Settings.model_fields:
        assert f"| `{env_name(name)}` |" in text


def test_every_route_is_in_api_md(tmp_path: Path) -> None:
    app = create_app(Settings(data_dir=tmp_path))
    page = (DOCS / "api.md").read_text()
    routes = [
        (method.upper(), path)
        for path, ops in app.openapi()["paths"].items()
        for method in ops
        if method != "head"
    ]
    assert len(routes) > 20
    missing = [f"{m} {p}" for m, p in routes if f"`{m} {p}`" not in page]
    assert missing == [], f"routes missing from docs/api.md: {missing}"


def test_relative_links_resolve() -> None:
    pages = [ROOT / "README.md", *DOCS.glob("*.md")]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert broken == []


def test_every_hyperparameter_is_in_training_md() -> None:
    from trainer.contract import HYPERPARAMETERS

    page = (DOCS / "training.md").read_text()
    names = {name for model in HYPERPARAMETERS.values() for name in model.model_fields}
    missing = sorted(name for name in names if f"`{name}`" not in page)
    assert missing == [], f"hyperparameters missing from docs/training.md: {missing}"
