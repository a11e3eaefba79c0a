"""The picture of the dashboard under load (docs/serving.md): docs/dashboard.png.

    python scripts/dashboard_screenshot.py [--seconds 75] [--out docs/dashboard.png]

Serves the embedded model on a small pool with a little swap space, drives a mixed load for a while
(prompts on three shared prefixes, n of 1 to 3, long and short answers, enough to preempt and swap), hovers
a shared page so its tooltip shows, and saves headless Chromium's screenshot as a 128-colour PNG.
Needs Debian's chromium and chromium-driver.
"""

from __future__ import annotations

import argparse
import base64
import json
import random
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
from PIL import Image
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagegate.core.page_map import MAX_REFCOUNT, rle_decode  # noqa: E402
from pagegate.testing.launcher import ServerProcess  # noqa: E402

SERVER_ARGS = ["--dtype", "float32", "--device", "cpu", "--grpc-port", "0", "--disable-uvicorn-access-log",
               "--num-kv-blocks", "480", "--swap-space", "0.02", "--max-num-seqs", "40", "--max-model-len", "1024"]
PREFIXES = ["And God said, Let there be light: and there was light. " * 5,
            "In the beginning was the Word, and the Word was with God. " * 4,
            "The LORD is my shepherd; I shall not want. He maketh me to lie down in green pastures. " * 3]


def client_loop(base_url: str, seed: int, until: float) -> None:
    rng = random.Random(seed)
    while time.monotonic() < until:
        body = {"prompt": rng.choice(PREFIXES) + f" Verse {rng.randint(1, 10_000)}:", "stream": True,
                "n": rng.choice([1, 1, 2, 3]), "max_tokens": rng.choice([60, 200, 400, 700]), "ignore_eos": True}
        try:
            with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=600) as response:
                for _ in response.iter_lines():
                    if time.monotonic() > until + 30:
                        break
        except httpx.HTTPError:
            time.sleep(0.5)
        time.sleep(rng.uniform(0, 0.3))


def hover_shared_page(driver: webdriver.Chrome, base_url: str) -> None:
    """Point at the first page with more than one holder, if any, so the tooltip lists them."""
    with httpx.stream("GET", base_url + "/dashboard/api/feed", timeout=30) as response:
        frame = json.loads(next(line[6:] for line in response.iter_lines() if line.startswith("data: ")))
    states = np.zeros(frame["total_pages"], dtype=np.uint8)
    rle_decode(base64.b64decode(frame["pages"]), states)
    shared = np.flatnonzero((states & MAX_REFCOUNT) > 1)
    page = int(shared[len(shared) // 2]) if len(shared) else 0
    grid = driver.find_element(By.ID, "device-grid")
    cols = int(grid.get_attribute("data-cols") or 1)
    cell = grid.size["width"] / cols
    x, y = (page % cols + 0.5) * cell - grid.size["width"] / 2, (page // cols + 0.5) * cell - grid.size["height"] / 2
    ActionChains(driver).move_to_element_with_offset(grid, int(x), int(y)).perform()
    time.sleep(0.8)


def browser() -> webdriver.Chrome:
    options = Options()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1280,1000", "--hide-scrollbars"):
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=Service("/usr/bin/chromedriver"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=75.0)
    parser.add_argument("--clients", type=int, default=14)
    parser.add_argument("--out", type=Path, default=Path("docs/dashboard.png"))
    args = parser.parse_args()
    with ServerProcess(SERVER_ARGS) as server:
        driver = browser()
        try:
            driver.get(server.base_url + "/dashboard")
            until = time.monotonic() + args.seconds
            clients = [threading.Thread(target=client_loop, args=(server.base_url, i, until), daemon=True)
                       for i in range(args.clients)]
            for thread in clients:
                thread.start()
            time.sleep(args.seconds)
            hover_shared_page(driver, server.base_url)
            raw = args.out.with_suffix(".raw.png")
            driver.save_screenshot(str(raw))
        finally:
            driver.quit()
    Image.open(raw).convert("RGB").quantize(colors=128, method=Image.Quantize.FASTOCTREE).save(args.out, optimize=True)
    raw.unlink()
    print(f"{args.out}: {args.out.stat().st_size // 1024} KiB")


if __name__ == "__main__":
    main()
