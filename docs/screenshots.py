"""Regenerate the web page screenshots in docs/img/ from a live server on the demo index.

    python docs/screenshots.py [--index runs/demo/index] [--out docs/img]

Needs Debian's chromium (/usr/bin/chromium) and the playwright package (the `dev` extra).
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from playwright.sync_api import Page, sync_playwright

REPO = Path(__file__).resolve().parents[1]
PROMPT = "The king of France"
AUDIT = [{"id": "king", "prompt": PROMPT, "max_new_tokens": 8},
         {"id": "computer", "prompt": "A computer is", "completion": " a machine that does what you tell it"},
         {"id": "love", "prompt": "Love is", "max_new_tokens": 8},
         {"id": "cat", "prompt": "The cat sat on", "max_new_tokens": 6}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit("the server did not become ready")


def attribute(page: Page, url: str) -> None:
    page.goto(url + "/#/attribute")
    page.fill("#attr-prompt", PROMPT)
    page.fill("#attr-new", "8")
    page.get_by_role("button", name="Attribute", exact=True).click()
    page.locator("#docs-panel .doc").first.wait_for()
    page.locator("#tokens button.tok").nth(1).click()
    page.locator("#docs-panel").get_by_role("heading", name="Top documents for token 2").wait_for()
    page.locator("#docs-panel .doc").first.wait_for()


def shoot(page: Page, path: Path, full: bool = True) -> None:
    page.evaluate("document.activeElement && document.activeElement.blur()")
    page.evaluate("window.scrollTo(0, 0)")
    page.screenshot(path=str(path), full_page=full)
    print(f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}: {path.stat().st_size // 1024} KB")


def take(url: str, out: Path) -> None:
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.set_default_timeout(120_000)

        attribute(page, url)
        shoot(page, out / "attribute.png")

        proto = page.locator("#token-panel a.proto").first.inner_text().split()[-1]
        page.goto(f"{url}/#/prototype/{proto}")
        page.locator(".contexts mark.active").first.wait_for()
        shoot(page, out / "prototype.png")

        page.goto(url + "/#/attribute")
        page.locator("#suppress-output").click()
        page.get_by_role("button", name="Compare").click()
        page.locator("#verdict").wait_for()
        shoot(page, out / "generate.png")

        page.goto(url + "/#/audits")
        page.fill("#audit-jsonl", "\n".join(json.dumps(i) for i in AUDIT))
        page.get_by_role("button", name="Start audit").click()
        page.locator("#audit-status[data-status='completed']").wait_for()
        shoot(page, out / "audits.png")

        page.goto(url + "/#/sql")
        page.get_by_role("button", name="Most used prototypes").click()
        page.locator("#sql-out tbody tr").first.wait_for()
        shoot(page, out / "sql.png")

        page.fill("#sql-box", "COPY documents TO '/tmp/documents.csv'")
        page.get_by_role("button", name="Run").click()
        page.locator("#sql-out [role=alert]").wait_for()
        shoot(page, out / "sql-error.png", full=False)

        page.set_viewport_size({"width": 390, "height": 844})
        attribute(page, url)
        page.locator("#token-panel").scroll_into_view_if_needed()
        page.evaluate("document.activeElement && document.activeElement.blur()")
        page.screenshot(path=str(out / "attribute-narrow.png"))
        print(f"{out / 'attribute-narrow.png'}: {(out / 'attribute-narrow.png').stat().st_size // 1024} KB")
        browser.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--index", default=str(REPO / "runs/demo/index"))
    ap.add_argument("--out", default=str(REPO / "docs/img"))
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as state:
        proc = subprocess.Popen([sys.executable, "-m", "prism_tda.cli", "--log-level", "warning", "serve",
                                 "--index", f"demo={args.index}", "--port", str(port), "--state-dir", state])
        try:
            wait_ready(url, proc)
            take(url, out)
        finally:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
