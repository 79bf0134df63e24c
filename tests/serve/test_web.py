"""The web chat page at / in a real headless Chromium (Debian's `chromium`, driven by Playwright's Python
client; never a browser download): it asks for the API key, streams a reply (thinking shown in a
collapsible block), stops a generation (the server frees it), and saves a screenshot under the test's
tmp dir (and into $K3_SCREENSHOT_DIR when set)."""

import os
import shutil

import pytest

API_KEY = "sk-test"
CHROMIUM = "/usr/bin/chromium"
INSTALL = "apt-get update && apt-get install -y chromium"
FLAGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run", "--disable-sync"]  # fmt: skip


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        if os.environ.get("K3_SKIP_BROWSER") == "1":
            pytest.skip("K3_SKIP_BROWSER=1 and no chromium")
        pytest.fail(
            f"the browser test needs Debian's chromium at {CHROMIUM}: `{INSTALL}` (or K3_SKIP_BROWSER=1)"
        )
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield b
        b.close()


def test_page_streams_stops_and_shows_thinking(browser, checkpoint, launch, idle, tmp_path):
    s = launch(checkpoint, "--api-key", API_KEY, "--max-model-len", "8192", "--page-size", "16",
               "--max-num-seqs", "4")  # fmt: skip
    try:
        page = browser.new_page(viewport={"width": 1100, "height": 760})
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("console", lambda m: m.type == "error" and "401" not in m.text and errors.append(m.text))
        page.goto(s.url + "/")
        page.wait_for_selector("#key-form:not([hidden])", timeout=10_000)  # the server has a key
        page.fill("#key", API_KEY)
        page.click("#key-form button")
        # predicates are arrow functions: a bare expression is polled with eval, which the page's CSP
        # (rightly) refuses
        page.wait_for_function(
            "() => document.querySelector('#model').textContent.includes('kimi-k3')", timeout=10_000
        )
        page.click("#settings-button")
        page.fill("#max-tokens", "48")
        page.fill("#temperature", "0")
        page.fill("#input", "the quick brown fox")
        # every length the reply has on screen, recorded on each DOM change (no polling: a fast server
        # can stream a whole reply between two polls)
        page.evaluate(
            "() => { window.__lens = new Set(); new MutationObserver(() => {"
            " const m = [...document.querySelectorAll('.msg.assistant')].pop(); if (!m) return;"
            " window.__lens.add(m.querySelector('.thought').textContent.length"
            " + m.querySelector('.content').textContent.length) })"
            ".observe(document.body, {subtree: true, childList: true, characterData: true}) }"
        )
        page.press("#input", "Enter")
        page.wait_for_selector(".msg.assistant[data-state]", timeout=30_000)
        assert page.locator(".msg.assistant").first.get_attribute("data-state") == "done"
        seen = set(page.evaluate("() => [...window.__lens]"))
        assert len({n for n in seen if n > 0}) >= 2, seen  # the reply grew while it streamed
        first = page.locator(".msg.assistant").first
        assert first.locator("details.thinking").count() == 1  # thinking: a collapsible block
        assert "length" in first.locator(".meta").text_content()

        # a long generation, stopped from the page: the server cancels it. The page presses Stop itself,
        # from the DOM change that shows the 21st character of thinking, so the click cannot land after
        # the reply has ended (a fast server streams hundreds of tokens in a tenth of a second)
        page.fill("#max-tokens", "6000")
        page.fill("#input", "and the lazy dog")
        page.evaluate(
            "() => { const obs = new MutationObserver(() => {"
            " const m = [...document.querySelectorAll('.msg.assistant')].pop();"
            " if (!m || m.dataset.state || m.querySelector('.thought').textContent.length <= 20) return;"
            " obs.disconnect(); window.__stopEnabled = !document.querySelector('#stop').disabled;"
            " document.querySelector('#stop').click() });"
            " obs.observe(document.body, {subtree: true, childList: true, characterData: true}) }"
        )
        page.press("#input", "Enter")
        page.wait_for_function("() => window.__stopEnabled !== undefined", timeout=20_000)
        assert page.evaluate("() => window.__stopEnabled")  # Stop was live while the reply streamed
        page.wait_for_selector(".msg.assistant[data-state=stopped]", timeout=10_000)
        assert page.locator("#send").is_enabled()
        m = idle(s.url, timeout=2.0)
        assert m["k3_kda_slots_in_use"] == 0 and m["k3_num_requests_pending"] == 0
        assert m["k3_aborted_requests_total"] >= 1
        first.locator("details.thinking summary").click()  # unfold the first reply's thinking
        assert first.locator("details.thinking").get_attribute("open") is not None
        shot = tmp_path / "k3-chat.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 10_000
        if os.environ.get("K3_SCREENSHOT_DIR"):
            os.makedirs(os.environ["K3_SCREENSHOT_DIR"], exist_ok=True)
            shutil.copy(shot, os.environ["K3_SCREENSHOT_DIR"])
        assert not errors, errors
    finally:
        s.stop()


def test_static_files_only_from_the_package(server):
    import urllib.error
    import urllib.request

    with urllib.request.urlopen(server + "/static/chat.js") as r:
        assert r.headers["Content-Security-Policy"].startswith("default-src 'none'")
    for bad in ("/static/..%2Fapp.py", "/static/app.py", "/static/%2e%2e%2f%2e%2e%2fpyproject.toml"):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(server + bad)
        assert e.value.code == 404
