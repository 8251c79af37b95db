"""Showing tfamp's log lines on stderr: one handler, shared by every way of turning tfamp on.

``TFAMP_ENABLE`` (with its verbosity) and ``tfamp.enable`` (``verbose=``) both
show the ``tfamp`` logger's lines as bare messages on stderr. They add the same
handler, at most once, so enabling twice never prints a line twice.
"""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("tfamp")


class StderrHandler(logging.StreamHandler):
    """Writes each record's message to the current ``sys.stderr`` (which a test
    runner or notebook may replace after tfamp was turned on)."""

    _tfamp = True  # how tfamp (and its tests) recognise its own handler

    def __init__(self):
        super().__init__()
        self.setFormatter(logging.Formatter("%(message)s"))

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value):
        pass


def shown() -> bool:
    """True if tfamp's stderr handler is on the ``tfamp`` logger already."""
    return any(getattr(h, "_tfamp", False) for h in log.handlers)


def show() -> None:
    """Adds the stderr handler (once); the lines then no longer reach the root logger."""
    if not shown():
        log.addHandler(StderrHandler())
        log.propagate = False
