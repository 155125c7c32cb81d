"""``asyncrl view``'s web server: the page, its script, Plotly's, and the run folder's data as JSON.

FastAPI (Starlette) for the routes and uvicorn to serve them: what vLLM's
own server is built on, so both come with a vLLM install. The charts are
Plotly's, its script served from the ``plotly`` Python package, so the page
works offline. Bound to loopback by default; bound anywhere else it needs a
token (``--token-file``), given once as ``?token=`` and kept in a cookie.
"""

from __future__ import annotations

import hmac
import logging
import threading
from pathlib import Path
from typing import Any

from asyncrl.launch.viewer.data import RunFolder
from asyncrl.wire.ports import is_loopback_host

log = logging.getLogger(__name__)
STATIC = Path(__file__).parent / "static"
COOKIE = "asyncrl_view_token"


def plotly_js() -> Path:
    import plotly

    return Path(plotly.__file__).parent / "package_data" / "plotly.min.js"


def make_app(run_dir: str | Path, token: str | None = None) -> Any:
    """The viewer's app for ``run_dir``; with ``token``, every request must carry it."""
    from fastapi import FastAPI, Request
    from fastapi.responses import FileResponse, JSONResponse

    run = RunFolder(run_dir)
    app = FastAPI(title="asyncrl view", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def check_token(request: Request, call_next):
        if token is None:
            return await call_next(request)
        given = request.query_params.get("token") or request.cookies.get(COOKIE) or ""
        if not hmac.compare_digest(given.encode(), token.encode()):
            return JSONResponse({"error": "this viewer needs its token: open it with ?token=..."}, status_code=401)
        response = await call_next(request)
        if request.query_params.get("token"):
            response.set_cookie(COOKIE, token, httponly=True, samesite="strict")
        return response

    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception):  # a reason, never a stack trace
        log.warning("asyncrl view: %s failed: %s", request.url.path, exc)
        return JSONResponse({"error": f"{type(exc).__name__}: {exc}"}, status_code=500)

    @app.get("/")
    def index() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    @app.get("/static/viewer.js")
    def script() -> FileResponse:
        return FileResponse(STATIC / "viewer.js", media_type="text/javascript")

    @app.get("/static/plotly.min.js")
    def plotly() -> FileResponse:
        return FileResponse(plotly_js(), media_type="text/javascript")

    @app.get("/api/overview")
    def overview() -> dict:
        return run.overview()

    @app.get("/api/curves")
    def curves() -> dict:
        return run.curves()

    @app.get("/api/pipeline")
    def pipeline() -> dict:
        return run.pipeline()

    @app.get("/api/rollouts")
    def rollouts(
        step: int | None = None,
        min_reward: float | None = None,
        max_reward: float | None = None,
        staleness: int | None = None,
        kept: str | None = None,
    ) -> dict:
        return run.rollouts(step, min_reward, max_reward, staleness, kept)

    @app.get("/api/rollout/{rollout_id}")
    def rollout(rollout_id: str):
        found = run.rollout(rollout_id)
        if found is None:
            return JSONResponse({"error": f"no kept rollout {rollout_id!r}"}, status_code=404)
        return found

    @app.get("/api/eval/{version}")
    def eval_traces(version: int) -> dict:
        return {"version": version, "traces": run.eval_traces(version)}

    @app.get("/api/eval_item/{index}")
    def eval_item(index: int) -> dict:
        return {"index": index, "versions": run.eval_item(index)}

    return app


def check_bind(host: str, token: str | None) -> None:
    """A viewer that listens beyond loopback needs a token."""
    if not is_loopback_host(host) and not token:
        raise ValueError(f"--host {host}: a viewer that listens beyond loopback needs --token-file")


def serve(
    run_dir: str | Path, host: str = "127.0.0.1", port: int = 8765, token: str | None = None, background: bool = False
) -> Any:
    """Serve the viewer of ``run_dir``; with ``background``, on a daemon thread, returning the uvicorn server
    (its ``should_exit`` stops it)."""
    import uvicorn

    check_bind(host, token)
    server = uvicorn.Server(uvicorn.Config(make_app(run_dir, token), host=host, port=port, log_level="warning"))
    if not background:
        server.run()
        return server
    threading.Thread(target=server.run, name="asyncrl-view", daemon=True).start()
    return server
