"""`foveal serve`: foveal's `Model` over HTTP, speaking Moondream's REST API and OpenAI's chat API.

    foveal serve [--model PATH] [--host 127.0.0.1] [--port 2020] [--api-key KEY]

Routes (app.py assembles them):
    POST /v1/caption /v1/query /v1/detect /v1/point   Moondream's REST API (moondream_api.py)
    POST /v1/chat/completions, GET /v1/models          OpenAI's chat API (openai_api.py)
    POST /v1/generate                                   foveal's structured call (generate_api.py)
    GET  /health /metrics /                             operations and the playground page (ops.py)

The server is a thin layer over `Model`: settings, image decoding and result shapes are the SDK's;
this package only moves JSON in and out, maps the SDK's exceptions to HTTP statuses (errors.py)
and owns what only a server has: auth, body limits, admission, disconnects, metrics.

Why FastAPI + uvicorn: the SDK already has async twins of every skill (`adetect`, `acaption`,
...), so an asyncio server serves many requests from one event loop with no thread per request;
FastAPI adds typed request bodies (pydantic, already a foveal dependency) on top of Starlette's
streaming responses, and uvicorn is the standard ASGI server with graceful SIGINT/SIGTERM
shutdown built in.
"""

from foveal.server.app import create_app
from foveal.server.config import ServerConfig

__all__ = ["ServerConfig", "create_app"]
