"""What ``tfamp export`` exports: the signatures of a SavedModel (or of a Keras file,
exported by its own Keras first) and the objects each one captures.

A Keras file is turned into a SavedModel by the Keras that saved it (Keras 3's
``model.export``, tf_keras's ``model.save(..., save_format="tf")``) in a
temporary folder, so its signature has the names and structure a user of that
Keras gets; from there on both kinds are one path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tfamp.inspect.graph_files import GraphFileError, keras_flavour, load_keras_file
from tfamp.serving.errors import ExportError

KERAS_SUFFIXES = (".keras", ".h5", ".hdf5")


@dataclasses.dataclass
class Capture:
    """One captured input of a signature's graph and what it is bound to.

    Attributes:
      placeholder: the captured placeholder's tensor name in the graph ("unknown_0:0").
      external: the tensor it is bound to (a variable's handle, a constant, ...).
      variable: the variable whose handle it is, or None.
      owner: for another resource (a lookup table) or an asset path, the object
        that owns it (it must be saved along with the new signatures), else None.
    """

    placeholder: str
    external: Any
    variable: Any = None
    owner: Any = None


@dataclasses.dataclass
class Signature:
    """A signature to export: its function and its captures."""

    name: str
    function: Any  # ConcreteFunction
    captures: list[Capture]

    @property
    def input_specs(self) -> dict[str, Any]:
        """Input name -> tf.TensorSpec, as the signature takes them (keywords)."""
        return dict(self.function.structured_input_signature[1])

    @property
    def output_names(self) -> list[str]:
        """The signature's output names, in the order of its graph's outputs."""
        from tensorflow.python.util import nest

        structure = self.function.structured_outputs
        return [path for path, _ in nest.flatten_with_joined_string_paths(structure)]


@dataclasses.dataclass
class Source:
    """A loaded source: its signatures (those asked for) and where it came from."""

    path: Path
    kind: str                  # "SavedModel", "Keras 3 file", "tf_keras file"
    root: Any                  # the loaded object (keeps its variables alive)
    signatures: list[Signature]
    available: list[str]       # every signature the source has
    saved_model_dir: Path      # the SavedModel read (a temporary one for a Keras file)
    note: str = ""             # how a Keras file became a SavedModel

    def variables_bytes_on_disk(self) -> int:
        """Bytes of the SavedModel's variables/ folder (what serving loads)."""
        return folder_bytes(self.saved_model_dir / "variables")


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if (
        folder.is_dir()) else 0


def is_saved_model(path: Path) -> bool:
    return path.is_dir() and ((path / "saved_model.pb").is_file()
                              or (path / "saved_model.pbtxt").is_file())


@contextlib.contextmanager
def open_source(path: Path, signatures: list[str] | None = None) -> Iterator[Source]:
    """Loads `path` (a SavedModel directory or a Keras file) for export.

    Args:
      path: the source.
      signatures: the signatures to export (None: all of them).

    Yields:
      the Source; a temporary SavedModel made from a Keras file is removed
      when the context ends.

    Raises:
      ExportError: a missing, corrupt or unknown kind of source, or an unknown
        signature (the message lists those there are).
    """
    path = Path(path)
    if not path.exists():
        raise ExportError(f"{path}: no such file or directory; expected a SavedModel "
                          f"directory or a Keras model file (.keras, .h5)")
    if is_saved_model(path):
        yield _load_saved_model(path, path, "SavedModel", signatures)
        return
    if path.is_dir():
        raise ExportError(f"{path} is a directory without saved_model.pb; expected a "
                          f"SavedModel directory or a Keras model file (.keras, .h5)")
    if path.suffix.lower() not in KERAS_SUFFIXES:
        raise ExportError(f"{path}: expected a SavedModel directory or a Keras model file "
                          f"(.keras, .h5), received a {path.suffix or 'file without suffix'!r}"
                          f" file (a GraphDef holds no variables to serve: export the model "
                          f"itself)")
    with tempfile.TemporaryDirectory(prefix="tfamp_export_src_") as folder:
        saved, kind, note = _keras_to_saved_model(path, Path(folder) / "saved_model")
        yield _load_saved_model(path, saved, kind, signatures, note=note)


def _keras_to_saved_model(path: Path, folder: Path) -> tuple[Path, str, str]:
    """Exports a Keras file with its own Keras; (folder, kind, note)."""
    try:
        model, _ = load_keras_file(path)
    except GraphFileError as err:
        raise ExportError(str(err)) from err
    flavour = keras_flavour(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if flavour == "keras3":
                model.export(str(folder), format="tf_saved_model", verbose=False)
                return folder, "Keras 3 file", "exported with Keras 3's model.export first"
            model.save(str(folder), save_format="tf", include_optimizer=False)
            return folder, "tf_keras file", ("saved as a SavedModel with tf_keras's "
                                             "model.save(save_format='tf') first")
    except Exception as err:  # Keras raises many kinds for a model it cannot export
        raise ExportError(
            f"{path}: its Keras could not export it as a SavedModel ({type(err).__name__}: "
            f"{_first_line(err)}); export it yourself (model.export(DIR) in Keras 3) and "
            f"pass DIR") from err


def _load_saved_model(path: Path, folder: Path, kind: str, wanted: list[str] | None, *,
                      note: str = "") -> Source:
    import tensorflow as tf

    try:
        root = tf.saved_model.load(str(folder))
    except (OSError, ValueError, KeyError, tf.errors.OpError) as err:
        raise ExportError(f"{path} could not be loaded as a SavedModel "
                          f"({type(err).__name__}: {_first_line(err)}); check that the "
                          f"folder is complete (saved_model.pb and variables/)") from err
    except Exception as err:  # a corrupt protobuf surfaces as several types
        raise ExportError(f"{path} could not be loaded as a SavedModel "
                          f"({type(err).__name__}: {_first_line(err)})") from err
    available = sorted(root.signatures.keys())
    if not available:
        raise ExportError(f"{path} has no signatures; a served SavedModel needs at least "
                          f"one (save it with tf.saved_model.save(obj, DIR, signatures=...))")
    names = list(dict.fromkeys(wanted)) if wanted else available
    unknown = [n for n in names if n not in root.signatures]
    if unknown:
        raise ExportError(f"{path} has no signature {unknown[0]!r}; available signatures: "
                          f"{', '.join(available)} (choose with --signature NAME)")
    owners = _capture_owners(root)
    signatures = [Signature(name, root.signatures[name],
                            _captures(root.signatures[name], owners)) for name in names]
    return Source(path=path, kind=kind, root=root, signatures=signatures,
                  available=available, saved_model_dir=folder, note=note)


def _capture_owners(root) -> dict[int, tuple[str, Any]]:
    """id(external tensor) -> ("variable" | "owner", object), for every object of `root`."""
    import tensorflow as tf

    owners: dict[int, tuple[str, Any]] = {}
    for obj in tf.train.TrackableView(root).descendants():
        if isinstance(obj, tf.Variable):
            owners[id(obj.handle)] = ("variable", obj)
            continue
        for attribute in ("resource_handle", "asset_path"):
            try:
                value = getattr(obj, attribute, None)
            except Exception:  # noqa: BLE001 (a resource that cannot be created here)
                value = None
            if value is not None:
                owners[id(value)] = ("owner", obj)
    return owners


def _captures(function, owners) -> list[Capture]:
    captures = []
    for external, internal in function.graph.captures:
        kind, obj = owners.get(id(external), ("", None))
        captures.append(Capture(placeholder=internal.name, external=external,
                                variable=obj if kind == "variable" else None,
                                owner=obj if kind == "owner" else None))
    return captures


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return (lines[0] if lines else type(err).__name__)[:300]
