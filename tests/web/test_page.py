"""The web page in headless Chromium against a live server on the tiny index."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.service.conftest import service_settings, serving

pytestmark = pytest.mark.slow  # the browser: the slow tier

PROMPT = "The man said that"


def attribute(page, url: str, prompt: str = PROMPT, n_new: int = 6) -> None:
    page.goto(url + "/#/attribute")
    page.fill("#attr-prompt", prompt)
    page.fill("#attr-new", str(n_new))
    page.get_by_role("button", name="Attribute", exact=True).click()
    page.wait_for_selector("#tokens button.tok")


def numbers(page, selector: str) -> list[float]:
    return [float(t) for t in page.locator(selector).all_inner_texts()]


def test_page_is_served_outside_the_api(web_live):
    r = httpx.get(web_live.url + "/")
    assert r.status_code == 200 and "<main" in r.text
    assert "default-src 'self'" in r.headers["content-security-policy"]
    for asset in re.findall(r'(?:src|href)="(/static/[^"]+)"', r.text):
        assert httpx.get(web_live.url + asset).status_code == 200, asset
    assert "/" not in httpx.get(web_live.url + "/openapi.json").json()["paths"]


def test_prompt_gives_highlighted_documents_and_slices_add_up(page, web_live):
    attribute(page, web_live.url)
    docs = page.locator("#docs-panel .doc")
    docs.first.wait_for()
    assert page.locator("#docs-panel").get_by_role("heading").inner_text() == "Top documents for the whole output"
    marks = page.locator("#docs-panel .doc .snippet mark")
    assert marks.count() > 0 and all(t for t in marks.all_inner_texts())
    assert all(0 <= float(s) <= 1 for s in page.locator("#docs-panel .score b").all_inner_texts())
    values = page.locator("#docs-panel .doc .doc-head span.muted", has_text=re.compile(r"^value ")).all_inner_texts()
    assert len(values) == docs.count() and all(re.fullmatch(r"value -?[0-9]+\.[0-9]", v.strip()) for v in values)

    n_tokens = page.locator("#tokens button.tok").count()
    assert n_tokens == 6
    for i in (0, n_tokens - 1):
        page.locator("#tokens button.tok").nth(i).click()
        panel = page.locator("#token-panel")
        panel.get_by_role("heading", name=f"Token {i + 1} of {n_tokens}").wait_for()
        logit = float(panel.locator(".logit").inner_text())
        parts = numbers(page, "#token-panel td.contribution")  # every prototype, then the residual
        assert len(parts) >= 2
        # each number is shown rounded to 3 decimals
        assert abs(sum(parts) - logit) <= 0.0005 * (len(parts) + 1) + 1e-9, (parts, logit)
        assert float(panel.locator("td.total").inner_text()) == logit
        assert float(panel.locator(".residual").inner_text()) == parts[-1]
        assert panel.locator(".slices .slice").count() == len(parts)
        assert page.locator(f"#tokens button.tok[data-index='{i}']").get_attribute("aria-pressed") == "true"
        heading = page.locator("#docs-panel").get_by_role("heading", name=f"Top documents for token {i + 1}")
        heading.wait_for()
        page.locator("#docs-panel .doc").first.wait_for()

    # keyboard: a token is a real button; Enter opens it
    page.locator("#tokens button.tok").nth(1).focus()
    page.keyboard.press("Enter")
    page.locator("#token-panel").get_by_role("heading", name=f"Token 2 of {n_tokens}").wait_for()
    page.get_by_role("button", name="whole output").click()
    page.locator("#docs-panel").get_by_role("heading", name="Top documents for the whole output").wait_for()


def test_prototype_page_opens(page, web_live):
    attribute(page, web_live.url)
    page.locator("#tokens button.tok").first.click()
    link = page.locator("#token-panel a.proto").first
    proto = int(link.inner_text().split()[-1])
    link.click()
    # the heading gains " · label" once the prototype's data arrives (it may before the first look)
    page.get_by_role("heading", name=re.compile(rf"^Prototype {proto}( · .+)?$")).wait_for()
    assert page.url.endswith(f"#/prototype/{proto}")
    page.locator(".signature li").first.wait_for()
    active = page.locator(".contexts mark.active")
    assert active.count() > 0 and active.first.inner_text()
    assert int(page.locator(".stats dd").first.inner_text().replace(",", "")) > 0
    # usage: the tokens it fires on, counted over the training activations, most first
    counts = page.locator("#fires-on li .n")
    counts.first.wait_for()
    shown = [int(c.replace(",", "")) for c in counts.all_inner_texts()]
    assert shown == sorted(shown, reverse=True) and shown[0] > 0
    page.locator("#suppress-proto").click()
    page.get_by_role("heading", name="Generate with suppression").wait_for()
    assert page.input_value("#gen-suppress") == str(proto)


def test_suppressed_generation_differs(page, web_live):
    attribute(page, web_live.url, n_new=8)
    page.locator("#suppress-output").click()  # the prototypes carrying every generated token
    page.get_by_role("heading", name="Generate with suppression").wait_for()
    assert page.input_value("#gen-prompt") == PROMPT
    ids = [int(x) for x in page.input_value("#gen-suppress").split(",")]
    page.fill("#gen-new", "8")
    page.get_by_role("button", name="Compare").click()
    verdict = page.locator("#verdict")
    verdict.wait_for()
    plain = page.locator(".gen.plain .gen-text").inner_text()
    suppressed = page.locator(".gen.suppressed .gen-text").inner_text()
    assert plain != suppressed
    assert "differ" in verdict.inner_text()
    # the page shows what the API gives for the same request
    body = {"prompt": PROMPT, "max_new_tokens": 8, "suppress": ids}
    api = httpx.post(web_live.url + "/v1/generate", json=body, timeout=60).json()
    assert suppressed == PROMPT + api["completion"]
    # the strength slider: at x1 the prototypes are untouched, so both columns agree
    page.locator("#gen-alpha").evaluate("(e) => { e.value = '1'; e.dispatchEvent(new Event('input')); }")
    assert page.locator("#gen-alpha + output").inner_text() == "×1.00"
    page.get_by_role("button", name="Compare").click()
    page.locator("#verdict", has_text="Identical").wait_for()
    assert page.locator(".gen.suppressed .gen-text").inner_text() == plain


def test_audit_completes(page, web_live):
    items = [{"id": "first", "prompt": PROMPT, "max_new_tokens": 4},
             {"id": "second", "prompt": "It was a", "completion": " long time ago"}]
    page.goto(web_live.url + "/#/audits")
    page.fill("#audit-jsonl", "\n".join(json.dumps(i) for i in items))
    page.get_by_role("button", name="Start audit").click()
    page.wait_for_url(re.compile(r"#/audits/[^/]+$"))
    page.locator("#audit-status[data-status='completed']").wait_for(timeout=60_000)
    # the rows drawn for the completed job, not those of an earlier poll (they come one request later)
    page.locator("#audit-results[data-status='completed']").wait_for(timeout=60_000)
    assert "2 of 2 done" in page.locator("#audit-status").inner_text()
    assert page.locator("#audit-progress").evaluate("p => p.value") == 1
    rows = page.locator("#audit-results tbody tr")
    assert rows.count() == 2
    for n, item in enumerate(items):
        row = rows.nth(n)
        assert item["id"] in row.inner_text() and "done" in row.inner_text()
        assert row.locator("ol.mini a").count() > 0
    # the audit is listed among this key's audits, as is one created over REST (not from this browser)
    audit_id = page.url.rsplit("/", 1)[-1]
    rest = httpx.post(web_live.url + "/v1/audits", json={"items": [{"prompt": "It was", "completion": " a"}]}).json()
    page.goto(web_live.url + "/#/audits")
    page.locator("#audit-list table").wait_for()
    assert page.get_by_role("link", name=audit_id).count() == 1
    assert page.get_by_role("link", name=rest["id"]).count() == 1
    links = page.locator("#audit-list tbody a").all_inner_texts()
    assert links.index(rest["id"]) < links.index(audit_id)  # newest first


def test_a_sql_link_fills_the_editor_but_runs_nothing(page, web_live):
    posted = []
    page.on("request", lambda r: posted.append(r.url) if r.method == "POST" and "/v1/sql" in r.url else None)
    page.goto(web_live.url + "/#/sql?q=" + "SELECT%20count(*)%20AS%20n%20FROM%20audit_results")
    page.locator("#sql-status", has_text="press Run").wait_for()
    page.wait_for_timeout(500)
    assert page.input_value("#sql-box") == "SELECT count(*) AS n FROM audit_results"
    assert posted == [] and page.locator("#sql-out table").count() == 0
    page.get_by_role("button", name="Run", exact=True).click()
    page.locator("#sql-out tbody tr").first.wait_for()
    assert len(posted) == 1


def test_sql_rows_and_a_clear_error(page, web_live):
    page.goto(web_live.url + "/#/sql")
    page.fill("#sql-box", "SELECT doc_id, external_id FROM documents ORDER BY doc_id LIMIT 3")
    page.get_by_role("button", name="Run", exact=True).click()
    page.locator("#sql-status", has_text="3 rows").wait_for()
    assert page.locator("#sql-out thead th").all_inner_texts()[0].startswith("doc_id")
    assert page.locator("#sql-out tbody tr").count() == 3

    page.fill("#sql-box", "COPY documents TO '/tmp/prism-web-test.csv'")
    page.locator("#sql-box").press("Control+Enter")
    alert = page.locator("#sql-out [role=alert]")
    alert.wait_for()
    text = alert.inner_text()
    assert "not allowed" in text and "COPY" in text and "HTTP 403" in text, text
    assert page.locator("#sql-out table").count() == 0

    page.fill("#sql-box", "SELEC 1")
    page.get_by_role("button", name="Run", exact=True).click()
    page.locator("#sql-out [role=alert]", has_text="does not parse").wait_for()

    page.get_by_role("button", name="Most used prototypes").click()
    page.locator("#sql-out tbody tr").first.wait_for()
    assert page.locator("#sql-out thead th").all_inner_texts()[0].startswith("proto_id")


def test_narrow_width_has_no_sideways_scroll(page, web_live):
    page.set_viewport_size({"width": 390, "height": 800})
    attribute(page, web_live.url)
    page.locator("#tokens button.tok").first.click()
    page.locator("#docs-panel .doc").first.wait_for()
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    page.get_by_role("link", name="SQL", exact=True).click()
    page.locator("#sql-box").wait_for()
    assert page.evaluate("document.documentElement.scrollWidth") <= 390


@pytest.fixture(scope="module")
def keyed(index, tmp_path_factory):
    settings = service_settings(index, tmp_path_factory.mktemp("web-keyed"), api_keys=["s3cret-key"])
    with serving(settings) as live:
        yield live.url


def test_api_key_field(browser, keyed):
    context = browser.new_context()
    page = context.new_page()
    page.set_default_timeout(30_000)
    try:
        page.goto(keyed + "/#/sql")
        page.get_by_role("button", name="Run", exact=True).click()
        alert = page.locator("#sql-out [role=alert]")
        alert.wait_for()
        assert "HTTP 401" in alert.inner_text() and "API key" in alert.inner_text()
        assert page.locator("#key-box").get_attribute("open") is not None
        page.fill("#api-key", "s3cret-key")
        page.get_by_role("button", name="Use", exact=True).click()
        page.get_by_role("button", name="Run", exact=True).click()
        page.locator("#sql-out tbody tr").first.wait_for()
        assert page.evaluate("sessionStorage.getItem('prism.apiKey')") == "s3cret-key"
    finally:
        context.close()


def test_api_docs_render_offline(page, web_live):
    """/docs loads Swagger UI from this server alone and renders the API (no CDN: the test machine
    has no network, and every request the page makes is checked)."""
    requests: list[str] = []
    page.on("request", lambda r: requests.append(r.url))
    page.goto(web_live.url + "/docs")
    page.wait_for_selector(".swagger-ui .info .title")
    assert "PRISM-TDA" in page.inner_text(".swagger-ui .info .title")
    page.get_by_text("/v1/attribute", exact=True).first.wait_for()
    assert requests and all(u.startswith(web_live.url + "/") for u in requests), requests


def test_steer_discover_save_and_compare(page, web_live):
    """Steer: documents picked by SQL -> discovered prototypes with evidence -> saved as a set -> the
    same prompt generated with and without it, as the API generates it."""
    page.goto(web_live.url + "/#/steer")
    page.get_by_role("heading", name="Steer").wait_for()
    # nothing given: a clear message, no request
    page.get_by_role("button", name="Discover").click()
    assert "Paste example texts" in page.locator("#steer-found").inner_text()
    page.fill("#steer-sql", "SELECT doc_id FROM documents WHERE external_id LIKE 'art/%'")
    page.get_by_role("button", name="Discover").click()
    page.wait_for_selector("#steer-found table")
    rows = page.locator("#steer-found tbody tr")
    assert rows.count() >= 5
    assert "documents" in page.locator("#steer-summary").inner_text()
    ticked = [int(b.get_attribute("value")) for b in page.locator("#steer-found tbody input:checked").all()]
    assert 1 <= len(ticked) <= 10
    # the table shows what the API discovers for the same topic
    api = httpx.post(web_live.url + "/v1/prototypes/discover",
                     json={"topic": {"sql": "SELECT doc_id FROM documents WHERE external_id LIKE 'art/%'"}, "top_n": 20},
                     timeout=120).json()
    assert ticked == [p["proto_id"] for p in api["prototypes"]][: len(ticked)]
    # chosen by measured effect: the boxes ticked are the API's selection
    page.check("#steer-effect")
    with page.expect_response(lambda r: "/v1/prototypes/discover/tasks/" in r.url and r.request.method == "GET") as polled:
        page.get_by_role("button", name="Discover").click()  # run as a background task, polled for progress
    assert polled.value.json()["status"] in ("queued", "running", "completed")
    page.locator("#steer-selection").wait_for()
    costs = page.locator("#steer-cost li")  # the contrast documents the set's cost falls on, linked
    assert costs.count() >= 1 and "% of it on document" in costs.first.inner_text()
    assert costs.first.locator("a").get_attribute("href").startswith("#/document/")
    strengths = page.locator("#steer-strengths").inner_text()  # how much of the effect a lower strength keeps
    assert "×0.25:" in strengths and "×0.50:" in strengths and "contrast perplexity" in strengths
    chosen = sorted(int(b.get_attribute("value")) for b in page.locator("#steer-found tbody input:checked").all())
    sel = httpx.post(web_live.url + "/v1/prototypes/discover",
                     json={"topic": {"sql": "SELECT doc_id FROM documents WHERE external_id LIKE 'art/%'"}, "top_n": 20,
                           "select": "effect"}, timeout=120).json()["selection"]
    assert chosen == sorted(sel["prototypes"])
    page.uncheck("#steer-effect")
    # the default name is this page's own (two users saving with the defaults do not collide)
    default = page.input_value("#steer-name")
    assert re.fullmatch(r"topic-[0-9a-f]{6}", default), default
    page.reload()
    page.get_by_role("heading", name="Steer").wait_for()
    page.fill("#steer-sql", "SELECT doc_id FROM documents WHERE external_id LIKE 'art/%'")
    page.get_by_role("button", name="Discover").click()
    page.wait_for_selector("#steer-found table")
    assert page.input_value("#steer-name") != default
    page.fill("#steer-name", "art-web")
    page.get_by_role("button", name="Save set").click()
    page.locator("#steer-saved", has_text="Saved").wait_for()
    stored = httpx.get(web_live.url + "/v1/prototype-sets/art-web", timeout=30).json()
    assert stored["prototypes"] == sorted(ticked)
    page.fill("#steer-prompt", PROMPT)
    page.fill("#steer-new", "8")
    page.fill("#steer-temp", "0")
    page.get_by_role("button", name="Generate with and without").click()
    page.locator("#verdict").wait_for()
    suppressed = page.locator(".gen.suppressed .gen-text").inner_text()
    body = {"prompt": PROMPT, "max_new_tokens": 8, "suppress": "art-web", "temperature": 0, "seed": 0}
    assert suppressed == PROMPT + httpx.post(web_live.url + "/v1/generate", json=body, timeout=60).json()["completion"]
    # at half strength the page sends alpha 0.5 and shows what the API gives for it
    page.locator("#steer-alpha").evaluate("(e) => { e.value = '0.5'; e.dispatchEvent(new Event('input')); }")
    page.get_by_role("button", name="Generate with and without").click()
    page.locator(".chips", has_text="×0.50").wait_for()
    half = page.locator(".gen.suppressed .gen-text").inner_text()
    api = httpx.post(web_live.url + "/v1/generate", json={**body, "alpha": 0.5}, timeout=60).json()
    assert half == PROMPT + api["completion"] and api["steered"][0]["alpha"] == 0.5
    # only where the context carries the set: the page sends the gate and says so
    page.fill("#steer-gate", "0.3")
    page.get_by_role("button", name="Generate with and without").click()
    page.locator(".gen.suppressed h2", has_text="where they hold 30% of the last 16 tokens").wait_for()
    gated = page.locator(".gen.suppressed .gen-text").inner_text()
    api = httpx.post(web_live.url + "/v1/generate", json={**body, "alpha": 0.5, "gate": 0.3}, timeout=60).json()
    assert gated == PROMPT + api["completion"] and api["gate"] == 0.3


def test_prototypes_are_searchable_by_label(page, web_live):
    rows = httpx.get(web_live.url + "/v1/prototypes", params={"limit": 100}, timeout=60).json()["prototypes"]
    assert rows and rows[0]["label"], rows[:1]
    # a label word the URL carries as written (labels also quote tokens such as "↵")
    first, word = next((r, w) for r in rows for w in re.findall(r"[A-Za-z]{2,}", r["label"]))
    page.goto(web_live.url + "/#/prototypes")
    page.fill("#proto-q", word)
    page.get_by_role("button", name="Search").click()
    page.wait_for_url(re.compile(r"q=" + re.escape(word)))
    # the count of this search, not of the list the page showed before it (the count names its query)
    page.locator(f'#proto-count[data-q="{word}"]', has_text="of").wait_for()
    links = page.locator("main table a").all_inner_texts()
    assert links and any(f"prototype {first['proto_id']} " in t for t in links)
    api = httpx.get(web_live.url + "/v1/prototypes", params={"q": word, "limit": 25}, timeout=60).json()
    assert len(links) == len(api["prototypes"])


@pytest.fixture(scope="module")
def fitted(index, tmp_path_factory):
    """A server over a copy of the tiny index with its influence curvature, and one over the index without."""
    import shutil

    from prism_tda.engine.influence import fit_index

    ix = tmp_path_factory.mktemp("web-influence") / "ix"
    shutil.copytree(index, ix)
    fit_index(ix, max_sequences=32)
    settings = service_settings(ix, tmp_path_factory.mktemp("web-influence-state"), indexes={"tiny": ix})
    with serving(settings) as live:
        yield live.url


def test_influence_checkbox_shows_each_documents_effect(browser, fitted, web_live):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(30_000)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        for url, works in ((fitted, True), (web_live.url, False)):
            page.goto(url + "/#/attribute")
            page.fill("#attr-prompt", PROMPT)
            page.fill("#attr-topk", "20")
            page.check("#attr-influence")
            page.get_by_role("button", name="Attribute", exact=True).click()
            if works:
                page.locator("#docs-panel .doc").first.wait_for()
                effects = page.locator("#docs-panel .doc .chip", has_text="effect").all_inner_texts()
                assert len(effects) == page.locator("#docs-panel .doc").count() > 0
                assert all(re.fullmatch(r"effect -?[0-9.,e+-]+", t.strip()) for t in effects), effects
            else:  # an index without the curvature: the problem says how to fit it
                alert = page.locator("[role=alert]").first
                alert.wait_for()
                assert "--influence" in alert.inner_text()
    finally:
        context.close()
    assert not errors, errors


def test_audit_with_influence_shows_each_documents_effect(browser, fitted, web_live):
    """The audit form's influence box: each cited document shows its full-model effect, the value the
    REST items hold; on an index without the curvature the submission is refused with the fix."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(30_000)
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    item = json.dumps({"id": "x", "prompt": "It was a", "completion": " long time ago"})
    try:
        for url, works in ((fitted, True), (web_live.url, False)):
            page.goto(url + "/#/audits")
            page.fill("#audit-jsonl", item)
            page.check("#audit-influence")
            page.get_by_role("button", name="Start audit").click()
            if not works:
                alert = page.locator("[role=alert]").first
                alert.wait_for()
                assert "--influence" in alert.inner_text()
                continue
            page.wait_for_url(re.compile(r"#/audits/[^/]+$"))
            page.locator("#audit-results[data-status='completed']").wait_for(timeout=60_000)
            shown = page.locator("#audit-results ol.mini li .chip", has_text="effect").all_inner_texts()
            audit_id = page.url.rsplit("/", 1)[-1]
            docs = httpx.get(f"{url}/v1/audits/{audit_id}/items").json()["items"][0]["documents"]
            assert docs and shown == [f"effect {d['influence']:.2f}" for d in docs[:3]]
    finally:
        context.close()
    assert not errors, errors
