"""``asyncrl view RUN_DIR...``: runs in the browser, finished or still going (:mod:`.data`, :mod:`.server`).

    asyncrl view runs/quickstart                 # http://127.0.0.1:8765
    asyncrl view runs/sweep/runs/*/seed0         # several runs, one page: a picker at the top
    asyncrl run configs/quickstart.yaml --view 8765

Curves (training reward, held-out pass@1 and pass@k by step or by training
seconds, samples/s, the learner's wait by cause, staleness over time, drops by
reason), the pipeline's totals and latest step, and the kept rollouts
(``learner.rollout_samples_per_step``) token by token, coloured by the policy
version that sampled each, with log-prob, advantage and loss mask on hover.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

DEFAULT_PORT = 8765


def add_parser(sub: argparse._SubParsersAction) -> None:
    view = sub.add_parser("view", help="look at runs (finished or running) in the browser")
    view.add_argument("run_dir", nargs="+", help="one run folder, or several to pick from on the page")
    view.add_argument("--host", default="127.0.0.1", help="beyond loopback only with --token-file")
    view.add_argument("--port", type=int, default=DEFAULT_PORT)
    view.add_argument("--token-file", default=None, help="a file holding the token the page must be opened with")


def read_token(path: str | None) -> str | None:
    if path is None:
        return None
    token = Path(path).read_text().strip()
    if not token:
        raise ValueError(f"--token-file {path} is empty")
    return token


def command(args: argparse.Namespace, overrides: list[str]) -> int:
    from asyncrl.launch.viewer.server import serve

    if overrides:
        raise ValueError(f"asyncrl view takes no overrides: {' '.join(overrides)}")
    token = read_token(args.token_file)
    folders = ", ".join(str(Path(d).resolve()) for d in args.run_dir)
    print(f"asyncrl view: {folders} on {url(args.host, args.port, token)} (Ctrl-C stops it)")
    serve(args.run_dir, args.host, args.port, token)
    return 0


def url(host: str, port: int, token: str | None = None) -> str:
    return f"http://{host}:{port}/" + ("?token=..." if token else "")


def start_for_run(run_dirs: str | Path | list[str | Path], port: int) -> Any:
    """``asyncrl run --view PORT``: the viewer of the run's folder (or the folders of runs sharing a generator) on
    loopback, for as long as the command runs."""
    from asyncrl.launch.viewer.server import serve

    server = serve(run_dirs, "127.0.0.1", port, background=True)
    later = " ".join(str(d) for d in (run_dirs if isinstance(run_dirs, list) else [run_dirs]))
    print(f"asyncrl view: {url('127.0.0.1', port)} (while the run goes; `asyncrl view {later}` afterwards)")
    return server
