"""The web chat UI in a real headless Chromium (Debian chromium + chromium-driver, driven by selenium) against
the real proxy (--ui, --api-key) and engine: the key typed in, a streamed answer equal to the API's, and Stop
aborting the engine's request. Screenshots are kept under the test's tmp dir (and $TEST_ARTIFACTS)."""

from __future__ import annotations

import os
import shutil
import urllib.request

import httpx
import pytest
from openai import OpenAI

from rest_proxy.config import ProxyConfig
from tests.grpc_client import start_engine
from tests.ops.ops_helpers import Scrape
from tests.proxy.servers import ProxyServer
from tests.waiting import wait_for

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(
    not (CHROMIUM and CHROMEDRIVER),
    reason="needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver; .ci/run does)")
API_KEY = "ui-test-key"
QUESTION = "What is the capital of France?"
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1280,900")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    logs = tmp_path_factory.mktemp("ui")
    engine = start_engine("--kv-cache-memory", "64", "--max-model-len", "2048", log_path=str(logs / "engine.log"))
    proxy = ProxyServer(ProxyConfig(engines=[engine.target], api_key=API_KEY, ui=True)).start()
    yield engine, proxy
    proxy.stop()
    engine.stop()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    yield driver
    driver.quit()


def screenshot(driver, tmp_path, name: str) -> None:
    path = tmp_path / f"{name}.png"
    assert driver.save_screenshot(str(path))
    if os.environ.get("TEST_ARTIFACTS"):
        os.makedirs(os.environ["TEST_ARTIFACTS"], exist_ok=True)
        shutil.copy(path, os.path.join(os.environ["TEST_ARTIFACTS"], f"ui-{name}.png"))


def scrape(engine) -> Scrape:
    with urllib.request.urlopen(f"http://127.0.0.1:{engine.metrics_port}/metrics", timeout=5) as response:
        return Scrape.parse(response.read().decode())



def ask(driver, text: str, temperature: str, max_tokens: str):
    from selenium.webdriver.common.by import By

    for element_id, value in (("temperature", temperature), ("max-tokens", max_tokens), ("input", text)):
        field = driver.find_element(By.ID, element_id)
        field.clear()
        field.send_keys(value)
    before = len(driver.find_elements(By.CSS_SELECTOR, ".msg.assistant"))
    driver.find_element(By.ID, "send").click()
    return wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")[before:], 120, "a reply")[0]


def open_ui_with_key(driver, proxy) -> str:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    driver.get(proxy.url + "/")
    status = driver.find_element(By.ID, "status")
    wait_for(lambda: status.text == "This proxy needs its API key: enter it on the left.", 30, "the key prompt")
    driver.find_element(By.ID, "api-key").send_keys(API_KEY + Keys.TAB)  # change event: models reload
    options = wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, "#model option"), 30, "the model list")
    assert status.text == ""
    return options[0].get_attribute("value")


def test_the_ui_streams_the_answer_the_api_gives(stack, browser, tmp_path):
    from selenium.webdriver.common.by import By

    engine, proxy = stack
    sdk = OpenAI(base_url=proxy.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    model = open_ui_with_key(browser, proxy)
    assert [m.id for m in sdk.models.list().data] == [model]
    choice = sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}],
                                         temperature=0, max_tokens=12).choices[0]
    expected = choice.message.content
    before = scrape(engine)
    # Count the answer's updates on screen: streamed, it grows in several steps.
    browser.execute_script("""
        window.uiUpdates = 0;
        new MutationObserver(() => window.uiUpdates++).observe(document.getElementById('messages'),
            {subtree: true, childList: true, characterData: true});""")
    reply = ask(browser, QUESTION, "0", "12")
    wait_for(lambda: reply.get_attribute("data-done") == "true", 120, "the answer's end")
    content = reply.find_element(By.CSS_SELECTOR, ".content").text
    assert " ".join(content.split()) == " ".join(expected.split())
    notes = [n.text for n in reply.find_elements(By.CSS_SELECTOR, ".note")]
    assert notes == (["stopped at max tokens"] if choice.finish_reason == "length" else [])
    assert browser.execute_script("return window.uiUpdates") > 3
    after = scrape(engine)
    reason = choice.finish_reason
    assert after.value("inference_engine_request_success_total", finished_reason=reason) \
        - before.value("inference_engine_request_success_total", finished_reason=reason) == 1
    screenshot(browser, tmp_path, "answer")


def test_stop_aborts_the_request_on_the_engine(stack, browser, tmp_path):
    from selenium.webdriver.common.by import By

    engine, proxy = stack
    if not browser.find_elements(By.CSS_SELECTOR, "#model option"):
        open_ui_with_key(browser, proxy)
    before = scrape(engine)
    reply = ask(browser, "Count from 1 to 1000, separated by commas.", "0", "1500")
    content = reply.find_element(By.CSS_SELECTOR, ".content")
    wait_for(lambda: len(content.text) > 10, 120, "the answer to start")
    assert scrape(engine).value("inference_engine_requests_running") == 1
    browser.find_element(By.ID, "stop").click()
    wait_for(lambda: reply.get_attribute("data-done") == "true", 30, "the stop")
    assert reply.find_element(By.CSS_SELECTOR, ".note").text == "stopped"
    after = wait_for(lambda: (s := scrape(engine)).value("inference_engine_requests_running") == 0
                     and s.value("inference_engine_request_success_total", finished_reason="abort")
                     > before.value("inference_engine_request_success_total", finished_reason="abort") and s,
                     30, "the engine to abort the request")
    for reason, count in (("abort", 1), ("length", 0), ("stop", 0)):
        assert after.value("inference_engine_request_success_total", finished_reason=reason) \
            - before.value("inference_engine_request_success_total", finished_reason=reason) == count, reason
    assert browser.find_element(By.ID, "send").is_enabled()
    screenshot(browser, tmp_path, "stopped")


def test_the_ui_routes(stack, proxy):
    _, ui_proxy = stack
    page = httpx.get(ui_proxy.url + "/")
    assert page.status_code == 200 and '<script src="/ui/static/app.js">' in page.text
    script = httpx.get(ui_proxy.url + "/ui/static/markdown.js")
    assert script.status_code == 200 and "window.Markdown" in script.text
    # The page is public; what it calls needs the key.
    denied = httpx.get(ui_proxy.url + "/ui/mcp/tools")
    assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
    tools = httpx.get(ui_proxy.url + "/ui/mcp/tools", headers={"Authorization": f"Bearer {API_KEY}"})
    assert (tools.status_code, tools.json()) == (200, {"tools": []})
    call = httpx.post(ui_proxy.url + "/ui/mcp/call", json={"name": "x"},
                      headers={"Authorization": f"Bearer {API_KEY}"})
    assert call.status_code == 400 and call.json()["error"]["param"] == "name"
    # Without --ui there is no page.
    assert httpx.get(proxy.url + "/").status_code == 404
