"""Logging set-up shared by every entrypoint."""

from __future__ import annotations

import logging
import os
import warnings


def setup(name: str) -> logging.Logger:
    """One line per record, prefixed with the process's role; level from ASYNCRL_LOG_LEVEL."""
    logging.basicConfig(
        level=os.environ.get("ASYNCRL_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s",
    )
    # DeepSpeed calls collectives that torch has deprecated, once per parameter bucket.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    return logging.getLogger(name)
