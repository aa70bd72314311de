"""PixelBudget: concurrent holders never pass the budget, grants always come back, waits are bounded."""

from __future__ import annotations

import io
import random
import threading
import time

import numpy as np
import pytest
from PIL import Image

from foveal.vision import ImageError, PixelBudget, PixelBudgetTimeout, images

LONG_S = 30.0  # waits that must end by a release, never by this timeout


def jpeg(width: int, height: int) -> bytes:
    rng = np.random.default_rng(0)
    small = rng.integers(0, 256, (height // 16, width // 16, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(small).resize((width, height)).save(buffer, "JPEG")
    return buffer.getvalue()


def wait_until(condition, what: str) -> None:
    """Poll until `condition()` (threads reach their wait); the deadline only catches a hang."""
    deadline = time.monotonic() + LONG_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.001)


def run_threads(target, count: int) -> list[BaseException]:
    errors: list[BaseException] = []

    def guarded(i: int) -> None:
        try:
            target(i)
        except BaseException as error:  # noqa: BLE001 - reported by the test
            errors.append(error)

    threads = [threading.Thread(target=guarded, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


# invariant 1: the budget holds


def test_concurrent_holders_never_exceed_the_budget():
    budget = PixelBudget(100, timeout_s=LONG_S)
    lock = threading.Lock()
    held = [0]
    most = [0]

    def worker(i: int) -> None:
        rng = random.Random(i)
        for _ in range(30):
            pixels = rng.randint(1, 60)
            with budget.hold(pixels):
                with lock:
                    held[0] += pixels
                    most[0] = max(most[0], held[0])
                time.sleep(rng.random() / 1000)  # overlap with the other holders
                with lock:
                    held[0] -= pixels

    assert run_threads(worker, 8) == []
    assert 60 < most[0] <= 100, "holders overlapped, within the budget"
    assert budget.stats()["peak"] <= 100
    assert budget.in_use == 0 and budget.waiting == 0


def test_load_holds_the_decode_then_the_decoded_image(monkeypatch):
    data = jpeg(4096, 3072)  # DCT-scaled to 512x384, then reduced to 256x192
    budget = PixelBudget(10**9)
    seen = []
    decode = images.OpenedImage.decode

    def spy(opened):
        seen.append((opened.decode_pixels, budget.in_use))
        return decode(opened)

    monkeypatch.setattr(images.OpenedImage, "decode", spy)
    with budget.load(data, min_size=(64, 64)) as decoded:
        assert budget.in_use == decoded.width * decoded.height == 256 * 192
    assert seen == [(512 * 384, 512 * 384)], "the JPEG decode's own pixels reserved while it ran"
    assert budget.in_use == 0


def test_concurrent_loads_of_large_images_stay_within_the_budget():
    data = jpeg(1024, 1024)
    budget = PixelBudget(2 * 1024 * 1024, timeout_s=LONG_S)  # two full decodes at a time

    def worker(i: int) -> None:
        with budget.load(data) as decoded:
            assert decoded.size == (1024, 1024)

    assert run_threads(worker, 6) == []
    assert budget.stats()["peak"] <= 2 * 1024 * 1024 and budget.in_use == 0


# images larger than the budget


def test_an_image_larger_than_the_budget_runs_alone():
    budget = PixelBudget(100)
    with budget.hold(150):
        assert budget.in_use == 150
        with pytest.raises(PixelBudgetTimeout):
            budget.acquire(1, timeout_s=0)
    with budget.hold(10), pytest.raises(PixelBudgetTimeout):
        budget.acquire(150, timeout_s=0.01)  # waits for everything else to be given back
    assert budget.in_use == 0


def test_an_oversized_waiter_is_granted_when_the_others_leave():
    budget = PixelBudget(100, timeout_s=LONG_S)
    lease = budget.acquire(30)
    granted = threading.Event()

    def big(_: int) -> None:
        with budget.hold(500):
            granted.set()

    thread = threading.Thread(target=big, args=(0,))
    thread.start()
    wait_until(lambda: budget.waiting == 1, "the big request waits")
    assert not granted.is_set()
    lease.release()
    thread.join()
    assert granted.is_set() and budget.in_use == 0


# invariant 3: arrival order


def test_a_large_waiter_is_not_overtaken_by_later_small_ones():
    budget = PixelBudget(100, timeout_s=LONG_S)
    order: list[str] = []
    lease = budget.acquire(60)

    def request(name: str, pixels: int) -> threading.Thread:
        def run() -> None:
            with budget.hold(pixels):
                order.append(name)

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    large = request("large", 80)
    wait_until(lambda: budget.waiting == 1, "the large request waits")
    small = request("small", 10)  # would fit now, but arrived later
    wait_until(lambda: budget.waiting == 2, "the small request waits behind it")
    assert order == []
    lease.release()
    large.join()
    small.join()
    assert order == ["large", "small"]


# invariant 2: every grant comes back


def test_release_on_exception_in_the_block():
    budget = PixelBudget(100)
    with pytest.raises(RuntimeError), budget.hold(70):
        raise RuntimeError("the processor failed")
    assert budget.in_use == 0
    with pytest.raises(RuntimeError), budget.load(jpeg(256, 256)):
        raise RuntimeError("the processor failed")
    assert budget.in_use == 0


def test_release_when_the_decode_fails():
    budget = PixelBudget(10**9)
    data = jpeg(512, 512)
    with pytest.raises(ImageError, match="corrupt"), budget.load(data[: len(data) // 3]):
        pass
    with pytest.raises(ImageError, match="over the limit"), budget.load(data, max_pixels=100):
        pass
    with pytest.raises(ImageError, match="cannot use an image of type"), budget.load(42):
        pass
    assert budget.in_use == 0 and budget.stats()["peak"] <= 512 * 512


def test_release_is_idempotent_and_shrink_gives_back():
    budget = PixelBudget(100)
    lease = budget.acquire(80)
    lease.shrink(30)
    assert budget.in_use == 30 and lease.pixels == 30
    lease.shrink(50)  # never grows
    assert budget.in_use == 30
    lease.release()
    lease.release()
    with lease:
        pass
    assert lease.released and budget.in_use == 0


def test_budgets_are_independent():
    one, other = PixelBudget(10), PixelBudget(10)
    with one.hold(10), other.hold(10):
        assert one.in_use == other.in_use == 10


# invariant 4: bounded waits


def test_timeout_raises_the_documented_error_and_leaves_the_queue():
    budget = PixelBudget(100, timeout_s=0.01)
    with budget.hold(90):
        with pytest.raises(PixelBudgetTimeout, match="retry later") as raised:
            budget.acquire(20)
        assert (raised.value.pixels, raised.value.max_pixels, raised.value.in_use) == (20, 100, 90)
        assert not isinstance(raised.value, ValueError), "a busy model is not a bad request (400)"
        assert budget.waiting == 0 and budget.stats()["timeouts"] == 1
        with budget.hold(10, timeout_s=0):  # what fits is granted at once, even with no wait
            assert budget.in_use == 100
    assert budget.in_use == 0


def test_a_waiter_that_times_out_lets_the_next_one_go():
    budget = PixelBudget(100, timeout_s=LONG_S)
    lease = budget.acquire(50)
    results: dict[str, object] = {}

    def blocked(_: int) -> None:  # first in the queue, cannot fit while the lease is held
        try:
            budget.acquire(80, timeout_s=0.05)
        except PixelBudgetTimeout as error:
            results["blocked"] = error

    first = threading.Thread(target=blocked, args=(0,))
    first.start()
    wait_until(lambda: budget.waiting == 1, "the first request waits")

    def fits(_: int) -> None:  # fits beside the lease, behind the first request
        with budget.hold(40):
            results["fits"] = True

    second = threading.Thread(target=fits, args=(0,))
    second.start()
    first.join()
    second.join()  # ends only because the timed-out head left the queue
    lease.release()
    assert isinstance(results["blocked"], PixelBudgetTimeout) and results["fits"] is True
    assert budget.in_use == 0 and budget.waiting == 0


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, None])
def test_bad_budget_sizes(bad):
    with pytest.raises(ValueError, match="max_pixels must be an int >= 1"):
        PixelBudget(bad)


@pytest.mark.parametrize("bad", [-1, float("inf"), float("nan"), None, "1"])
def test_bad_timeouts(bad):
    with pytest.raises(ValueError, match="timeout_s must be a finite number"):
        PixelBudget(10, timeout_s=bad)
    with pytest.raises(ValueError, match="timeout_s must be a finite number"):
        PixelBudget(10).acquire(1, timeout_s=bad if bad is not None else -1)


def test_bad_pixel_counts():
    with pytest.raises(ValueError, match="pixels must be an int >= 0"):
        PixelBudget(10).acquire(-1)
