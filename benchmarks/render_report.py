"""Render a plan's HTML report in headless Chromium and save a screenshot,
to check that the self-contained page draws (no network needed).

    python -m autoparallel report plan.json -o report.html
    python benchmarks/render_report.py report.html -o docs/report.png

Prints what it did; exits 0 without a screenshot when no Chromium is
installed (``apt-get install -y chromium``). With ``pngquant`` installed
the PNG is quantised to 256 colours (a page of text and flat charts: about
half the bytes, no visible change)."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("html")
    ap.add_argument("-o", "--output", default="report.png")
    ap.add_argument("--size", default="1280,2400", help="window width,height in pixels (default: 1280,2400)")
    a = ap.parse_args(argv)
    browser = next(
        (shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None
    )
    if browser is None:
        print("no Chromium found: install it (apt-get install -y chromium) to render the report")
        return 0
    cmd = [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        f"--window-size={a.size}",
        f"--screenshot={os.path.abspath(a.output)}",
        "file://" + os.path.abspath(a.html),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0 or not os.path.exists(a.output):
        print(proc.stderr[-2000:], file=sys.stderr)
        return 1
    if shutil.which("pngquant"):
        subprocess.run(["pngquant", "--force", "--quality", "60-90", "--output", a.output, a.output], check=False)
    print(f"rendered {a.html} with {os.path.basename(browser)}: {a.output} ({os.path.getsize(a.output)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
