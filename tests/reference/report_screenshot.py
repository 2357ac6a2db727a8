#!/usr/bin/python3
"""`dstrain report` seen by a browser: trains two short runs, makes their report, and has
headless Chromium draw it (Debian's chromium; Pillow reads the PNGs).

Checks:
  1. the whole page (1200x2400): not blank, and each run's colour, the entropy floor's colour
     and the memory bars' layer colours are drawn;
  2. each line chart alone (an <svg> of the page in an empty page at scale 1, so a screenshot
     pixel is an SVG unit): at the points of every series (its <path> coordinates) the pixels
     have the series' colour: at least half the points of each series in its own colour, and
     90% of all points in their own colour or that of a line drawn later (which covers an
     earlier one where they meet).

Usage: report_screenshot.py DSTRAIN WORK_DIR [--save-page PNG]
Exit 77 (skipped) where chromium or Pillow is not installed (scripts/install-test-references.sh).
"""
import html
import os
import re
import shutil
import subprocess
import sys

SKIP = 77


def chromium():
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    return None


def screenshot(browser, page, png, width, height):
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    "--force-device-scale-factor=1", f"--screenshot={png}",
                    f"--window-size={width},{height}", "file://" + os.path.abspath(page)],
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)


def rgb(color):
    return tuple(int(color[i:i + 2], 16) for i in (1, 3, 5))


def near(a, b, tolerance=24):
    return all(abs(x - y) <= tolerance for x, y in zip(a, b))


def count_color(image, color):
    target = rgb(color)
    return sum(n for n, pixel in image.getcolors(1 << 24) if near(pixel[:3], target, 6))


def check_page(Image, png, colors):
    image = Image.open(png).convert("RGB")
    counts = image.getcolors(1 << 24)
    background = max(counts)[0]
    total = image.width * image.height
    assert background < 0.97 * total, f"the page is blank: {background} of {total} pixels one colour"
    for name, color, least in colors:
        n = count_color(image, color)
        print(f"  page: {n} pixels of {name} {color}")
        assert n >= least, f"{name} ({color}): {n} pixels, expected at least {least}"


def attribute(tag, name):
    match = re.search(r'\s' + name + r'="([^"]*)"', tag)
    return html.unescape(match.group(1)) if match else None


def check_chart(Image, browser, svg, work, index):
    """The pixels at each series' points have its colour (the chart drawn alone)."""
    head = svg[:svg.index(">") + 1]
    width, height = int(float(attribute(head, "width"))), int(float(attribute(head, "height")))
    page = os.path.join(work, f"chart{index}.html")
    with open(page, "w") as out:
        out.write('<!DOCTYPE html><html><body style="margin:0">' + svg + "</body></html>")
    png = os.path.join(work, f"chart{index}.png")
    screenshot(browser, page, png, width, height)
    image = Image.open(png).convert("RGB")
    title = attribute(head, "data-title")
    series = [(attribute(path, "data-label"), rgb(attribute(path, "stroke")),
               [float(v) for v in re.findall(r"-?\d+\.\d+", attribute(path, "d"))])
              for path in re.findall(r'<path class="series"[^>]*>', svg)]
    seen_all = points_all = 0
    for index, (label, color, numbers) in enumerate(series):
        later_colors = [later[1] for later in series[index + 1:]]
        points = list(zip(numbers[0::2], numbers[1::2]))
        own = seen = 0
        for x, y in points:
            window = [image.getpixel((min(max(int(round(x)) + dx, 0), image.width - 1),
                                      min(max(int(round(y)) + dy, 0), image.height - 1)))
                      for dx in range(-2, 3) for dy in range(-2, 3)]
            mine = any(near(pixel, color) for pixel in window)
            own += mine
            # A line drawn later may cover this one where they meet.
            seen += mine or any(near(pixel, c) for pixel in window for c in later_colors)
        print(f"  {title}: {label}: {own} of {len(points)} points in its colour, "
              f"{seen - own} more under a later line")
        assert points and own >= 0.5 * len(points), f"{title}: {label}: {own} of {len(points)}"
        seen_all += seen
        points_all += len(points)
    assert points_all > 0 and seen_all >= 0.9 * points_all, f"{title}: {seen_all} of {points_all}"


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    dstrain, work = sys.argv[1], sys.argv[2]
    save_page = sys.argv[4] if len(sys.argv) > 4 and sys.argv[3] == "--save-page" else None
    browser = chromium()
    if not browser:
        print("chromium is not installed (scripts/install-test-references.sh): skipped")
        return SKIP
    try:
        from PIL import Image
    except ImportError:
        print("Pillow (python3-pil) is not installed (scripts/install-test-references.sh): skipped")
        return SKIP
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    # Two runs whose curves differ (model, learning rate), so that neither hides the other.
    common = ["--device", "cpu", "--steps", "40", "--eval-every", "10", "--sample", "0", "--quiet"]
    for flags in (["--gpus", "2", "--pp", "2", "--log", "pp.jsonl"],
                  ["--model", "llama-tiny", "--gpus", "2", "--lr", "0.002", "--warmup", "10",
                   "--log", "llama.jsonl"]):
        subprocess.run([dstrain] + flags + common, cwd=work, check=True, stdout=subprocess.DEVNULL)
    subprocess.run([dstrain, "report", "pp.jsonl", "llama.jsonl", "--out", "report.html"],
                   cwd=work, check=True)
    with open(os.path.join(work, "report.html")) as f:
        report = f.read()
    png = os.path.join(work, "report.png")
    screenshot(browser, os.path.join(work, "report.html"), png, 1200, 2400)
    # The colours report.cpp gives: runs (Tableau 10), the entropy floor, the first layers.
    check_page(Image, png, [("run 1", "#1f77b4", 500), ("run 2", "#ff7f0e", 500),
                            ("the entropy floor", "#444444", 50),
                            ("memory layer 1", "#8dd3c7", 20), ("memory layer 2", "#fdb462", 20)])
    svgs = re.findall(r"<svg .*?</svg>", report, re.S)
    line_charts = [svg for svg in svgs if 'class="series"' in svg]
    assert len(line_charts) >= 4, f"{len(line_charts)} line charts in the report"
    for index, svg in enumerate(line_charts):
        check_chart(Image, browser, svg, work, index)
    if save_page:
        shutil.copyfile(png, save_page)
    print("report screenshot: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
