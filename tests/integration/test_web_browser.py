"""pgcoord.web in a real browser: Debian's headless chromium, driven by Selenium
through Debian's chromedriver (Selenium Manager downloads nothing). A missing
chromium is a failure, not a skip.

Every page loads and shows the state the test made; a leader killed with SIGKILL is
replaced in the open page without a reload; the Pause button pauses a schedule; the
browser meets 401 and 403. With PGCOORD_WEB_SCREENSHOTS=DIR set, the page tour
writes a PNG of each page there (docs/web/ holds the ones docs/web.md shows).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

import pgcoord.web

from .conftest import sql, unique
from .web_scene import scene
from .web_server import serve

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
REPLICA = str(Path(__file__).with_name("elector_replica.py"))


@pytest.fixture
def browser(chromium: WebDriver) -> Iterator[WebDriver]:
    """The browser, left on a blank page afterwards: an open page keeps its event
    stream, which would hold up the test server's shutdown."""
    yield chromium
    chromium.get("about:blank")
    chromium.delete_all_cookies()


@pytest.fixture(scope="module")
def chromium() -> Iterator[WebDriver]:
    for path in (CHROMIUM, CHROMEDRIVER):
        assert os.access(path, os.X_OK), f"{path} is missing: apt-get install chromium chromium-driver"
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    # The network log tells the status of a page the browser shows no body for (a 401).
    options.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1360,900", "--hide-scrollbars", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(20)
    try:
        yield driver
    finally:
        driver.quit()


def _wait(driver: WebDriver, condition: object, seconds: float = 5.0) -> object:
    # A live update swaps <main> while the condition reads it: an element gone stale
    # is read again.
    return WebDriverWait(driver, seconds, poll_frequency=0.05,
                         ignored_exceptions=(StaleElementReferenceException, NoSuchElementException),
                         ).until(condition)  # type: ignore[arg-type]


@contextmanager
def serving(asgi_app: object, driver: WebDriver) -> Iterator[str]:
    """``serve``, leaving the page before the server stops: an open page holds its
    event stream, which the server would wait for."""
    with serve(asgi_app) as url:
        try:
            yield url
        finally:
            driver.get("about:blank")


def _text(driver: WebDriver) -> str:
    return str(driver.find_element(By.TAG_NAME, "main").text)


def _shoot(driver: WebDriver, name: str) -> None:
    target = os.environ.get("PGCOORD_WEB_SCREENSHOTS")
    if not target:
        return
    Path(target).mkdir(parents=True, exist_ok=True)
    # The whole page, not the window: the viewport is made as tall as the page.
    height = int(driver.execute_script("return document.documentElement.scrollHeight"))
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {  # type: ignore[attr-defined]
        "width": 1360, "height": max(600, min(height, 1500)), "deviceScaleFactor": 1, "mobile": False})
    try:
        driver.save_screenshot(str(Path(target) / f"{name}.png"))
    finally:
        driver.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})  # type: ignore[attr-defined]


def _status(driver: WebDriver, page: str) -> int:
    for entry in driver.get_log("performance"):  # type: ignore[attr-defined]
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.responseReceived" and message["params"]["response"]["url"] == page:
            return int(message["params"]["response"]["status"])
    raise AssertionError(f"the browser fetched no {page}")


def test_every_page_loads_and_shows_the_fleet(fresh_db: str, browser: WebDriver) -> None:
    pgcoord.migrations.upgrade(fresh_db)
    with scene(fresh_db), serving(pgcoord.web.app(fresh_db, access=lambda request: "all"), browser) as url:
        time.sleep(1.1)  # a sample of the whole scene
        browser.get(url + "/")
        text = _text(browser)
        assert "Overview" in text and "no leader for nightly-export" in text
        assert "schedule refresh-rates is failing" in text and "reindex-cron" in text
        _wait(browser, lambda d: d.find_element(By.ID, "live").text == "live")
        _shoot(browser, "overview")

        browser.get(url + "/elections")
        text = _text(browser)
        assert "billing-scheduler" in text and "reports-1" in text and "no leader" in text
        assert "Leadership history" in text and "released" in text
        assert browser.find_elements(By.XPATH, "//button[normalize-space()='Resign']")
        _shoot(browser, "elections")

        browser.get(url + "/members")
        text = _text(browser)
        assert "billing-a" in text and "billing-b" in text and "ingest-1" in text
        assert "zone=eu-west-1a" in text and "invoices:" in text
        _shoot(browser, "members")

        browser.get(url + "/locks")
        text = _text(browser)
        assert "reindex-orders" in text and "partner-api" in text and "waits" in text
        assert "rebuild-search-index" in text  # a LockHolder's lock on a member, by name
        _shoot(browser, "locks")

        browser.get(url + "/schedules")
        text = _text(browser)
        for name in ("nightly-invoices", "digest:team-42", "refresh-rates", "vacuum-archive", "sync-crm"):
            assert name in text
        assert "Europe/Berlin" in text and "2 in a row" in text
        _shoot(browser, "schedules")

        browser.find_element(By.LINK_TEXT, "refresh-rates").click()
        _wait(browser, lambda d: "/schedules/refresh-rates" in d.current_url)
        text = _text(browser)
        assert "rates.example.com timed out" in text and "Slots" in text and "page 1 of" in text
        _shoot(browser, "schedule")

        browser.get(url + "/schedules/" + quote("no such job", safe=""))
        assert "404" in _text(browser) and "no schedule named 'no such job'" in _text(browser)
        _shoot(browser, "not-found")


