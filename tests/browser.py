"""Headless Chromium through Selenium: for the live-view test and scripts/screenshot.py."""

from __future__ import annotations

import os
import shutil
import tempfile

INSTALL_HINT = (
    "needs Chromium, its driver and Selenium: apt-get install -y chromium chromium-driver && pip install -e '.[test]'"
)


def missing() -> str | None:
    """Why a browser cannot be started here, or None if it can."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed; " + INSTALL_HINT
    if not shutil.which("chromedriver") or not (shutil.which("chromium") or shutil.which("chromium-browser")):
        return "chromium or chromedriver is not on PATH; " + INSTALL_HINT
    return None


class Browser:
    """A headless Chromium with a fresh profile, removed on close. Console messages are kept."""

    def __init__(self, width: int = 1440, height: int = 900):
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        self.profile = tempfile.mkdtemp(prefix="minfer-chromium-")
        options = webdriver.ChromeOptions()
        # Without the background-networking flags Chromium keeps trying to reach Google's servers.
        for flag in [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-dev-shm-usage",
            f"--user-data-dir={self.profile}",
            f"--window-size={width},{height}",
        ]:
            options.add_argument(flag)
        options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
        service = Service(shutil.which("chromedriver"))
        self.driver = webdriver.Chrome(options=options, service=service)

    def set_viewport(self, width: int, height: int) -> None:
        """Size the window so that the page itself gets width x height pixels."""
        inner = self.js("return [window.innerWidth, window.innerHeight]")
        size = self.driver.get_window_size()
        self.driver.set_window_size(size["width"] + width - inner[0], size["height"] + height - inner[1])

    def js(self, script: str, *args):
        return self.driver.execute_script(script, *args)

    def wait_until(self, script: str, timeout: float = 30.0, what: str = ""):
        """Poll a JS expression (`return ...`) until it is truthy; returns its value."""
        from selenium.webdriver.support.ui import WebDriverWait

        return WebDriverWait(self.driver, timeout, poll_frequency=0.05).until(
            lambda d: d.execute_script(script), message=what or script
        )

    def console_errors(self) -> list[dict]:
        return [entry for entry in self.driver.get_log("browser") if entry["level"] == "SEVERE"]

    def close(self) -> None:
        try:
            self.driver.quit()
        finally:
            shutil.rmtree(self.profile, ignore_errors=True)


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1")
