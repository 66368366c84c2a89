"""A live server over the tiny session index and headless Chromium (Debian's) driven by Playwright."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.service.conftest import Live, service_settings, serving

CHROMIUM = Path("/usr/bin/chromium")


def launch(playwright):
    return playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])


@pytest.fixture(scope="session")
def browser() -> Iterator[object]:
    sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")
    if not CHROMIUM.exists() or shutil.which(str(CHROMIUM)) is None:
        pytest.skip(f"{CHROMIUM} is missing (apt-get install chromium)")
    with sync_api.sync_playwright() as p:
        b = launch(p)
        yield b
        b.close()


@pytest.fixture(scope="session")
def web_live(index, tmp_path_factory) -> Iterator[Live]:
    with serving(service_settings(index, tmp_path_factory.mktemp("web-state"))) as live:
        yield live


@pytest.fixture
def page(browser, web_live) -> Iterator[object]:
    """A fresh page (own sessionStorage and localStorage) that fails the test on any script error."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    pg = context.new_page()
    pg.set_default_timeout(30_000)
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    yield pg
    context.close()
    assert not errors, errors
