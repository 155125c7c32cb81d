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


def labels(run_dirs: list[Path]) -> list[str]:
    """Short names for the runs: each folder's last parts, as many as tell them apart."""
    for parts in range(1, max((len(d.parts) for d in run_dirs), default=1) + 1):
        names = ["/".join(d.parts[-parts:]) for d in run_dirs]
        if len(set(names)) == len(names):
            return names
    return [str(d) for d in run_dirs]


LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})


def _guard(app: Any, token: str | None) -> None:
    """With ``token``, every request must carry it (``?token=`` once, then a cookie); without one (a viewer on
    loopback) a request must name a loopback host, so that a web page whose name was rebound to 127.0.0.1
    (DNS rebinding) cannot read the run through the user's browser. Every error answers with a reason, never a
    stack trace."""
    from fastapi import HTTPException, Request
    from fastapi.responses import JSONResponse

    @app.middleware("http")
    async def check_token(request: Request, call_next):
        if token is None:
            host = (request.headers.get("host") or "").rsplit(":", 1)[0].strip("[]")
            if host not in LOOPBACK_NAMES:
                return JSONResponse({"error": f"this viewer serves loopback only, not host {host!r}"}, status_code=421)
            return await call_next(request)
        given = request.query_params.get("token") or request.cookies.get(COOKIE) or ""
        if not hmac.compare_digest(given.encode(), token.encode()):
            return JSONResponse({"error": "this viewer needs its token: open it with ?token=..."}, status_code=401)
        response = await call_next(request)
        if request.query_params.get("token"):
            response.set_cookie(COOKIE, token, httponly=True, samesite="strict")
        return response

    @app.exception_handler(HTTPException)
    async def refused(request: Request, exc: HTTPException):
        return JSONResponse({"error": exc.detail}, status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception):  # a reason, never a stack trace
        log.warning("asyncrl view: %s failed: %s", request.url.path, exc)
        return JSONResponse({"error": f"{type(exc).__name__}: {exc}"}, status_code=500)


def make_app(run_dirs: str | Path | list[str | Path], token: str | None = None) -> Any:
    """The viewer's app for one run folder or several (the page picks one: ``?run=INDEX`` on every API call);
    with ``token``, every request must carry it."""
    from fastapi import FastAPI, HTTPException
    from fastapi.responses import FileResponse, JSONResponse

    folders = [RunFolder(d) for d in (run_dirs if isinstance(run_dirs, list) else [run_dirs])]
    names = labels([f.root for f in folders])

    def pick(index: int) -> RunFolder:
        if not 0 <= index < len(folders):
            raise HTTPException(404, f"no run {index}: this viewer serves runs 0 to {len(folders) - 1}")
        return folders[index]

    app = FastAPI(title="asyncrl view", docs_url=None, redoc_url=None, openapi_url=None)
    _guard(app, token)

    @app.get("/")
    def index() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    @app.get("/static/viewer.js")
    def script() -> FileResponse:
        return FileResponse(STATIC / "viewer.js", media_type="text/javascript")

    @app.get("/static/plotly.min.js")
    def plotly() -> FileResponse:
        return FileResponse(plotly_js(), media_type="text/javascript")

    @app.get("/api/runs")
    def runs() -> list[dict]:
        return [{"index": i, "name": name, "dir": str(f.root)} for i, (f, name) in enumerate(zip(folders, names))]

    @app.get("/api/overview")
    def overview(run: int = 0) -> dict:
        return pick(run).overview()

    @app.get("/api/curves")
    def curves(run: int = 0) -> dict:
        return pick(run).curves()

    @app.get("/api/pipeline")
    def pipeline(run: int = 0) -> dict:
        return pick(run).pipeline()

    @app.get("/api/rollouts")
    def rollouts(
        step: int | None = None,
        min_reward: float | None = None,
        max_reward: float | None = None,
        staleness: int | None = None,
        kept: str | None = None,
        prompt: int | None = None,
        run: int = 0,
    ) -> dict:
        return pick(run).rollouts(step, min_reward, max_reward, staleness, kept, prompt)

    @app.get("/api/rollout/{rollout_id}")
    def rollout(rollout_id: str, at: int | None = None, run: int = 0) -> dict:  # typed: NaN goes out as null
        found = pick(run).rollout(rollout_id, at)
        if found is None:
            return JSONResponse({"error": f"no kept rollout {rollout_id!r}"}, status_code=404)
        return found

    @app.get("/api/eval/{version}")
    def eval_traces(version: int, run: int = 0) -> dict:
        return {"version": version, "traces": pick(run).eval_traces(version)}

    @app.get("/api/eval_item/{index}")
    def eval_item(index: int, run: int = 0) -> dict:
        return {"index": index, "versions": pick(run).eval_item(index)}

    return app


def check_bind(host: str, token: str | None) -> None:
    """A viewer that listens beyond loopback needs a token."""
    if not is_loopback_host(host) and not token:
        raise ValueError(f"--host {host}: a viewer that listens beyond loopback needs --token-file")


def serve(
    run_dirs: str | Path | list[str | Path],
    host: str = "127.0.0.1",
    port: int = 8765,
    token: str | None = None,
    background: bool = False,
) -> Any:
    """Serve the viewer of one run folder or several; with ``background``, on a daemon thread, returning the
    uvicorn server (its ``should_exit`` stops it)."""
    import uvicorn

    check_bind(host, token)
    server = uvicorn.Server(uvicorn.Config(make_app(run_dirs, token), host=host, port=port, log_level="warning"))
    if not background:
        server.run()
        return server
    threading.Thread(target=server.run, name="asyncrl-view", daemon=True).start()
    return server
