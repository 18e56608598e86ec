"""The logger a stage writes to: Prefect's run logger in a run (shown in the UI), else a plain one."""

from __future__ import annotations

import logging

from prefect import get_run_logger
from prefect.exceptions import MissingContextError


def stage_logger(name: str) -> logging.Logger | logging.LoggerAdapter:
    """The Prefect run logger inside a flow or task run; ``logging.getLogger(name)`` outside one (tests, scripts)."""
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(name)
