"""The playground page in a real headless Chromium (Debian's `chromium`, driven by Playwright through
the installed binary: Playwright's own browser download is not used). It uploads a generated scene,
runs detect, and checks the boxes drawn on the canvas against the JSON shown; the screenshot is
saved under pytest's tmp dir (its path is printed)."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from tests.server.conftest import scene

CHROMIUM = os.environ.get("FOVEAL_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the dev extra")
    if not os.path.exists(CHROMIUM):
        pytest.skip(
            f"no Chromium at {CHROMIUM}: apt-get install -y chromium (.ci/run does), or set FOVEAL_CHROMIUM"
        )
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        yield launched
        launched.close()


def run_in_page(browser, server, tmp_path, image, skill, object=None):
    """The playground page after it uploaded `image` and ran `skill` on it."""
    picture = tmp_path / "scene.png"
    image.save(picture)
    page = browser.new_page()
    page.goto(server + "/")
    page.set_input_files("#file", str(picture))
    page.wait_for_function("document.getElementById('status').textContent.startsWith('scene.png')")
    page.select_option("#skill", skill)
    if object is not None:
        page.fill("#object", object)
    page.click("#run")
    page.wait_for_function("document.getElementById('status').textContent.startsWith('done')", timeout=60_000)
    return page


def test_detect_draws_the_boxes_of_its_json(browser, server, tmp_path):
    page = run_in_page(browser, server, tmp_path, scene(11, 200), "detect", object="shape")
    result = json.loads(page.text_content("#json"))
    drawn = json.loads(page.get_attribute("#canvas", "data-boxes"))
    width = int(page.get_attribute("#canvas", "width"))
    height = int(page.get_attribute("#canvas", "height"))
    assert len(result["objects"]) >= 1 and len(drawn) == len(result["objects"])
    for box, (x, y, w, h) in zip(result["objects"], drawn, strict=True):
        assert abs(x - box["x_min"] * width) <= 1 and abs(y - box["y_min"] * height) <= 1
        assert abs(x + w - box["x_max"] * width) <= 1 and abs(y + h - box["y_max"] * height) <= 1
    # the box outline is on the canvas: the pixel at a box's top-left corner is the stroke colour
    x, y = drawn[0][0], drawn[0][1]
    rgba = page.evaluate(
        f"Array.from(document.getElementById('canvas').getContext('2d').getImageData({x}, {y}, 1, 1).data)"
    )
    assert rgba[:3] == [255, 0, 255]
    shot = tmp_path / "playground-detect.png"
    page.screenshot(path=str(shot), full_page=True)
    print(f"screenshot: {shot}")


def test_caption_streams_into_the_page(browser, server, tmp_path):
    page = run_in_page(browser, server, tmp_path, scene(4, 160), "caption")
    caption = json.loads(page.text_content("#json"))["caption"]
    assert caption and page.text_content("#text") == caption