def test_a_killed_leader_is_replaced_in_the_open_page_without_a_reload(
        fresh_db: str, browser: WebDriver) -> None:
    pgcoord.migrations.upgrade(fresh_db)
    sql(fresh_db, "create table elections (replica text, fence bigint)")
    sql(fresh_db, "create table fenced_writes (replica text, fence bigint)")
    name = unique("browser-elect")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    procs = {label: subprocess.Popen([sys.executable, REPLICA, fresh_db, name, "10", label],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
             for label in ("replica-a", "replica-b")}
    try:
        deadline = time.monotonic() + 20
        while not sql(fresh_db, "select holder from pgcoord.leases where name = %s and holder is not null", name):
            assert time.monotonic() < deadline, "no replica took the lead"
            time.sleep(0.05)
        with serving(pgcoord.web.app(fresh_db), browser) as url:
            browser.get(url + "/elections")
            _wait(browser, lambda d: d.find_element(By.ID, "live").text == "live")
            leader = str(sql(fresh_db, "select holder from pgcoord.leases where name = %s", name)[0][0])
            row = f"//tr[@data-name='{name}']/td[contains(@class, 'holder')]"
            _wait(browser, lambda d: d.find_element(By.XPATH, row).text.startswith(leader))
            browser.execute_script("window.pgcoordMarker = 'not reloaded'")
            killed = time.monotonic()
            procs[leader].send_signal(signal.SIGKILL)
            follower = next(label for label in procs if label != leader)
            _wait(browser, lambda d: d.find_element(By.XPATH, row).text.startswith(follower), 4.0)
            shown_after = time.monotonic() - killed
            assert browser.execute_script("return window.pgcoordMarker") == "not reloaded"
            assert shown_after < 2.0, f"the new leader showed {shown_after:.2f} s after the kill"
            # the term the kill ended is in the page's history, ended with its session
            _wait(browser, lambda d: "session ended" in _text(d), 4.0)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait(10)


def test_the_pause_button_pauses_a_schedule(dsn: str, browser: WebDriver) -> None:
    job = unique("browser-pause")
    sql(dsn, "select pgcoord.schedule_add(%s, 'h', '0 0 * * *', 'UTC', '{}'::jsonb, '{}'::jsonb)", job)
    with serving(pgcoord.web.app(dsn, access=lambda request: "all"), browser) as url:
        browser.get(url + "/schedules/" + quote(job, safe=""))
        browser.find_element(By.XPATH, "//button[normalize-space()='Pause']").click()
        _wait(browser, lambda d: d.find_elements(By.XPATH, "//button[normalize-space()='Resume']"))
        assert sql(dsn, "select paused from pgcoord.schedules where name = %s", job) == [(True,)]
        browser.find_element(By.XPATH, "//button[normalize-space()='Resume']").click()
        _wait(browser, lambda d: d.find_elements(By.XPATH, "//button[normalize-space()='Pause']"))
        assert sql(dsn, "select paused from pgcoord.schedules where name = %s", job) == [(False,)]


def test_the_browser_meets_401_and_403(dsn: str, browser: WebDriver, monkeypatch: pytest.MonkeyPatch) -> None:
    job = unique("browser-ro")
    sql(dsn, "select pgcoord.schedule_add(%s, 'h', '0 0 * * *', 'UTC', '{}'::jsonb, '{}'::jsonb)", job)
    monkeypatch.setenv("PGCOORD_WEB_USER", "ops")
    monkeypatch.setenv("PGCOORD_WEB_PASSWORD", "pw")
    with serving(pgcoord.web.app(dsn), browser) as url:
        browser.get_log("performance")  # drop what came before
        browser.get(url + "/")
        assert _status(browser, url + "/") == 401  # chromium asks for credentials, shows nothing
        authed = url.replace("http://", "http://ops:pw@")
        browser.get(authed + "/schedules/" + quote(job, safe=""))
        button = browser.find_element(By.XPATH, "//button[normalize-space()='Pause']")
        assert button.get_attribute("disabled") is not None  # read-only: shown, not usable
        browser.execute_script("arguments[0].disabled = false; arguments[0].click()", button)
        _wait(browser, lambda d: "403" in _text(d))
        assert "this dashboard is read-only for you" in _text(browser)
        assert sql(dsn, "select paused from pgcoord.schedules where name = %s", job) == [(False,)]
