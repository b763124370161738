"""The web UI in a real browser: headless Chromium (Debian's `chromium` and `chromium-driver`) through
Selenium, against a real `wllm serve` on the embedded SmolLM2 with API keys on (and --metrics-auth, so
the engine view's stats need the key too).

It asks for a key, chats (a streamed greedy answer that names Paris), stops a long reply (the server's
running gauge returns to 0), answers in JSON schema mode, makes a tool call and answers it with a tool
result, and fires concurrent requests while the engine view's counters and charts move. Screenshots go to
artifacts/ui/ at the repository root (git-ignored; .ci/run has no
artifact folder of its own, so CI keeps that one). Without Chromium the tests skip, unless
WLLM_REQUIRE_BROWSER=1 (set by .ci/run), where that is a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from test_server_e2e import ServerProcess

from wllm.model.default_model import default_model_path

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "artifacts" / "ui"
KEY = "sk-ui-browser"
T = TypeVar("T")


def _browser() -> tuple[str, str] | str:
    """(chromium, chromedriver) paths, or why they cannot be used."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not chromium or not driver:
        return "needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver; .ci/run does)"
    try:
        import selenium  # noqa: F401
    except ImportError:
        return 'needs selenium (pip install -e ".[test]")'
    return chromium, driver


BROWSER = _browser()
if isinstance(BROWSER, str):
    if os.environ.get("WLLM_REQUIRE_BROWSER") == "1":
        raise RuntimeError(f"WLLM_REQUIRE_BROWSER=1 but the browser tests cannot run: {BROWSER}")
    pytest.skip(BROWSER, allow_module_level=True)

from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402
from selenium.webdriver.support.ui import Select  # noqa: E402


