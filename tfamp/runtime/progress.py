"""One line while a slow phase runs (tracing, rewriting, a first step); nothing on quick ones.

A first ``fit`` step of a large model can spend a minute tracing, rewriting and
compiling before anything is printed. ``phase(fn)`` marks the function whose call
is running; a daemon thread (started on first use, waking twice a second)
logs it once when it has run longer than ``NOTICE_AFTER_S`` seconds. Only a
function's first call is watched (the line says "first call"): a later call
that is slow is a slow step, not tracing. Entering and leaving a phase costs a
set lookup and two attribute writes, so it can wrap every call of a rewritten
function.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref

log = logging.getLogger("tfamp")

NOTICE_AFTER_S = 5.0
_POLL_S = 0.5


class _Watch:
    def __init__(self):
        self.what = None  # the function whose call is running
        self.since = 0.0
        self.announced = False
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        # Functions whose first call has ended: never watched again.
        self.done: weakref.WeakSet = weakref.WeakSet()
        self.done_ids: set[int] = set()  # the same, for what takes no weak reference

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="tfamp-progress",
                                                daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(_POLL_S)
            what, since = self.what, self.since
            if what is None or self.announced:
                continue
            elapsed = time.monotonic() - since
            if elapsed >= NOTICE_AFTER_S:
                self.announced = True
                name = getattr(what, "__name__", None) or "a function"
                log.info("tfamp: first call of %s: tracing, rewriting and compiling it for "
                         "mixed precision (%.0f s so far; a large model takes a while)",
                         name, elapsed)


_watch = _Watch()


def enter(what) -> bool:
    """Marks a call of `what` (a function) as running; True if it is the outermost.

    Pass the answer to ``leave``. Only the first call of each function is
    watched, and only a call still running after ``NOTICE_AFTER_S`` is
    announced: a slow first call (trace, rewrite, compile), once.
    """
    if _watch.what is not None:  # nested (a rewritten step traced inside a loop)
        return False
    if _finished(what):
        return False
    if _watch._thread is None:
        _watch.start()
    _watch.since, _watch.announced, _watch.what = time.monotonic(), False, what
    return True


def leave(entered: bool) -> None:
    """Ends what ``enter`` marked (nothing if that was a nested call)."""
    if entered:
        what, _watch.what = _watch.what, None
        try:
            _watch.done.add(what)
        except TypeError:
            _watch.done_ids.add(id(what))


def _finished(what) -> bool:
    """True if a call of `what` has already ended."""
    try:
        return what in _watch.done
    except TypeError:
        return id(what) in _watch.done_ids


@contextlib.contextmanager
def phase(what):
    """``enter`` / ``leave`` around a block."""
    entered = enter(what)
    try:
        yield
    finally:
        leave(entered)


class Counter:
    """'tfamp: <what>: i of n done (t s)' lines for a loop of slow steps.

    Nothing is logged for a loop that finishes its steps within ``NOTICE_AFTER_S``
    seconds of starting; after that, one line per finished step (at INFO).

    Example:
      >>> steps = Counter("ranges", total=3)
      >>> for i, batch in enumerate(batches, 1):
      ...     run(batch)
      ...     steps.done(i)
    """

    def __init__(self, what: str, total: int):
        self.what, self.total = what, total
        self.start = time.monotonic()

    def done(self, count: int) -> None:
        elapsed = time.monotonic() - self.start
        if elapsed >= NOTICE_AFTER_S:
            log.info("tfamp: %s: %d of %d done (%.0f s)", self.what, count, self.total,
                     elapsed)
