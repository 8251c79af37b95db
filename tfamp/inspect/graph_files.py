"""Reads what ``tfamp inspect`` can be pointed at.

SavedModel directories (a serving signature), Keras model files (.keras, .h5:
the training step when saved compiled, else the forward pass; Keras 3 and
tf_keras files alike, told apart by the keras_version the file records),
GraphDef files (.pb, .pbtxt) and tfamp JSON reports.

A Keras file whose custom classes are not registered in this process fails
with a message naming the class and the module it was saved from, to pass to
``tfamp inspect --import MODULE``.

Each reader checks what it was given and raises ``GraphFileError`` saying what
was expected, what was found and what to do, never a bare protobuf error.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
import warnings
import zipfile
from pathlib import Path

from google.protobuf import message, text_format
from tensorflow.core.framework import graph_pb2

from tfamp.rewrite.report import RewriteReport


class GraphFileError(ValueError):
    """A path that cannot be read as a graph or report, with the reason."""


# A Keras file has no batch size; its step is traced at this one unless told.
DEFAULT_KERAS_BATCH = 8


@dataclasses.dataclass
class Inspectable:
    """A graph to rewrite (with what is known about it), or a report to render again.

    Attributes:
      outputs: tensor names whose dtype callers rely on (None: unconsumed ones).
      batch_size: the batch the graph was traced at (None: open, or unknown).
      batch_note: where that batch size came from, for the batch-size line.
    """

    name: str
    graph_def: graph_pb2.GraphDef | None = None
    report: RewriteReport | None = None
    outputs: list[str] | None = None
    batch_size: int | None = None
    batch_note: str = ""

    @functools.cached_property
    def flops(self) -> tuple[dict[tuple[str, str], int], int, int] | None:
        """Matrix/convolution FLOPs, counted when first asked (only the summary does).

        Returns:
          ({(function, node name): FLOPs per step}, library functions included
          and weighted by runs per step; how many such ops had unknown shapes;
          the degree d: the FLOPs are coefficients of B**d, B an unknown
          dimension such as a SavedModel's batch), or None without a GraphDef.
          A GraphDef stored without ``_output_shapes`` gets the shapes
          TensorFlow's shape inference gives it (``rewrite.shape_inference``).
        """
        from tfamp.inspect.flops import graph_def_flops

        if self.graph_def is None:
            return None
        return graph_def_flops(self.graph_def)


def load_inspectable(path: Path, *, signature: str | None = None,
                     graph: str | None = None, batch_size: int | None = None) -> Inspectable:
    """Reads `path` by its kind.

    Args:
      path: a SavedModel directory, .keras/.h5 file, .pb/.pbtxt GraphDef or a
        .json report.
      signature: for a SavedModel, the signature to show ("serving_default").
      graph: for a Keras file, "train" or "predict" (default: train if the
        model was saved compiled).
      batch_size: the batch to trace a Keras file at (DEFAULT_KERAS_BATCH if
        None). A SavedModel signature keeps its own (usually open: the batch
        line says so); GraphDefs and reports have theirs fixed already.
    """
    if not path.exists():
        raise GraphFileError(f"{path}: no such file or directory")
    if signature is not None and not _is_saved_model(path):
        raise GraphFileError(f"--signature applies to SavedModel directories; {path} is not one")
    if graph is not None and path.suffix.lower() not in (".keras", ".h5"):
        raise GraphFileError(f"--graph applies to Keras model files (.keras, .h5); {path} "
                             f"is not one")
    if batch_size is not None and not (_is_saved_model(path) or path.suffix.lower() in (
            ".keras", ".h5")):
        raise GraphFileError(
            f"--batch-size applies to Keras model files and SavedModels, which are traced "
            f"here; {path} is a {'report' if path.suffix.lower() == '.json' else 'GraphDef'} "
            f"whose shapes are fixed (trace it again at the batch you want)")
    if _is_saved_model(path):
        return read_saved_model(path if path.is_dir() else path.parent, signature,
                                batch_size=batch_size)
    if path.is_dir():
        raise GraphFileError(
            f"{path} is a directory without saved_model.pb; expected a SavedModel "
            f"directory, a Keras file (.keras, .h5), a GraphDef (.pb, .pbtxt) or a "
            f"tfamp JSON report")
    suffix = path.suffix.lower()
    if suffix in (".keras", ".h5"):
        return read_keras_model(path, graph, batch_size=batch_size)
    if suffix == ".json":
        return Inspectable(name=path.stem, report=read_report(path))
    if suffix == ".pbtxt":
        return Inspectable(name=path.stem, graph_def=read_graph_def_text(path))
    if suffix == ".pb":
        return Inspectable(name=path.stem, graph_def=read_graph_def_binary(path))
    raise GraphFileError(
        f"{path}: unknown kind of file {suffix or '(no extension)'!r}; expected a "
        f"SavedModel directory, .keras/.h5 (Keras model), .pb (binary GraphDef), "
        f".pbtxt (text GraphDef) or .json (tfamp report)")


def _is_saved_model(path: Path) -> bool:
    if path.is_dir():
        return (path / "saved_model.pb").is_file() or (path / "saved_model.pbtxt").is_file()
    return path.name in ("saved_model.pb", "saved_model.pbtxt")


def _from_concrete(name: str, concrete) -> Inspectable:
    graph_def = concrete.graph.as_graph_def(add_shapes=True)
    return Inspectable(name=name, graph_def=graph_def,
                       outputs=[t.name for t in concrete.graph.outputs])


def read_saved_model(folder: Path, signature: str | None, *,
                     batch_size: int | None = None) -> Inspectable:
    """A SavedModel signature's graph; `batch_size` sizes an open batch dimension
    (``tfamp.inspect.fixed_batch``) and is refused, with the reason, for a fixed one."""
    import tensorflow as tf

    try:
        loaded = tf.saved_model.load(str(folder))
    except (OSError, ValueError, tf.errors.OpError) as err:
        raise GraphFileError(f"{folder} could not be loaded as a SavedModel: "
                             f"{_first_line(err)}") from err
    available = sorted(loaded.signatures.keys())
    wanted = signature or "serving_default"
    if wanted not in loaded.signatures:
        listed = ", ".join(available) or "none"
        raise GraphFileError(
            f"{folder} has no signature {wanted!r}; available signatures: {listed} "
            f"(choose one with --signature NAME)")
    concrete = loaded.signatures[wanted]
    specs = concrete.structured_input_signature[1]
    open_batch = [k for k, s in specs.items() if s.shape.rank and s.shape[0] is None]
    if batch_size is None:
        note = ("open (B) in the signature: FLOPs are per B, traffic the share at large "
                "B (a signature exported at a fixed batch gives bytes)") if open_batch else (
            "fixed by the signature")
        fixed = {s.shape[0] for s in specs.values() if s.shape.rank}
        size = fixed.pop() if not open_batch and len(fixed) == 1 else None
        inspectable = _from_concrete(f"{folder.name}:{wanted}", concrete)
        inspectable.batch_size, inspectable.batch_note = size, note
        return inspectable
    if not open_batch:
        raise GraphFileError(
            f"--batch-size {batch_size}: the signature {wanted!r} of {folder} fixes its batch "
            f"dimension already (inputs {_shapes_text(specs)}); drop --batch-size, or export "
            f"the signature with an open batch (tf.TensorSpec([None, ...]))")
    from tfamp.inspect.fixed_batch import at_batch

    inspectable = _from_concrete(f"{folder.name}:{wanted}", concrete)
    inspectable.graph_def = at_batch(inspectable.graph_def, batch_size)
    inspectable.batch_size = batch_size
    inspectable.batch_note = ("given with --batch-size; the signature's open batch was sized "
                              "at it")
    return inspectable


def _shapes_text(specs) -> str:
    return ", ".join(f"{k}: {s.shape.as_list()}" for k, s in specs.items())


def read_keras_model(path: Path, graph: str | None, *,
                     batch_size: int | None = None) -> Inspectable:
    """Loads a Keras model file and traces its training step or forward pass.

    The loader is chosen from the file itself: the ``keras_version`` the file
    records (metadata.json inside a .keras zip, an attribute of an .h5 file)
    is 3.x for Keras 3 (``keras`` / ``tf.keras``) and 2.x for tf_keras.

    Args:
      path: a .keras or .h5 file.
      graph: "train", "predict" or None (train when the model was saved compiled).
      batch_size: the batch to trace at (DEFAULT_KERAS_BATCH if None).
    """
    import tensorflow as tf

    batch = batch_size or DEFAULT_KERAS_BATCH
    note = "given with --batch-size" if batch_size else (
        "assumed; a Keras file records none: change it with --batch-size N")

    model, compiled = load_keras_file(path)
    graph = graph or ("train" if compiled else "predict")
    if graph == "train" and not compiled:
        raise GraphFileError(f"{path} was saved without compile(), so it has no training "
                             f"step; use --graph predict")
    # The model's own input structure (a dict for keras-hub models and other
    # functional models with named inputs), at `batch`.
    inputs = tf.nest.map_structure(
        lambda t: tf.TensorSpec([batch, *t.shape[1:]], t.dtype), _input_structure(model))
    if graph == "predict":
        try:
            concrete = tf.function(
                lambda x: model(x, training=False)).get_concrete_function(inputs)
        except (ValueError, TypeError, tf.errors.OpError) as err:
            raise GraphFileError(
                f"could not trace the forward pass of {path} with inputs shaped like the "
                f"model's ({_first_line(err)})") from err
        return dataclasses.replace(_from_concrete(f"{path.stem}:predict", concrete),
                                   batch_size=batch, batch_note=note)
    targets = target_specs(model, batch)
    target = targets[0] if len(targets) == 1 else targets
    try:
        concrete = tf.function(lambda x, y: model.train_step((x, y))).get_concrete_function(
            inputs, target)
    except (ValueError, TypeError, tf.errors.OpError) as err:
        raise GraphFileError(
            f"could not trace the training step of {path} with float32 targets shaped like "
            f"the model's outputs ({_first_line(err)}); use --graph predict") from err
    return dataclasses.replace(_from_concrete(f"{path.stem}:train", concrete),
                               batch_size=batch, batch_note=note)


def _input_structure(model):
    """The model's inputs as its call takes them: one tensor, a list or a dict."""
    try:
        structure = model.input  # (a never-called Keras 3 Sequential has none)
    except (AttributeError, ValueError):
        structure = list(model.inputs)
    if isinstance(structure, (list, tuple)) and len(structure) == 1:
        return structure[0]
    return structure


def load_keras_file(path: Path):
    """(model, saved compiled?) for a .keras / .h5 file, by the Keras that saved it.

    The loader is chosen from the ``keras_version`` the file records: Keras 3
    (``keras`` / ``tf.keras``) for 3.x, tf_keras for 2.x.

    Raises:
      GraphFileError: the file does not load (naming unregistered custom classes).
    """
    flavour = keras_flavour(path)
    if flavour == "keras3":
        import keras
    else:
        import tf_keras as keras
    try:
        with warnings.catch_warnings():
            # A compiled, never-trained model saves an unbuilt optimizer; Keras 3
            # then warns that it skips its variables. Inspection never uses them.
            warnings.filterwarnings("ignore", message="Skipping variable loading for "
                                                      "optimizer")
            model = keras.models.load_model(str(path))
    except Exception as err:  # Keras raises many types for a bad file
        missing = unregistered_classes(path, flavour)
        if missing:
            raise GraphFileError(_unregistered_message(path, missing)) from err
        raise GraphFileError(f"{path} is not a loadable Keras model file "
                             f"({type(err).__name__}: {_first_line(err)})") from err
    if flavour == "keras3":
        compiled = bool(getattr(model, "compiled", False)) and model.optimizer is not None
    else:
        compiled = getattr(model, "optimizer", None) is not None and bool(
            getattr(model, "compiled_loss", None))
    return model, compiled


def target_specs(model, batch: int | None) -> list:
    """TensorSpecs for a compiled Keras model's targets, one per output.

    float32 shaped like the output, or int64 class labels (one per output row)
    when the loss is a sparse one.
    """
    import tensorflow as tf

    loss_name = str(getattr(model.loss, "name", getattr(model.loss, "__name__", model.loss)))
    if "sparse" in loss_name.lower():
        return [tf.TensorSpec([batch, *t.shape[1:-1]], tf.int64) for t in model.outputs]
    return [tf.TensorSpec([batch, *t.shape[1:]], tf.float32) for t in model.outputs]


def keras_flavour(path: Path) -> str:
    """"keras3" or "tf_keras": which Keras saved `path`, from its recorded keras_version."""
    version = _saved_keras_version(path)
    return "keras3" if version is not None and version.split(".")[0] == "3" else "tf_keras"


def _saved_keras_version(path: Path) -> str | None:
    if zipfile.is_zipfile(path):
        try:
            with zipfile.ZipFile(path) as archive:
                metadata = json.loads(archive.read("metadata.json"))
        except (KeyError, ValueError, OSError):
            return None
        version = metadata.get("keras_version") if isinstance(metadata, dict) else None
        return str(version) if version is not None else None
    config = _h5_attrs(path)
    version = config.get("keras_version")
    return version if isinstance(version, str) else None


def _h5_attrs(path: Path) -> dict[str, object]:
    try:
        import h5py

        with h5py.File(path, "r") as handle:
            return {k: v.decode() if isinstance(v, bytes) else v
                    for k, v in handle.attrs.items()}
    except (ImportError, OSError):
        return {}


def _saved_config(path: Path) -> object:
    if zipfile.is_zipfile(path):
        try:
            with zipfile.ZipFile(path) as archive:
                return json.loads(archive.read("config.json"))
        except (KeyError, ValueError, OSError):
            return None
    text = _h5_attrs(path).get("model_config")
    try:
        return json.loads(text) if isinstance(text, str) else None
    except ValueError:
        return None


def unregistered_classes(path: Path, flavour: str) -> list[tuple[str, str | None]]:
    """Custom classes the saved config names that this process has not registered.

    Returns:
      (registered name such as "mypkg>Scale", defining module or None) pairs.
    """
    if flavour == "keras3":
        from keras.saving import get_registered_object
    else:
        from tf_keras.saving import get_registered_object
    missing: dict[str, str | None] = {}

    def walk(value) -> None:
        if isinstance(value, dict):
            class_name = value.get("class_name")
            name = value.get("registered_name")
            if not isinstance(name, str) and isinstance(class_name, str) and ">" in class_name:
                name = class_name  # older files: the registered name is the class name
            module = value.get("module")
            builtin = isinstance(module, str) and module.split(".")[0] in ("keras", "tf_keras")
            if (isinstance(name, str) and not builtin and name not in missing
                    and get_registered_object(name) is None
                    and not _imported_class(module, class_name)):
                missing[name] = module if isinstance(module, str) else None
            for item in value.values():
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk(_saved_config(path))
    return list(missing.items())


def _imported_class(module, class_name) -> bool:
    """True if an already imported `module` defines `class_name` (Keras finds it there)."""
    if not (isinstance(module, str) and isinstance(class_name, str)):
        return False
    return isinstance(getattr(sys.modules.get(module), class_name.split(">")[-1], None), type)


def _unregistered_message(path: Path, missing: list[tuple[str, str | None]]) -> str:
    name, module = missing[0]
    class_name = name.split(">")[-1]
    more = f" (and {len(missing) - 1} more: {', '.join(n for n, _ in missing[1:])})" if (
        len(missing) > 1) else ""
    origin = f", saved from module {module!r}" if module else ""
    return (f"{path}: class {class_name!r} (registered name {name!r}{origin}) is not "
            f"registered{more}: pass --import {module or '<package>'} (the package that "
            f"defines and registers it; repeatable) so its classes can be rebuilt")


def _first_line(err: BaseException) -> str:
    """The line of an error message that says what went wrong.

    AutoGraph's errors start "in user code:" and a traceback; the message is
    their last line.
    """
    text = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    if not text:
        return type(err).__name__
    line = text[-1] if text[0].startswith("in user code:") else text[0]
    return line[:300]


def read_graph_def_binary(path: Path) -> graph_pb2.GraphDef:
    data = path.read_bytes()
    if data[:2] == b"PK":
        raise GraphFileError(f"{path} is a zip archive, not a binary GraphDef; a Keras "
                             f"model file should be named .keras")
    if not data:
        raise GraphFileError(f"{path} is empty; expected a binary GraphDef")
    graph_def = graph_pb2.GraphDef()
    try:
        graph_def.ParseFromString(data)
    except message.DecodeError as err:
        raise GraphFileError(
            f"{path} is not a binary GraphDef ({err}); the file may be truncated or "
            f"of another kind (a text GraphDef should be named .pbtxt)") from err
    return _nonempty(graph_def, path)


def read_graph_def_text(path: Path) -> graph_pb2.GraphDef:
    try:
        text = path.read_text()
    except UnicodeDecodeError as err:
        raise GraphFileError(
            f"{path} is not text; a binary GraphDef should be named .pb") from err
    graph_def = graph_pb2.GraphDef()
    try:
        text_format.Parse(text, graph_def)
    except text_format.ParseError as err:
        raise GraphFileError(f"{path} is not a text GraphDef: {err}") from err
    return _nonempty(graph_def, path)


def _nonempty(graph_def: graph_pb2.GraphDef, path: Path) -> graph_pb2.GraphDef:
    if not graph_def.node and not graph_def.library.function:
        raise GraphFileError(f"{path} holds a GraphDef with no nodes; nothing to inspect")
    return graph_def


def read_report(path: Path) -> RewriteReport:
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise GraphFileError(f"{path} is not valid JSON ({err}); expected a tfamp report") from err
    if not isinstance(data, dict):
        raise GraphFileError(f"{path} holds JSON {type(data).__name__}; expected a tfamp "
                             f"report object")
    try:
        return RewriteReport.from_dict(data)
    except (TypeError, ValueError) as err:
        raise GraphFileError(f"{path}: {err}") from err
