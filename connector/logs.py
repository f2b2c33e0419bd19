"""Logging for kvtier code that runs inside vLLM/LMCache processes."""

from __future__ import annotations

import logging


def ensure_log_handler() -> None:
    """Give the "kvtier" loggers a stderr handler inside engine processes (vLLM only configures "vllm.*").

    Keeps propagation on, so pytest's caplog still sees the records.
    """
    lg = logging.getLogger("kvtier")
    if not lg.handlers:
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("[%(asctime)s] kvtier %(levelname)s %(name)s: %(message)s"))
        lg.addHandler(h)
        if lg.level == logging.NOTSET:
            lg.setLevel(logging.INFO)
