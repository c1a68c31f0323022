"""The chat page (GET /) in a real headless Chromium driven by Selenium, against a live server
on the default model started with --api-key and --root-path: the page asks for the key,
streams a reply that matches the API's, shows model, platform and speed, keeps the
conversation over a reload (each tab its own), stops a long reply, gets past a failed request,
checks its settings, lets one scroll up during a reply, and works behind a proxy that strips
the root path. Skipped only when Debian's chromium / chromium-driver are missing.

PAGED_UI_SCREENSHOT=docs/img/chat-page.png refreshes the screenshot of docs/chat-page.md."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import httpx
import pytest
from prefix_proxy import prefix_proxy
from server_helpers import server_helpers

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
    pytest.skip(
        f"needs {CHROMIUM} and {CHROMEDRIVER} (apt-get install chromium chromium-driver)",
        allow_module_level=True,
    )

from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

KEY = "ui-key-42"
ROOT = "/chat"  # --root-path: the server is reachable directly and behind prefix_proxy
AUTH = {"Authorization": f"Bearer {KEY}"}
CHROME_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--window-size=1280,820",
]  # fmt: skip
SYSTEM = "You are a helpful assistant."
# The last assistant message as the page shows it: [state, deltas rendered, text, meta line].
LAST_REPLY = """
const el = [...document.querySelectorAll('.msg.assistant')].pop();
return el ? [el.dataset.state, +el.dataset.deltas, el.querySelector('.body').innerText,
             el.querySelector('.meta').innerText] : null;
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    h = server_helpers()
    log = tmp_path_factory.mktemp("ui") / "server.log"
    srv = h.start_server([*h.ENGINE_ARGS, "--api-key", KEY, "--root-path", ROOT], log)
    yield srv
    h.stop_server(srv)


@pytest.fixture(scope="module")
def http(server) -> httpx.Client:
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in [*CHROME_FLAGS, f"--user-data-dir={tmp_path_factory.mktemp('chromium')}"]:
        opts.add_argument(flag)
    old = os.environ.get("SE_OFFLINE")
    os.environ["SE_OFFLINE"] = "true"  # explicit paths: Selenium Manager never downloads
    try:
        driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    finally:
        if old is None:
            os.environ.pop("SE_OFFLINE")
        else:
            os.environ["SE_OFFLINE"] = old
    yield driver
    driver.quit()


def wait(driver, condition, timeout: float = 60):
    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(condition)


def open_page(driver, url: str, key: str | None) -> None:
    """The page at `url` with empty storages, localStorage holding only `key` (None: no key)."""
    driver.get(url)
    driver.execute_script(
        "localStorage.clear(); sessionStorage.clear();"
        "if (arguments[0]) localStorage.setItem('paged.apiKey', arguments[0]);",
        key,
    )
    driver.refresh()


def model_id(http) -> str:
    return http.get("/v1/models").json()["data"][0]["id"]


def set_field(driver, element_id: str, value: str) -> None:
    el = driver.find_element(By.ID, element_id)
    el.clear()
    if value:
        el.send_keys(value)


def send(driver, text: str) -> None:
    driver.find_element(By.ID, "input").send_keys(text)
    driver.find_element(By.ID, "send").click()


def stored_messages(driver) -> list[dict]:
    """The tab's conversation (sessionStorage: each tab its own)."""
    saved = driver.execute_script("return sessionStorage.getItem('paged.chat')")
    return json.loads(saved)["messages"]


def set_input(driver, text: str) -> None:
    """The message box's text, at once (send_keys types a long text key by key)."""
    driver.execute_script("document.getElementById('input').value = arguments[0]", text)


def ready_page(driver, server, http) -> None:
    open_page(driver, server.url + "/", key=KEY)
    wait(driver, lambda d: d.find_element(By.ID, "model").text == model_id(http))


def finished_reply(driver) -> list:
    """LAST_REPLY once the reply is no longer streaming."""
    done = lambda d: (r := d.execute_script(LAST_REPLY)) and r[0] != "streaming" and r
    return wait(driver, done, timeout=90)


def running(http) -> int:
    return sum(r["running"] + r["waiting"] for r in http.get("/fleet").json()["replicas"])


