"""Screenshots of the web UI for docs/: the chat page with real answers, the dashboard under load, the calculator.

Starts `pagoda serve` on the built-in model (a free loopback port), asks the chat page a question at
temperature 0, then keeps a few streamed requests running for --load-seconds and photographs the dashboard
while they run. Needs Playwright (the `dev` extra) and a Chromium binary (Debian: `apt-get install chromium`).

    .venv/bin/python scripts/screenshots.py            # writes docs/web-ui-{chat,dashboard,calc}.png
    .venv/bin/python scripts/screenshots.py --pages calc
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from playwright.sync_api import Page, sync_playwright

ROOT = Path(__file__).resolve().parent.parent
# The built-in model was trained on single questions (a longer conversation confuses it): one exchange.
QUESTION = "Reverse the list: denver, gray, tacos, riga"
# The dashboard's load: a shared system prompt (prefix-cache hits) and answers of a few lengths.
LOAD_SYSTEM = "You are pagoda's demo model. Answer the user's question."
LOAD_QUESTIONS = ("Count the items: pony, figs, parrot", "Copy this text: perth", "Add 405 and 60.")
CHAT_VIEWPORT = {"width": 1280, "height": 600}
DASHBOARD_VIEWPORT = {"width": 1280, "height": 720}  # the whole dashboard: tiles and six charts
CALC_VIEWPORT = {"width": 1280, "height": 900}
CALC_BATCH = "32"
PAGES = ("chat", "dashboard", "calc")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(port: int, log_path: Path) -> subprocess.Popen:
    # One thread: on a small shared machine a second one makes this tiny model's matmuls far slower.
    command = [sys.executable, "-m", "pagoda", "serve", "--host", "127.0.0.1", "--port", str(port), "--threads", "1"]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"pagoda serve exited with {process.returncode}; see {log_path}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.terminate()
    raise SystemExit(f"pagoda serve did not become ready; see {log_path}")


def chat_screenshot(page: Page, url: str, out: Path) -> None:
    page.goto(f"{url}/")
    page.wait_for_function("() => document.getElementById('model-name').textContent !== '…'")
    page.fill("#temperature", "0")
    page.fill("#max-tokens", "64")
    page.fill("#prompt", QUESTION)
    page.press("#prompt", "Enter")
    page.locator(".message.assistant").and_(page.locator("[data-state=done]")).wait_for()
    page.screenshot(path=str(out))


def keep_busy(url: str, stop: threading.Event, worker: int) -> None:
    """Streamed chat requests one after another until `stop`: long ones (ignore_eos) and short ones."""
    number = 0
    with httpx.Client(base_url=url, timeout=120) as http:
        while not stop.is_set():
            question = LOAD_QUESTIONS[(worker + number) % len(LOAD_QUESTIONS)]
            body = {"messages": [{"role": "system", "content": LOAD_SYSTEM}, {"role": "user", "content": question}],
                    "max_tokens": 64 + 96 * ((worker + number) % 4), "ignore_eos": number % 2 == 0,
                    "temperature": 0.7, "seed": number, "stream": True}
            with http.stream("POST", "/v1/chat/completions", json=body) as response:
                for _ in response.iter_lines():
                    if stop.is_set():
                        break
            number += 1


def dashboard_screenshot(page: Page, url: str, out: Path, load_seconds: float, workers: int) -> None:
    page.set_viewport_size(DASHBOARD_VIEWPORT)
    page.goto(f"{url}/dashboard")
    stop = threading.Event()
    threads = [threading.Thread(target=keep_busy, args=(url, stop, w), daemon=True) for w in range(workers)]
    for thread in threads:
        thread.start()
        time.sleep(load_seconds / (2 * workers))  # staggered: the request count climbs, then holds
    time.sleep(load_seconds / 2)
    page.wait_for_function("() => document.querySelector('#running .value').textContent !== '0'")
    page.wait_for_timeout(1500)  # one more poll, so every chart holds the latest numbers
    page.screenshot(path=str(out))
    stop.set()
    for thread in threads:
        thread.join(30)


def calc_screenshot(page: Page, url: str, out: Path) -> None:
    page.set_viewport_size(CALC_VIEWPORT)
    page.goto(f"{url}/calc")
    page.wait_for_function("() => document.body.dataset.calcSequence !== undefined")
    page.locator("#batch").evaluate(f"(slider) => {{ slider.value = '{CALC_BATCH}'; "
                                    "slider.dispatchEvent(new Event('input', {bubbles: true})); }")
    page.wait_for_function("(batch) => [...document.querySelectorAll('.calc-part h2')]"
                           ".some((h) => h.textContent === `Roofline (decode, batch ${batch})`)", arg=CALC_BATCH)
    page.screenshot(path=str(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", type=Path, default=ROOT / "docs")
    parser.add_argument("--chromium", default=shutil.which("chromium") or shutil.which("chromium-browser"))
    parser.add_argument("--load-seconds", type=float, default=60.0)
    parser.add_argument("--workers", type=int, default=3, help="concurrent streamed requests for the dashboard")
    parser.add_argument("--pages", default=",".join(PAGES), help=f"which, comma-separated ({', '.join(PAGES)})")
    args = parser.parse_args()
    pages = args.pages.split(",")
    if set(pages) - set(PAGES):
        raise SystemExit(f"--pages: choose among {', '.join(PAGES)}")
    if not args.chromium:
        raise SystemExit("no chromium binary: apt-get install chromium, or pass --chromium")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = Path(tempfile.mkdtemp(prefix="pagoda-screenshots-")) / "server.log"
    server = start_server(port, log_path)
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=args.chromium, headless=True)
            page = browser.new_page(viewport=CHAT_VIEWPORT)
            page.set_default_timeout(120_000)
            if "chat" in pages:
                chat_screenshot(page, url, args.out_dir / "web-ui-chat.png")
            if "dashboard" in pages:
                dashboard_screenshot(page, url, args.out_dir / "web-ui-dashboard.png", args.load_seconds,
                                     args.workers)
            if "calc" in pages:
                calc_screenshot(page, url, args.out_dir / "web-ui-calc.png")
            browser.close()
    finally:
        server.terminate()
        server.wait(30)
    print("wrote " + ", ".join(str(args.out_dir / f"web-ui-{name}.png") for name in pages))


if __name__ == "__main__":
    main()
