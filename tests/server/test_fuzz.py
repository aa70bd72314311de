"""A property-based fuzz of the HTTP API, generated from the app's own OpenAPI schema by schemathesis,
run in-process against the ASGI app over the session's model.

Each operation gets a fixed, small number of generated requests (valid and invalid bodies from the
schema, derandomized so a run is repeatable), with Hypothesis' deadline off: a model call's time is
not what is tested. Every response must hold:
- no 5xx;
- every 4xx has the one error body, `{"error": {"message", "type", "param", "code"}}`, both as the
  schema documents it (schemathesis' response_schema_conformance) and as errors.py states it;
- no message speaks Python or native code to an HTTP client (SDK arguments, tracebacks, panics).
"""

from __future__ import annotations

import json

import pytest

from foveal.server import create_app

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is in the dev extra")
from hypothesis import HealthCheck, Phase, settings  # noqa: E402 (schemathesis brings hypothesis)
from schemathesis.checks import not_a_server_error, response_schema_conformance  # noqa: E402

EXAMPLES_PER_OPERATION = 12
# Text an HTTP client must never read in an error: SDK arguments, Python and Rust internals.
FORBIDDEN = (
    "pass image=",
    "image=None",
    "device='",
    "foveal.load",
    "grammars.",
    "settings['",
    "Traceback",
    "panicked at",
    "<backtrace>",
    "/rustc/",
)


def _never_called() -> None:
    raise AssertionError("this app only gives its OpenAPI schema; it never starts")


# The schema does not depend on the model: an app that never starts gives it at import, so the
# operations are known at collection; the requests go to `app`, over the session's model.
# Phases: the schema's examples, then generated requests (a fixed number per operation); not the
# coverage phase, whose count of boundary cases grows with the schema (a hundred and more each).
CONFIG = {"seed": 0, "phases": {"coverage": {"enabled": False}, "stateful": {"enabled": False}}}
OPENAPI = create_app(loader=_never_called).openapi()
schema = schemathesis.openapi.from_dict(OPENAPI, config=schemathesis.Config.from_dict(CONFIG))


@pytest.fixture(scope="module")
def app(model):
    return create_app(model)


def error_body_shape(ctx, response, case) -> None:
    """A 4xx answers errors.py's body, in HTTP terms."""
    if not 400 <= response.status_code < 500:
        return
    assert response.headers.get("content-type", [""])[0].startswith("application/json"), response.headers
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"].endswith("_error"), error
    assert isinstance(error["code"], str) and error["code"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert not any(text in error["message"] for text in FORBIDDEN), error["message"]


@schema.parametrize()
@settings(
    max_examples=EXAMPLES_PER_OPERATION,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)
def test_every_answer_is_a_success_or_the_error_body(case, app):
    case.call_and_validate(
        app=app, checks=[not_a_server_error, response_schema_conformance, error_body_shape]
    )


def test_the_schema_documents_the_error_body_and_whole_example_requests():
    """What the fuzz builds its requests from: every operation documents the error body (and not
    FastAPI's default 422 `detail`), and foveal's bodies give the settings' keys and valid examples."""
    jsonschema = pytest.importorskip("jsonschema")
    components = OPENAPI["components"]["schemas"]
    assert "HTTPValidationError" not in components
    error_body = {"$ref": "#/components/schemas/ErrorBody"}
    for operations in OPENAPI["paths"].values():
        for operation in operations.values():
            responses = operation["responses"]
            assert "422" not in responses
            for status in ("4XX", "5XX"):
                assert responses[status]["content"]["application/json"]["schema"] == error_body
    for name, skill in (
        ("CaptionBody", "caption"),
        ("QueryBody", "query"),
        ("DetectBody", "detect"),
        ("PointBody", "point"),
        ("GenerateBody", "generate"),
    ):
        body = components[name]
        accepted = body["properties"]["settings"]["anyOf"][0]
        assert accepted["additionalProperties"] is False
        assert {"temperature", "top_p", "max_tokens", "seed"} <= set(accepted["properties"])
        assert ("max_objects" in accepted["properties"]) == (skill in ("detect", "point"))
        assert body["examples"]
        for example in body["examples"]:
            jsonschema.validate(example, {**body, "components": OPENAPI["components"]})


# The chat route's streamed form: the same generated bodies with `stream: true`. Each answer is the
# error body before any event (a 4xx, as the same body without stream gets), or a 200 event stream
# whose every event is a chunk or an error object, ending with `data: [DONE]`.
chat_route = schema.include(path="/v1/chat/completions", method="POST")


def sse_events(text: str) -> list[str]:
    return [line.removeprefix("data: ") for line in text.split("\n\n") if line.startswith("data: ")]


@chat_route.parametrize()
@settings(
    max_examples=EXAMPLES_PER_OPERATION,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=list(HealthCheck),
)
def test_every_streamed_chat_answer_is_events_to_done_or_the_error_body(case, app):
    if isinstance(case.body, dict):
        case.body = {**case.body, "stream": True}
    response = case.call(app=app)
    case.validate_response(response, checks=[not_a_server_error, error_body_shape])
    if response.status_code != 200:
        return
    assert response.headers["content-type"].startswith("text/event-stream"), response.headers
    *events, done = sse_events(response.text)
    assert done == "[DONE]", response.text[-400:]
    for event in map(json.loads, events):
        assert event.get("object") == "chat.completion.chunk" or set(event) == {"error"}, event