def test_page_asks_for_the_key(browser, server, http):
    open_page(browser, server.url + "/", key=None)
    dialog = browser.find_element(By.ID, "key-dialog")
    wait(browser, lambda d: dialog.get_attribute("open") is not None)
    browser.find_element(By.ID, "key-input").send_keys("wrong-key")
    browser.find_element(By.ID, "key-save").click()
    # The wrong key gets a 401: the page asks again and says why.
    wait(browser, lambda d: "refused" in d.find_element(By.ID, "key-msg").text)
    assert dialog.get_attribute("open") is not None
    browser.find_element(By.ID, "key-input").send_keys(KEY)
    browser.find_element(By.ID, "key-save").click()
    wait(browser, lambda d: d.find_element(By.ID, "model").text == model_id(http))
    assert dialog.get_attribute("open") is None
    assert browser.execute_script("return localStorage.getItem('paged.apiKey')") == KEY
    set_field(browser, "max-tokens", "3")
    send(browser, "Hi")
    state, deltas, text, _ = finished_reply(browser)
    assert state == "done" and deltas > 0 and text.strip()


def test_chat_streams_matches_the_api_and_is_kept(browser, server, http, tmp_path):
    open_page(browser, server.url + "/", key=KEY)
    model = model_id(http)
    wait(browser, lambda d: d.find_element(By.ID, "model").text == model)
    platforms = {r["platform"] for r in http.get("/fleet").json()["replicas"]}
    wait(browser, lambda d: d.find_element(By.ID, "platform").text in platforms)
    set_field(browser, "system", SYSTEM)
    set_field(browser, "temperature", "0")
    set_field(browser, "max-tokens", "24")
    prompt = "Write a Python function that adds two numbers."
    send(browser, prompt)

    # Streaming: the reply is seen growing, delta by delta, before it is done.
    lengths = []
    deadline = time.monotonic() + 90
    while (reply := browser.execute_script(LAST_REPLY))[0] == "streaming":
        lengths.append(len(reply[2]))
        assert time.monotonic() < deadline, "the reply did not finish in 90 s"
        time.sleep(0.03)
    state, deltas, text, meta = reply
    assert state == "done", meta
    assert deltas > 1 and len({n for n in lengths if n}) > 1, lengths
    assert text.strip()
    assert re.search(r"\d+ tokens · \d+(\.\d+)? tok/s", meta), meta

    # The same greedy request through the API gives the same text.
    content = stored_messages(browser)[-1]["content"]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
    body = {"model": model, "messages": messages, "temperature": 0, "max_tokens": 24}
    api = http.post("/v1/chat/completions", json=body).json()
    assert content == api["choices"][0]["message"]["content"]
    assert f"{api['usage']['completion_tokens']} tokens" in meta

    shot = Path(os.environ.get("PAGED_UI_SCREENSHOT") or tmp_path / "chat-page.png")
    shot.parent.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 0

    # A reload keeps the conversation (sessionStorage) and the settings (localStorage).
    browser.refresh()
    wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg")) == 2)
    assert browser.find_element(By.CSS_SELECTOR, ".msg.user").text == prompt
    assert browser.execute_script(LAST_REPLY)[2] == text
    assert browser.find_element(By.ID, "system").get_attribute("value") == SYSTEM
    assert browser.find_element(By.ID, "temperature").get_attribute("value") == "0"


def test_stop_and_new_chat(browser, server, http):
    open_page(browser, server.url + "/", key=KEY)
    wait(browser, lambda d: d.find_element(By.ID, "model").text == model_id(http))
    set_field(browser, "max-tokens", "400")
    send(browser, "Tell me a long story about a dragon.")
    wait(browser, lambda d: d.execute_script(LAST_REPLY)[1] >= 3)
    browser.find_element(By.ID, "stop").click()
    wait(browser, lambda d: d.execute_script(LAST_REPLY)[0] == "stopped", timeout=10)
    _, deltas, text, meta = browser.execute_script(LAST_REPLY)
    assert "stopped" in meta and 3 <= deltas < 400 and text.strip()
    assert browser.find_element(By.ID, "send").is_displayed()
    assert not browser.find_element(By.ID, "stop").is_displayed()
    # Closing the stream aborts the request in the engine.
    wait(browser, lambda d: running(http) == 0, timeout=15)
    time.sleep(0.3)
    assert browser.execute_script(LAST_REPLY)[1] == deltas  # nothing arrives after the stop
    assert stored_messages(browser)[-1]["state"] == "stopped"

    browser.find_element(By.ID, "new-chat").click()
    assert browser.find_elements(By.CSS_SELECTOR, ".msg") == []
    assert stored_messages(browser) == []


