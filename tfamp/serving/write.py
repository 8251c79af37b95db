"""Writing the exported SavedModel: into a temporary folder next to DST, checked, then
moved into place, so DST is never half-written.

An existing DST is refused unless ``overwrite``; even then only a SavedModel
folder or an empty one is replaced (never some other folder or a file), and the
old one is removed only after the new one is in place.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tfamp.serving.errors import ExportError
from tfamp.serving.source import is_saved_model


def check_destination(destination: Path, overwrite: bool) -> None:
    """Raises ExportError, before any work, if `destination` may not be written."""
    if not destination.exists():
        return
    if not overwrite:
        raise ExportError(f"{destination} exists; pass --overwrite (overwrite=True) to "
                          f"replace it, or choose another -o folder")
    if destination.is_dir() and (is_saved_model(destination) or not any(destination.iterdir())):
        return
    raise ExportError(f"{destination} exists and is not a SavedModel folder; --overwrite "
                      f"only replaces a SavedModel (or an empty folder): remove it "
                      f"yourself or choose another -o folder")


def write_saved_model(destination: Path, signatures: dict[str, Any], tracked: dict[str, list],
                      verify: Callable[[Path], None]) -> None:
    """Saves a module holding `tracked` with `signatures` as `destination`.

    Args:
      destination: the SavedModel folder to create (or replace: check first
        with ``check_destination``).
      signatures: signature name -> ConcreteFunction.
      tracked: attribute name -> the objects the functions capture (variables,
        lookup tables, assets): saved with them.
      verify: called with the temporary folder once written; raises to refuse it.

    Raises:
      ExportError: saving failed (nothing is left behind).
    """
    import tensorflow as tf

    destination = Path(destination)
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}.tfamp-",
                                    dir=destination.parent))
    try:
        module = tf.Module()
        for name, objects in tracked.items():
            setattr(module, name, list(objects))
        try:
            tf.saved_model.save(module, str(staging), signatures=signatures)
        except (ValueError, TypeError, AssertionError, tf.errors.OpError) as err:
            raise ExportError(f"TensorFlow could not save the exported signatures "
                              f"({type(err).__name__}: {str(err).splitlines()[0][:300]}); "
                              f"nothing was written") from err
        verify(staging)
        _move_into_place(staging, destination)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _move_into_place(staging: Path, destination: Path) -> None:
    if not destination.exists():
        staging.rename(destination)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{destination.name}.old-", dir=destination.parent))
    old.rmdir()
    destination.rename(old)
    try:
        staging.rename(destination)
    except OSError:
        old.rename(destination)  # put the previous one back
        raise
    shutil.rmtree(old, ignore_errors=True)
