"""The interpreter start-up hook (``tfamp_startup.pth``): nothing until TensorFlow runs.

The ``.pth`` line imports this module only when some ``TFAMP_*`` variable is
set, and calls ``install()``, which costs a few milliseconds and imports no
TensorFlow:

* an unknown ``TFAMP_*`` name (``TFAMP_ENABLED=1``) gets a one-line hint when
  tfamp is off, and is an error (exit status 2) when it is on, as any invalid
  setting is;
* with ``TFAMP_ENABLE`` on, every setting that needs no TensorFlow is checked
  now (a bad one stops the script with one line and status 2, before it runs),
  and a watcher on ``sys.meta_path`` waits for the program to import
  ``tensorflow``, ``keras`` or ``tf_keras``: when the outermost of those imports
  finishes (``import keras`` imports TensorFlow inside it), tfamp activates
  (``startup.activate``: op-list names are checked against TensorFlow's op
  registry then, and the patches go in). A process that never imports
  TensorFlow (``pip``, a shell tool) imports nothing more and prints nothing.
"""

from __future__ import annotations

import os
import sys

# The imports whose end activates tfamp (whichever the program imports first).
WATCHED = frozenset({"tensorflow", "keras", "tf_keras"})


_installed = False


def install(environ=None) -> None:
    """Checks the settings that need no TensorFlow, then waits for its import.

    Once per process: ``site`` may read the same ``.pth`` twice (a venv's
    ``lib64`` is often a link to ``lib``).
    """
    global _installed
    if _installed:
        return
    _installed = True
    from tfamp.env import EnvError, is_enabled, settings_from_env, unknown_variable_message

    environ = os.environ if environ is None else environ
    try:
        enabled = is_enabled(environ)
        if not enabled:
            unknown = unknown_variable_message(environ)
            if unknown is not None:
                print(f"tfamp: {unknown} (TFAMP_ENABLE is not set, so tfamp is off)",
                      file=sys.stderr)
            return
        settings_from_env(environ, with_config=False)
    except EnvError as err:
        print(f"tfamp: error: {err}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(2)  # an exception in a .pth line is a fatal interpreter error
    if any(name in sys.modules for name in WATCHED):
        _activate()  # imported before site ran (unusual): activate now
        return
    sys.meta_path.insert(0, _ActivateAfterImport())


def _activate() -> None:
    from tfamp.runtime import startup

    startup.activate()


class _ActivateAfterImport:
    """A ``sys.meta_path`` finder that finds nothing itself: it wraps the loader of
    a watched module so that tfamp activates when the outermost watched import
    has finished, then removes itself."""

    def __init__(self):
        self._depth = 0
        self._looking = False

    def find_spec(self, name, path=None, target=None):
        if name not in WATCHED or self._looking:
            return None
        from importlib.util import find_spec

        self._looking = True
        try:
            spec = find_spec(name)
        finally:
            self._looking = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _Loader(spec.loader, self)
        return spec

    def entered(self) -> None:
        self._depth += 1

    def left(self, succeeded: bool) -> None:
        self._depth -= 1
        if self._depth or not succeeded:
            return
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        _activate()


class _Loader:
    """Delegates to the real loader and tells the watcher when the module ran."""

    def __init__(self, loader, watcher: _ActivateAfterImport):
        self._loader = loader
        self._watcher = watcher

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._watcher.entered()
        succeeded = False
        try:
            self._loader.exec_module(module)
            succeeded = True
        finally:
            self._watcher.left(succeeded)