def test_markdown_is_rendered_and_escaped(browser, server):
    open_page(browser, server.url + "/", key=KEY)
    src = (
        "# Title\n<img src=x onerror=alert(1)> **bold** *it* `a<b>` "
        "[bad](javascript:alert(1)) [good](https://example.com/?a=1&b=2)\n\n"
        "- one\n- two\n\n```python\nprint('<script>')\n```"
    )
    html = browser.execute_script("return window.pagedChat.renderMarkdown(arguments[0])", src)
    assert "<img" not in html and "<script" not in html
    assert "&lt;img src=x onerror=alert(1)&gt;" in html
    assert "<strong>bold</strong>" in html and "<em>it</em>" in html
    assert "<code>a&lt;b&gt;</code>" in html and "<h1>Title</h1>" in html
    assert "[bad](javascript:alert(1))" in html and 'href="javascript' not in html
    assert '<a href="https://example.com/?a=1&amp;b=2"' in html
    assert "<ul><li>one</li><li>two</li></ul>" in html
    assert '<pre><code class="lang-python">print(&#39;&lt;script&gt;&#39;)</code></pre>' in html
    # emphasis inside a link's label (never in its URL), still escaped
    src = "[**x**](https://a.example/) [*y* `c*d*`](https://b.example/_u_) [**<b>**](https://c.example)"
    html = browser.execute_script("return window.pagedChat.renderMarkdown(arguments[0])", src)
    assert '<a href="https://a.example/" target="_blank" rel="noopener noreferrer">' in html
    assert "<strong>x</strong></a>" in html and "<em>y</em> <code>c*d*</code></a>" in html
    assert 'href="https://b.example/_u_"' in html and "<strong>&lt;b&gt;</strong></a>" in html
    assert "<b>" not in html and "**" not in html
    # the page's icon is inline (no /favicon.ico request, no 404 in the console) and loads
    loads = browser.execute_async_script(
        "const done = arguments[0], img = new Image();"
        "img.onload = () => done(img.naturalWidth > 0); img.onerror = () => done(false);"
        "img.src = document.querySelector('link[rel=icon]').href;"
    )
    assert loads is True


def test_a_failed_request_is_not_sent_again(browser, server, http):
    """A request the server refuses (a prompt beyond the context) marks its user turn failed:
    later requests leave it out, so the next messages are answered."""
    ready_page(browser, server, http)
    set_field(browser, "max-tokens", "3")
    set_input(browser, "x " * 9000)
    browser.find_element(By.ID, "send").click()
    state, _, _, meta = finished_reply(browser)
    assert state == "error" and "error:" in meta, meta
    failed = browser.find_elements(By.CSS_SELECTOR, ".msg.user")[-1]
    assert failed.get_attribute("data-state") == "failed" and "not answered" in failed.text
    status = browser.find_element(By.ID, "status")
    assert "failed" in status.text and "error" in status.get_attribute("class")
    for _ in range(2):
        send(browser, "hi")
        state, _, text, meta = finished_reply(browser)
        assert state == "done" and text.strip(), meta
    body = browser.execute_script("return window.pagedChat.requestBody()")
    assert [m["role"] for m in body["messages"]] == ["user", "assistant"] * 2
    assert all(len(m["content"]) < 200 for m in body["messages"])
    assert stored_messages(browser)[0]["state"] == "failed"  # kept, shown, never sent


def test_settings_are_checked_not_altered(browser, server, http):
    ready_page(browser, server, http)
    set_field(browser, "max-tokens", "1.5")
    set_field(browser, "temperature", "5")
    problems = browser.find_element(By.ID, "settings-error")
    wait(browser, lambda d: problems.is_displayed(), timeout=5)
    assert "Max tokens: 1.5 is not a whole number" in problems.text
    assert "Temperature: 5 is not a number from 0 to 2" in problems.text
    for field in ("max-tokens", "temperature"):
        assert "invalid" in browser.find_element(By.ID, field).get_attribute("class")
    send(browser, "Hi")
    assert browser.find_elements(By.CSS_SELECTOR, ".msg") == []  # not sent
    assert "Not sent" in browser.find_element(By.ID, "status").text
    assert browser.find_element(By.ID, "input").get_attribute("value") == "Hi"  # kept
    set_field(browser, "max-tokens", "7")
    set_field(browser, "temperature", "0.25")
    set_field(browser, "top-p", "0")  # the server's range: above 0
    assert "Top p: 0" in problems.text and "Max tokens" not in problems.text
    set_field(browser, "top-p", "")
    assert not problems.is_displayed()
    body = browser.execute_script("return window.pagedChat.requestBody()")
    assert body["max_tokens"] == 7 and body["temperature"] == 0.25 and "top_p" not in body