def wait_for(what: str, check: Callable[[], T | None], timeout: float = 120.0, every: float = 0.1) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(every)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    default_model_path()  # fetch outside the server's start-up deadline
    s = ServerProcess(
        [
            "--api-key",
            KEY,
            "--metrics-auth",
            "--max-model-len",
            "2048",
            "--kv-cache-memory",
            "0.25",
            "--no-engine-process",
        ],
        tmp_path_factory.mktemp("ui") / "server.log",
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def driver() -> Iterator[WebDriver]:
    assert not isinstance(BROWSER, str)
    chromium, chromedriver = BROWSER
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=1280,900",
        "--disable-extensions",
        "--no-first-run",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    d = webdriver.Chrome(service=Service(chromedriver), options=options)
    d.set_script_timeout(30)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    yield d
    d.quit()


def stats(server: ServerProcess) -> dict[str, Any]:
    r = httpx.get(f"{server.root}/v1/engine/stats", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    r.raise_for_status()
    return r.json()


def by_id(d: WebDriver, element_id: str) -> Any:
    return d.find_element(By.ID, element_id)


def set_value(d: WebDriver, element_id: str, value: str) -> None:
    field = by_id(d, element_id)
    field.clear()
    field.send_keys(value)
    d.execute_script("arguments[0].dispatchEvent(new Event('change'))", field)


def choose(d: WebDriver, element_id: str, value: str) -> None:
    Select(by_id(d, element_id)).select_by_value(value)  # fires change, as a user's pick does


def reset_chat(d: WebDriver) -> None:
    """A new chat with plain text replies and no tools (the browser keeps settings between tests)."""
    by_id(d, "new-chat").click()
    choose(d, "response-format", "text")
    set_value(d, "tools", "")
    choose(d, "tool-choice", "auto")
    if not by_id(d, "parallel-tool-calls").is_selected():
        by_id(d, "parallel-tool-calls").click()


def stored_chat(d: WebDriver) -> dict[str, Any]:
    return json.loads(d.execute_script("return localStorage.getItem('wllm.chat')"))


def finished(d: WebDriver, count: int) -> tuple[str, str]:
    """(state, text) of the newest assistant message once there are `count` and the last one ended."""
    return wait_for(
        f"assistant reply {count}",
        lambda: (
            len(d.find_elements(By.CSS_SELECTOR, "#messages .message.assistant")) == count
            and (r := last_reply(d))[0] in ("done", "error", "stopped")
            and r
        ),
    )


def last_reply(d: WebDriver) -> tuple[str, str]:
    """(state, text) of the newest assistant message."""
    found = d.find_elements(By.CSS_SELECTOR, "#messages .message.assistant")
    if not found:
        return "", ""
    node = found[-1]
    return node.get_attribute("data-state") or "", node.find_element(By.CSS_SELECTOR, ".content").text


def no_console_errors(d: WebDriver) -> None:
    errors = [e for e in d.get_log("browser") if e["level"] == "SEVERE" and "401" not in e["message"]]
    assert not errors, errors


def open_page(d: WebDriver, server: ServerProcess, view: str = "chat") -> None:
    d.get(f"{server.root}/#{view}")
    if not d.execute_script("return localStorage.getItem('wllm.apiKey')"):  # run alone: the first test sets it
        d.execute_script("localStorage.setItem('wllm.apiKey', arguments[0])", KEY)
        d.refresh()
    wait_for("the model list", lambda: d.find_elements(By.CSS_SELECTOR, "#model option"), timeout=30)


def test_asks_for_the_key_then_chats_with_a_streamed_markdown_answer(driver: WebDriver, server: ServerProcess) -> None:
    d = driver
    d.get(f"{server.root}/")
    # Auth is on and the browser has no key: the UI says so and offers the key field.
    wait_for("the API key box", lambda: by_id(d, "auth").is_displayed() and by_id(d, "auth-message").text, 30)
    assert "API key" in by_id(d, "auth-message").text
    by_id(d, "api-key").send_keys(KEY)
    by_id(d, "api-key-save").click()
    open_page(d, server)
    assert [o.get_attribute("value") for o in d.find_elements(By.CSS_SELECTOR, "#model option")] == [
        httpx.get(f"{server.base_url}/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"][0]["id"]
    ]
    wait_for("the engine status", lambda: by_id(d, "server-status").get_attribute("data-state") == "ok", 30)

    by_id(d, "new-chat").click()
    # Bad input is refused in the page with a message saying what is allowed; nothing is sent.
    set_value(d, "temperature", "5")
    by_id(d, "prompt").send_keys("What is the capital of France?")
    by_id(d, "send").click()
    assert "temperature must be a number from 0 to 2" in by_id(d, "chat-error").text
    assert not d.find_elements(By.CSS_SELECTOR, "#messages .message")
    set_value(d, "temperature", "0")
    set_value(d, "max-tokens", "32")
    by_id(d, "send").click()
    state, text = wait_for("the reply", lambda: (r := last_reply(d))[0] in ("done", "error", "stopped") and r)
    assert state == "done", text
    assert "Paris" in text
    node = d.find_elements(By.CSS_SELECTOR, "#messages .message.assistant")[-1]
    assert node.find_elements(By.CSS_SELECTOR, ".content p"), "the reply is rendered as Markdown paragraphs"
    assert "tokens" in node.find_element(By.CSS_SELECTOR, ".meta").text
    d.save_screenshot(str(ARTIFACTS / "chat.png"))
    # The conversation and the settings live in the browser: a reload brings them back.
    d.refresh()
    wait_for("the restored conversation", lambda: "Paris" in last_reply(d)[1], 30)
    assert by_id(d, "temperature").get_attribute("value") == "0"
    no_console_errors(d)


def test_markdown_renderer_builds_no_markup_from_model_text(driver: WebDriver, server: ServerProcess) -> None:
    d = driver
    open_page(d, server)
    hostile = (
        "Hi <img src=x onerror=alert(1)> **bold** and `<b>code</b>`\n\n"
        "```html\n<script>alert(2)</script>\n```\n- one\n- [two](javascript:alert(3))\n"
        "1. [site](https://example.com/a)\n"
    )
    out = d.execute_async_script(
        """
        const [text, done] = arguments;
        import('/ui/markdown.js').then((m) => {
          const box = document.createElement('div');
          box.append(m.render(text));
          done({html: box.innerHTML, tags: [...box.querySelectorAll('*')].map((e) => e.tagName.toLowerCase()),
                links: [...box.querySelectorAll('a')].map((a) => a.href),
                code: box.querySelector('pre code').textContent});
        }).catch((e) => done({error: String(e)}));
    """,
        hostile,
    )
    assert "error" not in out, out
    assert set(out["tags"]) <= {"p", "strong", "code", "pre", "span", "ul", "ol", "li", "a", "em", "br"}, out["tags"]
    assert "img" not in out["tags"] and "script" not in out["tags"] and "b" not in out["tags"]
    assert "&lt;img src=x onerror=alert(1)&gt;" in out["html"]
    assert out["code"] == "<script>alert(2)</script>"
    assert out["links"] == ["https://example.com/a"]  # the javascript: link stays text


def test_stop_aborts_a_long_reply_and_the_engine_frees_it(driver: WebDriver, server: ServerProcess) -> None:
    d = driver
    open_page(d, server)
    by_id(d, "new-chat").click()
    set_value(d, "temperature", "0.7")
    set_value(d, "max-tokens", "1500")
    by_id(d, "prompt").send_keys("Write a very long story about a dragon who learns to cook.")
    by_id(d, "send").click()
    # Streamed: the text grows while the reply is still coming.
    first = wait_for("the first words", lambda: len(last_reply(d)[1]) > 20 and last_reply(d)[1])
    wait_for("more words", lambda: len(last_reply(d)[1]) > len(first) and last_reply(d)[0] == "streaming")
    assert stats(server)["requests"]["running"] == 1
    by_id(d, "stop").click()
    state, text = wait_for("the stopped state", lambda: (r := last_reply(d))[0] != "streaming" and r, 10)
    assert state == "stopped"
    assert "stopped" in d.find_elements(By.CSS_SELECTOR, "#messages .message.assistant .meta")[-1].text
    wait_for("the running gauge to return to 0", lambda: stats(server)["requests"]["running"] == 0, 15, 0.25)
    generated = stats(server)["generation_tokens"]
    time.sleep(1.5)
    assert last_reply(d)[1] == text, "nothing arrives after stop"
    assert stats(server)["generation_tokens"] == generated, "the engine stopped generating"
    assert len(text) < 1500 * 2 and by_id(d, "send").is_enabled() and not by_id(d, "stop").is_enabled()


def test_engine_view_moves_while_concurrent_requests_run(driver: WebDriver, server: ServerProcess) -> None:
    d = driver
    open_page(d, server, "engine")
    assert by_id(d, "view-engine").is_displayed() and not by_id(d, "view-chat").is_displayed()
    wait_for("the first stats", lambda: by_id(d, "stat-running").text.isdigit(), 30)
    time.sleep(2.2)  # a few samples on the charts
    charts = ["chart-requests", "chart-tps", "chart-kv"]
    before = {c: d.execute_script("return arguments[0].toDataURL()", by_id(d, c)) for c in charts}
    generated_before = int(by_id(d, "stat-generated").text)
    n = 6
    set_value(d, "fire-n", str(n))
    set_value(d, "fire-max-tokens", "40")
    assert by_id(d, "fire-go").text == f"Fire {n} concurrent requests"
    by_id(d, "fire-go").click()
    peak_running, peak_tps, shot = 0, 0.0, False
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        running = by_id(d, "stat-running").text
        peak_running = max(peak_running, int(running) if running.isdigit() else 0)
        peak_tps = max(peak_tps, float(by_id(d, "stat-tps").text or 0))
        lanes = [lane.get_attribute("data-state") for lane in d.find_elements(By.CSS_SELECTOR, "#lanes .lane")]
        if not shot and peak_running >= 2 and len(lanes) == n and lanes.count("streaming") >= 2:
            shot = d.save_screenshot(str(ARTIFACTS / "engine.png"))  # mid-burst: lanes filling, running up
        if len(lanes) == n and all(s in ("done", "error", "stopped") for s in lanes):
            break
        time.sleep(0.2)
    assert lanes == ["done"] * n, (lanes, by_id(d, "fire-error").text)
    assert by_id(d, "fire-summary").text.startswith(f"{n} of {n} finished")
    # Continuous batching: several requests were in the running batch at once, and tokens flowed.
    assert peak_running >= 2, peak_running
    assert peak_tps > 0
    wait_for(
        "the counters to take in the burst", lambda: int(by_id(d, "stat-generated").text) >= generated_before + n, 10
    )
    time.sleep(1.2)
    after = {c: d.execute_script("return arguments[0].toDataURL()", by_id(d, c)) for c in charts}
    assert all(after[c] != before[c] for c in charts), [c for c in charts if after[c] == before[c]]
    if not shot:
        d.save_screenshot(str(ARTIFACTS / "engine.png"))
    no_console_errors(d)


SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_json_schema_mode_streams_a_reply_that_parses(driver: WebDriver, server: ServerProcess) -> None:
    d = driver
    open_page(d, server)
    reset_chat(d)
    set_value(d, "temperature", "0")
    set_value(d, "max-tokens", "64")
    assert not by_id(d, "json-schema-field").is_displayed()
    choose(d, "response-format", "json_schema")
    assert by_id(d, "json-schema-field").is_displayed()
    # Invalid JSON in the schema box is a message in the page, and nothing is sent.
    set_value(d, "json-schema", '{"type": "object", "properties": ')
    by_id(d, "prompt").send_keys("Which city is the Eiffel Tower in?")
    by_id(d, "send").click()
    assert "the JSON schema is not valid JSON" in by_id(d, "chat-error").text
    assert by_id(d, "json-schema").get_attribute("aria-invalid") == "true"
    assert not d.find_elements(By.CSS_SELECTOR, "#messages .message")
    set_value(d, "json-schema", json.dumps(SCHEMA))
    by_id(d, "send").click()
    state, text = finished(d, 1)
    assert state == "done", text
    assert by_id(d, "chat-error").text == ""
    reply = json.loads(text)  # the grammar holds the reply to the schema
    assert isinstance(reply, dict) and isinstance(reply["city"], str), reply
    node = d.find_elements(By.CSS_SELECTOR, "#messages .message.assistant")[-1]
    assert node.find_elements(By.CSS_SELECTOR, ".content pre code"), "a JSON reply is shown as code, verbatim"
    d.save_screenshot(str(ARTIFACTS / "chat-json.png"))
    # The mode and the schema are settings like the others: a reload brings them back.
    d.refresh()
    wait_for("the restored conversation", lambda: last_reply(d)[1] == text, 30)
    assert by_id(d, "response-format").get_attribute("value") == "json_schema"
    assert json.loads(by_id(d, "json-schema").get_attribute("value")) == SCHEMA
    assert by_id(d, "json-schema-field").is_displayed()
    no_console_errors(d)
    reset_chat(d)


def test_tool_call_is_rendered_and_answered_with_a_tool_result(driver: WebDriver, server: ServerProcess) -> None:
    d = driver
    open_page(d, server)
    reset_chat(d)
    set_value(d, "temperature", "0")
    set_value(d, "max-tokens", "64")
    by_id(d, "prompt").send_keys("What is the weather like in Paris?")
    for bad, says in (("[{", "the tool definitions is not valid JSON"), ('{"type": "function"}', "JSON array")):
        set_value(d, "tools", bad)
        by_id(d, "send").click()
        assert says in by_id(d, "chat-error").text
        assert not d.find_elements(By.CSS_SELECTOR, "#messages .message")
    set_value(d, "tools", json.dumps([WEATHER_TOOL], indent=2))
    choose(d, "tool-choice", "required")
    by_id(d, "parallel-tool-calls").click()  # one call, then the reply ends (parallel_tool_calls: false)
    by_id(d, "send").click()
    state, _ = finished(d, 1)
    assert state == "done", by_id(d, "chat-error").text
    node = d.find_elements(By.CSS_SELECTOR, "#messages .message.assistant")[-1]
    calls = node.find_elements(By.CSS_SELECTOR, ".tool-call")
    assert len(calls) == 1
    assert calls[0].find_element(By.CSS_SELECTOR, ".tool-name").text == "get_weather"
    args = json.loads(calls[0].find_element(By.CSS_SELECTOR, ".tool-args").text)
    assert isinstance(args["city"], str), args
    assert "tool_calls" in node.find_element(By.CSS_SELECTOR, ".meta").text
    # The stored turn is OpenAI's shape: the assistant message keeps its tool_calls.
    stored = stored_chat(d)["messages"]
    call = stored[1]["tool_calls"][0]
    assert call["id"] and call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"])
    d.save_screenshot(str(ARTIFACTS / "chat-tool-call.png"))

    # Answer the call; tool_choice none so that the next reply is text rather than another call.
    choose(d, "tool-choice", "none")
    boxes = node.find_elements(By.CSS_SELECTOR, ".tool-result")
    assert len(boxes) == len(calls)
    node.find_element(By.CSS_SELECTOR, ".tool-send").click()
    assert "type the result of get_weather first" in by_id(d, "chat-error").text
    for box in boxes:
        box.send_keys('{"city": "Paris", "forecast": "sunny", "temperature_c": 22}')
    node.find_element(By.CSS_SELECTOR, ".tool-send").click()
    state, text = finished(d, 2)
    assert state == "done" and text.strip(), (state, text, by_id(d, "chat-error").text)
    roles = [m.get_attribute("class") for m in d.find_elements(By.CSS_SELECTOR, "#messages .message")]
    assert roles == ["message user", "message assistant"] + ["message tool"] * len(calls) + ["message assistant"]
    assert "get_weather" in d.find_element(By.CSS_SELECTOR, "#messages .message.tool .role").text
    assert not d.find_elements(By.CSS_SELECTOR, ".tool-result"), "answered calls offer no result boxes"
    stored = stored_chat(d)["messages"]
    assert stored[2]["role"] == "tool" and stored[2]["tool_call_id"] == call["id"]
    d.save_screenshot(str(ARTIFACTS / "chat-tool-result.png"))
    d.refresh()
    wait_for("the restored conversation", lambda: last_reply(d)[1] == text, 30)
    assert d.find_element(By.CSS_SELECTOR, "#messages .tool-name").text == "get_weather"
    assert by_id(d, "tool-choice").get_attribute("value") == "none"
    assert not by_id(d, "parallel-tool-calls").is_selected()
    assert json.loads(by_id(d, "tools").get_attribute("value")) == [WEATHER_TOOL]
    no_console_errors(d)
    reset_chat(d)


def test_tool_calls_and_json_replies_are_shown_as_text(driver: WebDriver, server: ServerProcess) -> None:
    d = driver
    open_page(d, server)
    hostile = '<img src=x onerror="window.pwned=1"><b>x</b>'
    args = json.dumps({"city": hostile})
    chat = {
        "settings": {},
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": hostile, "format": "json", "state": "done"},
            {
                "role": "assistant",
                "content": None,
                "state": "done",
                "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": hostile, "arguments": args}}],
            },
        ],
    }
    d.execute_script("localStorage.setItem('wllm.chat', arguments[0])", json.dumps(chat))
    d.refresh()
    wait_for("the tool call", lambda: d.find_elements(By.CSS_SELECTOR, "#messages .tool-call"), 30)
    box = by_id(d, "messages")
    assert not box.find_elements(By.CSS_SELECTOR, "img, b")
    assert d.find_element(By.CSS_SELECTOR, "#messages .tool-name").text == hostile
    assert d.find_element(By.CSS_SELECTOR, "#messages .tool-args").text == args
    assert d.find_elements(By.CSS_SELECTOR, "#messages .message.assistant .content")[0].text == hostile
    assert "Result of" in d.find_element(By.CSS_SELECTOR, "#messages .tool-results").text
    assert d.execute_script("return window.pwned === undefined")
    reset_chat(d)
