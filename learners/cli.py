"""``asyncrl-learner CONFIG``: the learner group, and the run's control endpoint.

With ``learner.ranks > 1`` it starts itself under torchrun, one process per
rank; rank 0 also binds the buffer and the coordinator endpoint.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from asyncrl.observe.logs import ends_process


@ends_process
def main(argv: list[str] | None = None) -> int:
    """Parse the command line and the config, then train this rank (or export a checkpoint, or start torchrun).

    As the process's own command (``argv`` unset) it ends the process once done, without the interpreter's
    teardown (:func:`asyncrl.observe.logs.ends_process`); called with ``argv``, it returns.
    """
    from asyncrl.config import describe_keys

    # The learner reads every section: generator.samples_per_prompt sizes its steps, push its weight broadcast.
    parser = argparse.ArgumentParser(
        prog="asyncrl-learner",
        description=__doc__.splitlines()[0],
        epilog=describe_keys(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("config", help="run config (YAML)")
    parser.add_argument("--run-dir", default=None, help="where outputs go (overrides run_dir)")
    parser.add_argument("--resume", action="store_true", help="continue from RUN_DIR/checkpoints/LATEST")
    parser.add_argument(
        "--export",
        metavar="FOLDER",
        default=None,
        help="write a checkpoint of RUN_DIR as an HF folder and exit (no training)",
    )
    parser.add_argument("--tag", default=None, help="with --export: which checkpoint (default: the newest)")
    parser.add_argument(
        "--merged",
        action="store_true",
        help="with --export and learner.lora: the base with the adapter merged in, not the adapter folder",
    )
    args, overrides = parser.parse_known_args(argv)

    from asyncrl.config import ConfigError, check_secrets, load_config

    if args.run_dir:
        overrides += ["--run_dir", args.run_dir]
    try:
        config = load_config(args.config, overrides)
        if not args.export:
            check_secrets(config, generator=False)
    except ConfigError as exc:
        print(f"asyncrl-learner: {exc}", file=sys.stderr)
        return 2
    if args.export:
        return _export(config, args.export, args.tag, args.merged)
    from asyncrl.run_folder import cannot_resume, cannot_start_fresh

    if problem := cannot_resume(config.run_dir) if args.resume else cannot_start_fresh(config.run_dir):
        print(f"asyncrl-learner: {problem}", file=sys.stderr)
        return 2
    if config.learner.ranks > 1 and "MASTER_PORT" not in os.environ:
        return _torchrun(config.learner.ranks, argv if argv is not None else sys.argv[1:])
    from learners.process import train  # the heavy imports (torch, DeepSpeed), once the command line is good

    return train(config, args.resume)


def _export(config, folder: str, tag: str | None, merged: bool = False) -> int:
    """``--export``: a checkpoint of the run (``tag``, or the newest) as an HF folder (a LoRA run's: its
    adapter as a PEFT folder, or ``merged`` into the base)."""
    from asyncrl.observe import logs
    from learners.checkpoint import export_hf

    log = logs.setup("export")
    try:
        export_hf(
            Path(config.run_dir) / "checkpoints",
            tag,
            config.model.path,
            Path(folder),
            config.model.resolved_dtype(),
            config.learner.lora,
            merged,
        )
    except (FileNotFoundError, FileExistsError, ValueError) as error:  # ValueError: not a ZeRO checkpoint
        log.error("%s", error)
        return 2
    return 0


def _torchrun(ranks: int, argv: list[str]) -> int:
    """Re-run this command as ``ranks`` processes under torchrun on this host.

    torchrun starts in a session of its own, so that a signal to this process's group (``asyncrl run``
    stopping, Ctrl-C) reaches this process only: SIGTERM (or a first Ctrl-C) is handed to rank 0, which
    finishes its step, checkpoints with every rank and tells them to stop; torchrun's own SIGTERM would end
    the ranks after 30 s, in the middle of a checkpoint of a large model. This process ends when torchrun
    does; a second Ctrl-C stops torchrun at once.
    """
    import signal
    import subprocess

    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={ranks}",
        "-m",
        "learners.cli",
        *argv,
    ]
    from asyncrl.tasks import child_env

    proc = subprocess.Popen(command, env=child_env(), start_new_session=True)
    signal.signal(signal.SIGTERM, lambda signum, frame: _stop_rank_0(proc.pid))
    try:
        return proc.wait()
    except KeyboardInterrupt:
        _stop_rank_0(proc.pid)
        try:
            return proc.wait()
        except KeyboardInterrupt:
            proc.terminate()
            return proc.wait(timeout=30)


def _stop_rank_0(torchrun_pid: int) -> None:
    """SIGTERM to rank 0 among torchrun's processes (the others leave stopping to it)."""
    import signal

    import psutil

    try:
        workers = psutil.Process(torchrun_pid).children(recursive=True)
    except psutil.Error:
        return  # torchrun has ended
    for worker in workers:
        try:
            if worker.environ().get("RANK") == "0":
                worker.send_signal(signal.SIGTERM)
        except psutil.Error:
            continue


if __name__ == "__main__":
    sys.exit(main())