def test_tabs_keep_their_own_conversations(browser, server, http):
    """The conversation is the tab's (sessionStorage), the settings are shared (localStorage,
    the `storage` event): typing a setting in one tab never overwrites another's chat."""
    ready_page(browser, server, http)
    set_field(browser, "max-tokens", "3")
    send(browser, "Hi")
    assert finished_reply(browser)[0] == "done"
    first = browser.current_window_handle
    browser.switch_to.new_window("tab")
    try:
        browser.get(server.url + "/")
        wait(browser, lambda d: d.find_element(By.ID, "model").text == model_id(http))
        assert browser.find_elements(By.CSS_SELECTOR, ".msg") == []  # its own conversation
        assert browser.find_element(By.ID, "max-tokens").get_attribute("value") == "3"
        set_field(browser, "system", "Be brief.")
        send(browser, "Hello")
        assert finished_reply(browser)[0] == "done"
        assert [m["content"] for m in stored_messages(browser)][0] == "Hello"
    finally:
        browser.close()
        browser.switch_to.window(first)
    system = browser.find_element(By.ID, "system")
    wait(browser, lambda d: system.get_attribute("value") == "Be brief.", timeout=5)
    browser.refresh()
    wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg")) == 2)
    assert browser.find_element(By.CSS_SELECTOR, ".msg.user").text == "Hi"
    assert browser.find_element(By.ID, "system").get_attribute("value") == "Be brief."


def test_first_token_time_excludes_the_key_dialog(browser, server, http):
    ready_page(browser, server, http)
    browser.execute_script("localStorage.removeItem('paged.apiKey')")
    set_field(browser, "max-tokens", "3")
    send(browser, "Hi")
    dialog = browser.find_element(By.ID, "key-dialog")
    wait(browser, lambda d: dialog.get_attribute("open") is not None)
    time.sleep(4)  # someone looking for the key
    browser.find_element(By.ID, "key-input").send_keys(KEY)
    browser.find_element(By.ID, "key-save").click()
    assert finished_reply(browser)[0] == "done"
    ttft = stored_messages(browser)[-1]["ttft"]
    assert 0 < ttft < 4, ttft


BOX = "const b = document.getElementById('messages');"
AT_BOTTOM = BOX + "return b.scrollHeight - b.scrollTop - b.clientHeight < 40;"


def test_scrolled_up_view_stays_during_a_reply(browser, server, http):
    """A reply follows the view down only while it is at the bottom."""
    ready_page(browser, server, http)
    filler = [{"role": ("user", "assistant")[i % 2], "content": f"line {i}\n" * 15}
              for i in range(8)]  # fmt: skip
    browser.execute_script(
        "sessionStorage.setItem('paged.chat', JSON.stringify({messages: arguments[0]}))", filler
    )
    browser.refresh()
    wait(browser, lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg")) == 8)
    set_field(browser, "max-tokens", "300")
    send(browser, "Tell me a long story about a dragon.")
    wait(browser, lambda d: d.execute_script(LAST_REPLY)[1] >= 12)
    assert browser.execute_script(AT_BOTTOM)  # followed so far
    browser.execute_script(BOX + "b.scrollTop = 0;")
    seen = browser.execute_script(LAST_REPLY)[1]
    grown = lambda d: (r := d.execute_script(LAST_REPLY))[1] >= seen + 8 or r[0] != "streaming"
    wait(browser, grown)
    assert browser.execute_script(BOX + "return b.scrollTop;") == 0
    browser.find_element(By.ID, "stop").click()
    wait(browser, lambda d: d.execute_script(LAST_REPLY)[0] != "streaming", timeout=10)
    wait(browser, lambda d: running(http) == 0, timeout=15)


def test_behind_a_proxy_with_the_root_path(browser, server, http):
    """Every request of the page (assets, API) goes to PREFIX/..., which the proxy strips."""
    with prefix_proxy(server.url, ROOT) as proxy:
        base = f"{proxy}{ROOT}/"
        open_page(browser, base, key=KEY)
        wait(browser, lambda d: d.find_element(By.ID, "platform").text not in ("…", "unknown"))
        assert browser.find_element(By.ID, "model").text == model_id(http)
        set_field(browser, "max-tokens", "3")
        send(browser, "Hi")
        state, deltas, text, _ = finished_reply(browser)
        assert state == "done" and deltas > 0 and text.strip()
        urls = browser.execute_script(
            "return performance.getEntriesByType('resource').map(e => e.name)"
        )
    assert all(u.startswith(base) for u in urls), urls
    paths = {u.removeprefix(base) for u in urls}
    assert {"static/chat.js", "static/chat.css", "v1/models", "fleet"} <= paths
    assert "v1/chat/completions" in paths
