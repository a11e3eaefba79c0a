"""The dashboard in a real browser: Debian's headless Chromium driven by Selenium, against `pagegate serve` with an
API key. The page logs in, loads with no console error and no request leaving the server's origin, and the
figures on its root element match /metrics idle, under 8 streams with n=2 on a shared prompt, and after."""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

from pagegate.testing.launcher import ServerProcess, wait_for
from tests.gateway.conftest import metric_value
from tests.gateway.server_args import server_args

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM.is_file() and CHROMEDRIVER.is_file()),
                                reason="no /usr/bin/chromium + /usr/bin/chromedriver: apt-get install chromium "
                                       "chromium-driver (.ci/run does)")

KEY = "dashboard-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
SHARED_PROMPT = "And God said, Let there be light: and there was light. " * 8  # several full pages
GRADES = ("OK", "GOOD", "WARNING", "CRITICAL")
SCREENSHOTS_ENV = "PAGEGATE_DASHBOARD_SCREENSHOTS"  # a folder to copy the screenshots to (docs/dashboard.png's)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    args = server_args("--num-kv-blocks", "384", "--max-num-seqs", "32", "--swap-space", "0.005", "--api-key", KEY)
    process = ServerProcess(args).start()
    yield process
    assert process.stop() == 0, process.log()[-4000:]


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    options = Options()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,900",
                 "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER)))  # never a downloaded driver
    yield driver
    driver.quit()


def figures(driver: WebDriver) -> dict[str, str]:
    return driver.execute_script("return Object.assign({}, document.documentElement.dataset)")


def metrics_figures(http: httpx.Client) -> dict[str, str]:
    text = http.get("/metrics").text

    def value(name: str) -> float:
        found = metric_value(text, name)
        assert found is not None, f"/metrics has no {name}"
        return found

    total = value("pagegate:kv_blocks_total")
    return {"totalPages": str(round(total)), "usedPages": str(round(value("pagegate:kv_blocks_used"))),
            "sharedPages": str(round(value("pagegate:kv_shared_blocks_perc") * total)),
            "cachedPages": str(round(value("pagegate:kv_blocks_cached"))),
            "running": str(round(value("vllm:num_requests_running"))),
            "waiting": str(round(value("vllm:num_requests_waiting"))), "health": GRADES[round(value("pagegate:health"))]}


def wait_for_agreement(driver: WebDriver, http: httpx.Client, condition: Callable[[dict[str, str]], bool],
                       timeout_s: float = 60.0) -> dict[str, str]:
    """The page's figures equal /metrics read between two identical frames of the page, and satisfy condition."""
    last: list[dict[str, str]] = []  # shown, /metrics

    def agree() -> bool:
        before = figures(driver)
        expected = metrics_figures(http)
        after = figures(driver)
        shown = {k: before.get(k) for k in expected}
        last[:] = [shown, expected]
        return shown == {k: after.get(k) for k in expected} == expected and condition(shown)

    try:
        wait_for(agree, "the dashboard to match /metrics", timeout_s, poll_s=0.05)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: shown, /metrics = {last}") from exc
    return last[0]


def screenshot(driver: WebDriver, folder: Path, name: str) -> Path:
    path = folder / f"dashboard-{name}.png"
    driver.save_screenshot(str(path))
    assert path.stat().st_size > 20_000, f"{path} is {path.stat().st_size} bytes: a blank page?"
    if os.environ.get(SCREENSHOTS_ENV):
        shutil.copy(path, Path(os.environ[SCREENSHOTS_ENV]) / path.name)
    return path


def stream_completion(base_url: str, errors: list[BaseException], max_tokens: int = 300) -> None:
    body = {"prompt": SHARED_PROMPT, "max_tokens": max_tokens, "n": 2, "stream": True, "ignore_eos": True,
            "temperature": 1.0}
    try:
        with httpx.stream("POST", base_url + "/v1/completions", json=body, headers=AUTH, timeout=300) as response:
            response.raise_for_status()
            for _ in response.iter_lines():
                pass
    except BaseException as error:
        errors.append(error)


def stream_until(base_url: str, errors: list[BaseException], stop: threading.Event, max_tokens: int = 300) -> None:
    """Completions one after another until `stop`: load that lasts as long as the check needs, however fast the
    engine is."""
    while not stop.is_set() and not errors:
        stream_completion(base_url, errors, max_tokens)


def log_in(driver: WebDriver, base_url: str) -> None:
    driver.get(base_url + "/dashboard")
    form = driver.find_element(By.ID, "login")
    WebDriverWait(driver, 10).until(lambda d: form.is_displayed())
    driver.find_element(By.ID, "api-key").send_keys(KEY)
    driver.find_element(By.CSS_SELECTOR, "#login button").click()
    WebDriverWait(driver, 20).until(lambda d: figures(d).get("totalPages"))
    assert not form.is_displayed()


