"""A Model shared by threads, batch helpers and asyncio: same answers as sequential calls, batched
in one engine, results in input order, one failed image reported without losing the others."""

from __future__ import annotations

import asyncio
import io
import threading

import pytest

import foveal
from foveal.vision import ImageError

HOT = {"temperature": 1.0, "top_p": 0.95}


def calls(images):
    """16 seeded, sampled calls of every skill (each seed distinct, so answers differ)."""
    out = []
    for i in range(16):
        image = images[i % len(images)]
        settings = {**HOT, "seed": 100 + i}
        kind = i % 4
        if kind == 0:
            out.append(("detect", (image, "red circle", {**settings, "max_objects": 3, "max_tokens": 40})))
        elif kind == 1:
            out.append(("point", (image, "square", {**settings, "max_objects": 3, "max_tokens": 40})))
        elif kind == 2:
            out.append(("caption", (image, "short", False, {**settings, "max_tokens": 12})))
        else:  # query's third positional is `reasoning` (the reference's order), aquery's `stream`
            out.append(("query", (image, "how many?", Settings({**settings, "max_tokens": 12}))))
    return out


class Settings(dict):
    """A call's settings passed by keyword (query and aquery order their other arguments differently)."""


def _positional(args: tuple) -> tuple:
    return tuple(a for a in args if not isinstance(a, Settings))


def _keywords(args: tuple) -> dict:
    found = [dict(a) for a in args if isinstance(a, Settings)]
    return {"settings": found[0]} if found else {}


def _run(model, call):
    """The result as a plain dict, or the error as text: a failure (an answer cut off by max_tokens)
    must repeat exactly too. A grammar violation is never an acceptable failure."""
    skill, args = call
    try:
        return dict(getattr(model, skill)(*_positional(args), **_keywords(args)))
    except foveal.GenerationError as error:
        assert "refused token" not in str(error), error  # the mask must make violations impossible
        return f"GenerationError: {error}"


def test_eight_threads_give_the_sequential_answers(shapes_model, images):
    work = calls(images)
    sequential = [_run(shapes_model, c) for c in work]
    assert len({repr(r) for r in sequential}) > 4  # the seeds really make different answers
    assert sum(isinstance(r, dict) for r in sequential) >= 12
    results: list = [None] * len(work)
    barrier = threading.Barrier(8)

    def worker(t: int) -> None:
        barrier.wait()
        for i in range(t, len(work), 8):
            results[i] = _run(shapes_model, work[i])

    shapes_model.engine.reset_stats()
    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert results == sequential
    stats = shapes_model.engine.stats()
    rows = stats["decode_rows"] + stats["prefill_rows"]
    assert rows > 2 * stats["steps"]  # sequences of several threads shared steps (one by one: ~1 per step)


def test_concurrent_streams_each_get_their_own_text(shapes_model, images):
    settings = {**HOT, "max_tokens": 16}
    whole = [
        shapes_model.caption(im, settings={**settings, "seed": i})["caption"] for i, im in enumerate(images)
    ]
    joined: list = [None] * len(images)

    def worker(i: int) -> None:
        stream = shapes_model.caption(images[i], stream=True, settings={**settings, "seed": i})["caption"]
        joined[i] = "".join(stream)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(images))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert joined == whole


# ---- batch helpers --------------------------------------------------------------------------------------------


def _corrupt(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()[:60]


def test_a_list_of_images_returns_results_in_input_order(shapes_model, images):
    settings = {"max_objects": 3}
    many = [images[i % 4] for i in range(20)]  # more than the engine's window of requests in flight
    one_by_one = [shapes_model.detect(im, "circle", settings) for im in images]
    assert len({repr(r) for r in one_by_one}) > 1  # answers differ per image, so the order is checked
    batch = shapes_model.detect(many, "circle", settings)
    assert batch == [one_by_one[i % 4] for i in range(20)]


def test_one_failed_image_is_reported_in_its_place(shapes_model, images, capsys):
    inputs = [images[0], _corrupt(images[1]), "/no/such/image.png", images[2]]
    results = shapes_model.map("point", inputs, "star", settings={"max_objects": 2}, progress=True)
    assert isinstance(results[1], ImageError) and "corrupt" in str(results[1])
    assert isinstance(results[2], ImageError) and "not found" in str(results[2])
    assert results[0] == shapes_model.point(images[0], "star", {"max_objects": 2})
    assert results[3] == shapes_model.point(images[2], "star", {"max_objects": 2})
    assert "4/4" in capsys.readouterr().err  # the tqdm bar counted every image, failed ones too


def test_map_takes_any_iterable_and_every_skill(shapes_model, images):
    captions = shapes_model.map(
        "caption", iter(images[:2]), length="short", settings={"max_tokens": 4}, progress=False
    )
    assert captions == [shapes_model.caption(im, "short", settings={"max_tokens": 4}) for im in images[:2]]
    spec = foveal.Regex("[a-z]{2}")
    generated = shapes_model.map("generate", images[:2], "two letters", spec, progress=False)
    assert [g["output"] for g in generated] == [
        shapes_model.generate(im, "two letters", spec)["output"] for im in images[:2]
    ]


def test_bad_arguments_to_a_batch_raise_before_any_image(shapes_model, images, monkeypatch):
    submitted = []
    monkeypatch.setattr(shapes_model.engine, "submit", lambda r: submitted.append(r))
    with pytest.raises(ValueError, match="object is empty"):
        shapes_model.detect(images, "")
    with pytest.raises(ValueError, match="unknown setting"):
        shapes_model.map("detect", images, "car", settings={"colour": 1})
    with pytest.raises(TypeError, match="list"):
        shapes_model.map("detect", "not-a-list", "car")
    assert submitted == []


# ---- asyncio --------------------------------------------------------------------------------------------------


def test_async_calls_give_the_sequential_answers(shapes_model, images):
    work = calls(images)
    sequential = [_run(shapes_model, c) for c in work]

    async def main():
        coros = [getattr(shapes_model, "a" + skill)(*_positional(args), **_keywords(args)) for skill, args in work]
        out = await asyncio.gather(*coros, return_exceptions=True)
        return [f"GenerationError: {r}" if isinstance(r, foveal.GenerationError) else dict(r) for r in out]

    assert asyncio.run(main()) == sequential


def test_async_stream_and_async_batch(shapes_model, images):
    whole = shapes_model.query(images[0], "what?", settings={"max_tokens": 10})["answer"]

    async def main():
        result = await shapes_model.aquery(images[0], "what?", stream=True, settings={"max_tokens": 10})
        chunks = [c async for c in result["answer"]]
        batch = await shapes_model.adetect([images[0], b"junk"], "x", {"max_objects": 2})
        return chunks, batch

    chunks, batch = asyncio.run(main())
    assert "".join(chunks) == whole
    assert batch[0] == shapes_model.detect(images[0], "x", {"max_objects": 2})
    assert isinstance(batch[1], ImageError)


def test_async_bad_input_raises_and_cancel_frees_the_sequence(shapes_model, images):
    async def bad():
        await shapes_model.adetect(images[0], "")

    with pytest.raises(ValueError, match="object is empty"):
        asyncio.run(bad())

    async def cancelled():
        task = asyncio.ensure_future(shapes_model.acaption(images[0], settings={"max_tokens": 200}))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancelled())
    assert shapes_model.engine.wait_idle(10)
    assert shapes_model.engine.free_pages() == shapes_model.config.num_pages
