"""Telling the user: a warning points at the user's own line, and a notice is given once."""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path

log = logging.getLogger("tfamp")

_given: set[str] = set()


def user_stacklevel() -> int:
    """The warnings stacklevel of the first frame outside TensorFlow, Keras and tfamp."""
    import tensorflow as tf

    dirs = [str(Path(tf.__file__).parent), str(Path(__file__).parent.parent)]
    for name in ("tf_keras", "keras"):
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None):
            dirs.append(str(Path(module.__file__).parent))
    library_dirs = tuple(dirs)
    frame, level = sys._getframe(1), 1
    while frame is not None:
        name = frame.f_code.co_filename
        if not (name.startswith(library_dirs) or "__autograph_generated" in name):
            return level
        frame, level = frame.f_back, level + 1
    return 2


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """Logs `message` (WARNING) and issues it as a warning at the user's line."""
    log.warning("%s", message)
    warnings.warn(message, category, stacklevel=user_stacklevel())


def warn_once(key: str, message: str) -> None:
    """``warn`` the first time `key` is given in this process."""
    if key in _given:
        return
    _given.add(key)
    warn(message)