def hover_checks(driver: WebDriver) -> None:
    """Hovering a running request highlights its pages; hovering a cell shows the page's tooltip."""

    item = driver.find_element(By.CSS_SELECTOR, "#running-list li[data-request]")
    ActionChains(driver).move_to_element(item).perform()
    WebDriverWait(driver, 10).until(lambda d: int(figures(d).get("highlightedPages") or 0) > 0)
    grid = driver.find_element(By.ID, "device-grid")
    ActionChains(driver).move_to_element_with_offset(grid, -grid.size["width"] // 2 + 3,
                                                     -grid.size["height"] // 2 + 3).perform()
    tooltip = driver.find_element(By.ID, "tooltip")
    WebDriverWait(driver, 10).until(lambda d: tooltip.is_displayed())
    assert "Page 0" in tooltip.text and "refcount" in tooltip.text and "prefix-cache page" in tooltip.text


def requests_made(driver: WebDriver) -> list[str]:
    urls = []
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            urls.append(message["params"]["request"]["url"])
    return urls


def drain_logs(driver: WebDriver) -> None:
    """Forget what the browser logged for an earlier test (another server, another origin)."""
    driver.get_log("browser")
    driver.get_log("performance")


def test_dashboard_matches_metrics_idle_under_load_and_after(server: ServerProcess, browser: WebDriver,
                                                             tmp_path: Path) -> None:
    driver, base = browser, server.base_url
    drain_logs(driver)
    with httpx.Client(base_url=base, timeout=30) as http:
        log_in(driver, base)
        idle = wait_for_agreement(driver, http, lambda f: f["usedPages"] == "0")
        assert int(idle["totalPages"]) == 384
        screenshot(driver, tmp_path, "idle")

        errors: list[BaseException] = []
        stop = threading.Event()
        streams = [threading.Thread(target=stream_until, args=(base, errors, stop)) for _ in range(8)]
        for thread in streams:
            thread.start()
        try:
            busy = wait_for_agreement(
                driver, http, lambda f: int(f["usedPages"]) > 0 and int(f["sharedPages"]) > 0 and f["running"] == "16")
            hover_checks(driver)
            screenshot(driver, tmp_path, "load")
        finally:
            stop.set()
            for thread in streams:
                thread.join(300)
        assert not errors, errors
        assert int(busy["usedPages"]) > int(busy["sharedPages"]) > 0

        after = wait_for_agreement(driver, http, lambda f: f["usedPages"] == "0" and f["running"] == "0")
        assert int(after["cachedPages"]) > 0  # the shared prompt's pages stay revivable
        screenshot(driver, tmp_path, "after")

    severe = [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
    assert not severe, severe
    urls = requests_made(driver)
    assert any(url.startswith(base + "/dashboard/api/feed") for url in urls)
    assert all(url.startswith(base + "/") or url.startswith("data:") for url in urls), urls


def test_feed_and_queries_need_the_key(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        assert http.get("/dashboard").status_code == 200  # the page itself asks for the key
        assert http.get("/dashboard/api/feed").status_code == 401
        assert http.get("/dashboard/api/page", params={"id": 0}).status_code == 401
        with http.stream("GET", "/dashboard/api/feed", params={"api_key": KEY}) as response:
            assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
            frame = next(line for line in response.iter_lines() if line.startswith("data: "))
        assert '"key":true' in frame and '"total_pages":384' in frame
        page = http.get("/dashboard/api/page", params={"id": 0}, headers=AUTH).json()
        assert page["page"] == 0 and page["pool"] == "device" and isinstance(page["requests"], list)
        assert http.get("/dashboard/api/pages", params={"request": "gone"}, headers=AUTH).json() == {
            "request": "gone", "pages": [], "cpu_pages": []}


def test_a_262144_page_pool_stays_smooth(browser: WebDriver) -> None:
    """One pixel per page: frames keep coming under load, and the page logs no error. How fast they come is
    bench's to measure, not a test's (the machines here are too noisy for a bound)."""
    driver = browser
    drain_logs(driver)
    args = server_args("--num-kv-blocks", "262144", "--block-size", "1", "--max-num-seqs", "32")
    with ServerProcess(args) as server:
        driver.get(server.base_url + "/dashboard")  # no key on this server
        WebDriverWait(driver, 20).until(lambda d: figures(d).get("totalPages") == "262144")
        errors: list[BaseException] = []
        stop = threading.Event()
        streams = [threading.Thread(target=stream_until, args=(server.base_url, errors, stop, 200))
                   for _ in range(4)]
        for thread in streams:
            thread.start()
        try:
            WebDriverWait(driver, 30).until(lambda d: int(figures(d).get("usedPages") or 0) > 100)
            first = int(figures(driver)["frames"])
            wait_for(lambda: int(figures(driver)["frames"]) >= first + 15, "15 more frames at 262,144 pages",
                     timeout_s=120, poll_s=0.1)  # a page that froze would never draw them
        finally:
            stop.set()
            for thread in streams:
                thread.join(300)
        assert not errors, errors
        assert not [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
        driver.get("about:blank")  # before the server goes: a page left open would log its reconnects
