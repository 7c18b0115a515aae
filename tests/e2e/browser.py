"""The Prefect UI in a real browser for the e2e tests (not a test module): Playwright for Python driving Debian's
Chromium (``/usr/bin/chromium``, or ``$DIFFRET_CHROMIUM``) through ``executable_path``; no browser is downloaded.

``browser_page()`` skips the test cleanly when Playwright or Chromium is absent (`.ci/run` installs both). The
helpers drive the UI that Prefect 3.8 serves by default (the one under ``/v2``) the way a person does: a
deployment's Run -> Custom run, the config as JSON, Submit; a flow run's menu -> Retry; an artifact's page.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# headless, as root in a container, on a machine whose network is closed: no sandbox, no GPU, no background
# connections (each refused one would be retried)
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TIMEOUT_MS = 30_000


def chromium_path() -> str | None:
    path = os.environ.get("DIFFRET_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    return path if path and Path(path).exists() else None


def browser_available() -> bool:
    """Whether Playwright and Chromium are both here."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return False
    return chromium_path() is not None


@contextlib.contextmanager
def browser_page(width: int = 1400, height: int = 1000) -> Iterator[Any]:
    """A Playwright page in headless Chromium; the test is skipped when either is missing."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    exe = chromium_path()
    if exe is None:
        pytest.skip("no chromium on this machine (apt-get install chromium)")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=exe, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.set_default_timeout(TIMEOUT_MS)
            yield page
        finally:
            browser.close()


class PrefectUI:
    """The Prefect UI of a server at ``base`` (``http://host:port``), as a person clicks through it."""

    def __init__(self, page: Any, base: str, shots: Path | None = None):
        self.page, self.root, self.shots = page, base.rstrip("/") + "/v2", shots

    def shot(self, name: str, full_page: bool = True) -> None:
        """A screenshot into ``shots`` (when set): the docs' pictures come from here."""
        if self.shots is not None:
            self.shots.mkdir(parents=True, exist_ok=True)
            self.page.screenshot(path=str(self.shots / f"{name}.png"), full_page=full_page)

    def custom_run(self, deployment_id: str, config: dict, shot: str | None = None) -> str:
        """Deployment page -> Run -> Custom run, ``config`` entered as JSON, Submit; the new flow run's id. A
        submission the server refuses is tried twice more from a fresh form (a slow machine can submit before the
        editor's text reached the form), then fails with the server's answer."""
        answer: dict = {}
        for _ in range(3):
            try:
                answer = self._submit(deployment_id, config, shot)
            except AssertionError as e:  # the editor never showed the config: try again from a fresh form
                answer = {"editor": str(e)}
            if "id" in answer:
                return answer["id"]
        raise AssertionError(f"the server refused the Custom run three times: {answer}")

    def _submit(self, deployment_id: str, config: dict, shot: str | None) -> dict:
        p = self.page
        p.goto(f"{self.root}/deployments/deployment/{deployment_id}")
        p.get_by_role("button", name="Run", exact=True).click()
        p.get_by_role("menuitem", name="Custom run").click()
        p.wait_for_url("**/deployments/deployment/*/run**")
        menu = p.locator("main").get_by_role("button", name="Open menu").first  # the config parameter's menu
        menu.wait_for()  # the form renders once the deployment's schema is loaded
        if shot:
            self.shot(shot, full_page=False)  # its top: the whole form is many screens long
        menu.click()
        p.get_by_role("menuitem", name="Use JSON Input").click()
        editor = p.locator("main .cm-content").first
        # Clear the editor through its own keymap, then insert. The editor draws only the lines in view, so a DOM
        # select-all (what ``fill`` does) can leave a long default's unseen tail behind the new text ("Extra data").
        editor.click()
        p.keyboard.press("Control+A")
        p.keyboard.press("Delete")
        self._wait_for(lambda: editor.inner_text().strip() == "", "the JSON editor to empty", editor)
        p.keyboard.insert_text(json.dumps(config, indent=2))  # one insert: no auto-brackets
        self._wait_for(lambda: _same_json(editor.inner_text(), config), "the JSON editor to hold the config", editor)
        p.wait_for_timeout(1500)  # the form takes the editor's text a moment later (seconds on a loaded machine)
        with p.expect_response(lambda r: r.url.endswith("/create_flow_run") and r.request.method == "POST") as resp:
            p.get_by_role("button", name="Submit").click()
        body = resp.value.json()
        return body if isinstance(body, dict) else {"answer": body, "status": resp.value.status}

    def _wait_for(self, done: Any, what: str, editor: Any) -> None:
        deadline = time.monotonic() + TIMEOUT_MS / 1000
        while not done():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; it shows {editor.inner_text()!r}")
            self.page.wait_for_timeout(100)

    def flow_run(self, flow_run_id: str, shot: str | None = None) -> None:
        """A flow run's page, with its Artifacts tab open."""
        p = self.page
        p.goto(f"{self.root}/runs/flow-run/{flow_run_id}")
        tab = p.get_by_role("tab", name="Artifacts")
        tab.click()
        p.get_by_role("tabpanel").get_by_role("link").first.wait_for()
        if shot:
            p.wait_for_timeout(3000)  # the run graph draws after its data arrives
            self.shot(shot, full_page=False)

    def retry(self, flow_run_id: str) -> None:
        """A flow run's menu -> Retry -> confirm (what a person does for a Crashed or Failed run)."""
        p = self.page
        p.goto(f"{self.root}/runs/flow-run/{flow_run_id}")
        p.locator("main").get_by_role("button", name="Open menu").first.click()
        p.get_by_role("menuitem", name="Retry").click()
        with p.expect_response(lambda r: "/set_state" in r.url and r.request.method == "POST"):
            p.get_by_role("alertdialog", name="Retry Flow Run").get_by_role("button", name="Retry").click()

    def artifact_images(self, artifact_id: str, shot: str | None = None) -> list[dict]:
        """An artifact's page, once rendered: every image's alt text and natural size (0 wide: broken)."""
        p = self.page
        p.goto(f"{self.root}/artifacts/artifact/{artifact_id}")
        imgs = "main img[src]:not([src=''])"  # the page's own placeholders have no source
        ready = (
            f'() => {{ const i = [...document.querySelectorAll("{imgs}")]; '
            "return i.length > 0 && i.every(x => x.complete) }"
        )
        found: list[dict] = []
        for _ in range(3):  # the page may render its markdown again (hydration) between the wait and the read
            p.wait_for_function(ready)
            found = p.locator(imgs).evaluate_all(
                "els => els.map(e => ({alt: e.alt, width: e.naturalWidth, src: e.src.slice(0, 30)}))"
            )
            if found:
                break
        if shot:
            self.shot(shot)
        return found

    def text(self) -> str:
        return self.page.locator("main").inner_text()


def _same_json(text: str, value: dict) -> bool:
    try:
        return json.loads(text) == value
    except ValueError:
        return False
