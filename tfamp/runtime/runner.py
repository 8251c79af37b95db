"""Runs rewritten tf.functions against the same live variables.

``rewrite_concrete_function(cf, config)`` rewrites one traced graph and returns a
ConcreteFunction that computes on the original captures (variables, optimizer
state), so a training step updates the real model. ``function`` /
``rewrite_function`` wrap a tf.function (or Python function): trace as usual,
rewrite each new concrete function once, call the rewritten one.

How the rewritten graph is rebuilt: import the rewritten GraphDef into a fresh
FuncGraph, bind each captured placeholder to the original capture's live
tensor, carry over the original control outputs (without them variable updates
race inside Keras's multi-step loops), and register every library function
under a new name (an original name is already taken by the original body).

``RewrittenFunction`` is a ``tf.function`` to TensorFlow (a subclass of its
``Function`` class that never traces by itself): ``tf.saved_model.save``,
``signatures=``, ``get_concrete_function`` and ``experimental_get_compiler_ir``
all find the rewritten ConcreteFunctions, so what is saved or compiled is what
runs.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2
from tensorflow.core.function.polymorphism import function_type as function_type_lib
from tensorflow.python.eager.polymorphic_function import (
    atomic_function,
    function_type_utils,
    polymorphic_function,
    tracing_compilation,
)
from tensorflow.python.eager.polymorphic_function import concrete_function as concrete_lib
from tensorflow.python.framework import func_graph as func_graph_lib
from tensorflow.python.framework import importer, ops
from tensorflow.python.util import nest

from tfamp.config import AmpConfig
from tfamp.rewrite import rewrite_graph_def
from tfamp.rewrite.check import assert_valid_graph_def
from tfamp.rewrite.report import RewriteReport
from tfamp.runtime import progress

log = logging.getLogger("tfamp")

# String attributes that hold the name of a forward or backward function.
_FUNC_NAME_STRING_ATTRS = frozenset({
    "forward_function_name", "backward_function_name",
    "_forward_function_name", "_backward_function_name",
})
_rename_counter = itertools.count()
_NOT_TRACED = object()  # RewrittenFunction._call_traced: take the full path
# Every renamed library function registered so far (see _register_renamed_library).
_kept_library: list = []
# Names of the FunctionDefs tfamp has already handled in this process: the ones it
# built from rewritten graphs, and originals it found nothing to convert in.
# (TensorFlow allow-lists function attributes, so no attribute can mark them.)
_handled_function_names: set[str] = set()
# How many RewrittenFunction traces are in progress. Process-wide, not per
# thread: MirroredStrategy traces each replica's step in a thread of its own.
_tracing_depth = 0
_tracing_lock = threading.Lock()


def is_tracing_for_tfamp() -> bool:
    """True while a ``RewrittenFunction`` traces its function (whose graph tfamp rewrites).

    Lets code that runs at trace time (e.g. an enabled model's call) tell a
    tfamp-rewritten trace from a plain ``tf.function`` one.
    """
    return _tracing_depth > 0


class _tracing_for_tfamp:  # noqa: N801  (a context manager; a class: every call enters it)
    def __enter__(self):
        global _tracing_depth
        with _tracing_lock:
            _tracing_depth += 1

    def __exit__(self, *exc):
        global _tracing_depth
        with _tracing_lock:
            _tracing_depth -= 1


def _in_save_context() -> bool:
    from tensorflow.python.saved_model import save_context

    return save_context.in_save_context()


# Names of the tf.functions called inside a tf.data pipeline and so left float32
# (for TFAMP_ENABLE's exit notice).
left_in_pipelines: set[str] = set()
# tf.data names the functions it traces after their transformation
# (structured_function.py: "Dataset.map()" -> "Dataset_map_<fn>",
# "tf.data.experimental.scan()" -> "tf_data_experimental_scan_<fn>").
_INPUT_PIPELINE_PREFIXES = ("Dataset_", "tf_data_")


def _in_input_pipeline() -> bool:
    """Is a function of a tf.data input pipeline (or one nested in it) being traced?"""
    graph = tf.compat.v1.get_default_graph()
    while getattr(graph, "building_function", False):
        if graph.name.startswith(_INPUT_PIPELINE_PREFIXES):
            return True
        graph = getattr(graph, "outer_graph", None)
    return False


class RewrittenGraph(NamedTuple):
    """A traced function's rewrite before it is built: the GraphDef a run of it
    executes and the rewrite's report."""

    graph_def: graph_pb2.GraphDef
    report: RewriteReport


def rewrite_concrete_function(
    concrete: Any, config: AmpConfig | None = None, *, check: bool = False,
) -> tuple[Any, RewriteReport]:
    """Rewrites a traced ConcreteFunction; the result runs on its live captures.

    Args:
      concrete: a ``ConcreteFunction`` (``fn.get_concrete_function(...)``).
      config: the rewrite settings; ``AmpConfig()`` if None.
      check: run ``check_graph_def`` on the rewritten graph first (slower).

    Returns:
      (a ConcreteFunction with the same signature, the RewriteReport).
    """
    config = config or AmpConfig()
    return _built(concrete, *_rewrite(concrete, config), check=check)


def _built(concrete: Any, new_graph_def: graph_pb2.GraphDef, report: RewriteReport, *,
           check: bool, logged: set[str] | None = None) -> tuple[Any, RewriteReport]:
    """(the ConcreteFunction of a rewrite's graph, its report); logs the summary,
    at debug level where it is in `logged` (a function traced again, for another
    Python argument, and rewritten alike: keras.io's forwardforward traces one 11
    times) and adds it there."""
    if check:
        assert_valid_graph_def(new_graph_def)
    rewritten = _rebuild(new_graph_def, concrete, {})  # (new_graph_def is ours to consume)
    line = report.summary_line()
    if logged is not None and line in logged:
        log.debug("%s (traced again, rewritten alike)", line)
    elif not report.converted and not report.kept_fp32:
        log.debug("%s", line)  # (no floating-point op: nothing for the user to read)
    else:
        log.info("%s", line)
        if logged is not None:
            logged.add(line)
    return rewritten, report


def _rewrite(concrete: Any, config: AmpConfig) -> RewrittenGraph:
    """``rewrite_graph_def`` of a ConcreteFunction's graph, as tfamp runs it."""
    old = concrete.graph
    graph_def = old.as_graph_def(add_shapes=True)  # shapes: decisions by bytes
    attrs = dict(getattr(concrete, "_attrs", {}) or {})
    jit = attrs.get("_XlaMustCompile")  # an AttrValue; what a Cast costs depends on it
    return RewrittenGraph(*rewrite_graph_def(
        graph_def, config, outputs=[t.name for t in old.outputs],
        function_name=_display_name(old.name), jit_compile=bool(getattr(jit, "b", jit)),
        input_magnitudes=captured_magnitudes(old)))


def rewrite_report(concrete: Any, config: AmpConfig | None = None) -> RewriteReport:
    """The report of ``rewrite_concrete_function(concrete, config)``, nothing built:
    what the rewrite would decide for a traced function (the start-scale probe
    asks which of its values the step holds in 16 bits)."""
    return rewritten_graph_def(concrete, config)[1]


def rewritten_graph_def(concrete: Any, config: AmpConfig | None = None) -> RewrittenGraph:
    """(GraphDef, report) of ``rewrite_concrete_function(concrete, config)``, nothing
    built: the very graph a run of the rewrite executes (decided with the traced
    shapes, the function's ``jit_compile`` and its captured values), for the tools
    that run it op by op (the overflow locator)."""
    return _rewrite(concrete, config or AmpConfig())


def captured_magnitudes(graph) -> dict[str, float]:
    """Captured placeholder -> the largest finite magnitude of the eager float
    tensor it captures (see ``rewrite_graph_def``'s `input_magnitudes`).

    TensorFlow captures an eager tensor of more than 128 elements as a
    placeholder (smaller ones become constants): a precomputed attention bias
    (a mask times -1e9, made once outside the function) reaches the graph as
    one, and only its value says it is past the 16-bit range. Variables
    (resource handles) and symbolic captures are left out."""
    found = {}
    for external, internal in graph.captures:
        if not (isinstance(external, ops.EagerTensor) and external.dtype.is_floating):
            continue
        try:
            value = np.abs(np.asarray(external.numpy(), np.float64))
        except (TypeError, ValueError, tf.errors.OpError):
            continue
        finite = value[np.isfinite(value)]
        if finite.size:
            found[internal.op.name] = float(finite.max())
    return found


def concrete_from_graph_def(graph_def: graph_pb2.GraphDef, concrete: Any, *,
                            captures: dict[str, Any] | None = None) -> Any:
    """A ConcreteFunction that runs `graph_def` with `concrete`'s call signature.

    Args:
      graph_def: `concrete`'s graph or an edit of it (a rewrite) that keeps the
        names of its argument placeholders, captured placeholders and outputs.
        Not modified (its library is registered from a copy, under new names).
      concrete: the traced (or loaded) ConcreteFunction it was made from.
      captures: captured placeholder name ("unknown_0:0") -> the external
        tensor to bind it to (e.g. the handle of a new variable); the others
        are bound to `concrete`'s own captures.

    Returns:
      a ConcreteFunction taking and returning what `concrete` does.
    """
    graph_def_copy = graph_pb2.GraphDef()
    graph_def_copy.CopyFrom(graph_def)
    return _rebuild(graph_def_copy, concrete, captures or {})


def _rebuild(graph_def: graph_pb2.GraphDef, concrete: Any, captures: dict[str, Any]) -> Any:
    """concrete_from_graph_def, moving `graph_def`'s library out of it."""
    library = _register_renamed_library(graph_def, f"_tfamp{next(_rename_counter)}")
    new_graph = _import_as_func_graph(graph_def, concrete.graph, captures)
    for fn in library:  # the graph's children: saved and compiled along with it
        new_graph._add_function(fn)
    attrs = dict(getattr(concrete, "_attrs", {}) or {})
    rebuilt = concrete_lib.ConcreteFunction.from_func_graph(
        new_graph, concrete.function_type, attrs)
    # Set by tracing, not by from_func_graph: the flat (keyword) call signature
    # that signatures= and SavedModel loading use.
    rebuilt._arg_keywords = concrete._arg_keywords
    rebuilt._num_positional_args = concrete._num_positional_args
    return rebuilt


def _display_name(graph_name: str) -> str:
    # FuncGraph names look like "train_function" or "__inference_step_123".
    return graph_name.removeprefix("__inference_")


def _register_renamed_library(graph_def: graph_pb2.GraphDef, suffix: str) -> list:
    """Renames every library function (and all references), then registers them.

    Moves the library out of `graph_def`: the functions live in the eager
    context, where the rewritten graph's calls find them. Returns them as
    AtomicFunctions, for the rewritten graph to hold (a SavedModel or an XLA
    compilation takes a function's library from its graph).
    """
    names = {f.signature.name: f.signature.name + suffix for f in graph_def.library.function}
    _rename_references(graph_def.node, names)
    for fdef in graph_def.library.function:
        fdef.signature.name = names[fdef.signature.name]
        _rename_references(fdef.node_def, names)
        for key, value in fdef.attr.items():
            _rename_attr(key, value, names)
        # Grappler's implementation selector swaps a call for any registered
        # function with the same "api_implements" tag (Keras LSTM/GRU: CPU and
        # cuDNN variants). Left as is, it may pick the original float32 body;
        # a per-rewrite tag keeps the choice among the rewritten variants.
        if "api_implements" in fdef.attr:
            fdef.attr["api_implements"].s += suffix.encode()
    fdefs = {fdef.signature.name: fdef for fdef in graph_def.library.function}
    library = {name: atomic_function.from_function_def(fdef, _flat_function_type(fdef))
               for name, fdef in fdefs.items()}
    for name, fdef in fdefs.items():
        # The functions each one calls: a SavedModel rebuilds its graph with them.
        callees = {c for node in fdef.node_def for c in _called_names(node, fdefs)}
        library[name]._children = [library[c] for c in sorted(callees)]
    del graph_def.library.function[:]
    del graph_def.library.gradient[:]
    # Registered for the life of the process, as before they were held by the
    # graph: other callers (the non-finite probe, tests) run graphs that call
    # these functions without holding them, and a dropped AtomicFunction leaves
    # the eager context.
    _kept_library.extend(library.values())
    return list(library.values())


def _flat_function_type(fdef) -> function_type_lib.FunctionType:
    """The FunctionType of a library FunctionDef: positional tensors in, a tuple out."""

    def specs(args):
        return tuple(tf.TensorSpec(None, tf.dtypes.as_dtype(arg.type)) for arg in args)

    return function_type_lib.from_structured_signature(
        (specs(fdef.signature.input_arg), {}), specs(fdef.signature.output_arg))


def _rename_references(node_defs, names: dict[str, str]) -> None:
    for node_def in node_defs:
        if node_def.op in names:
            node_def.op = names[node_def.op]
        for key, value in node_def.attr.items():
            _rename_attr(key, value, names)


def _rename_attr(key: str, value, names: dict[str, str]) -> None:
    if value.HasField("func") and value.func.name in names:
        value.func.name = names[value.func.name]
    for func in value.list.func:
        if func.name in names:
            func.name = names[func.name]
    if key in _FUNC_NAME_STRING_ATTRS and value.s.decode() in names:
        value.s = names[value.s.decode()].encode()


def _import_as_func_graph(graph_def: graph_pb2.GraphDef, old,
                          replaced: dict[str, Any]) -> func_graph_lib.FuncGraph:
    new = func_graph_lib.FuncGraph(old.name + "_tfamp")
    with new.as_default():
        importer.import_graph_def(graph_def, name="")
    external_of = {id(internal): replaced.get(internal.name, external)
                   for external, internal in old.captures}
    new.inputs = []
    for placeholder in old.inputs:  # same order: arguments, then captures
        mirror = new.get_tensor_by_name(placeholder.name)
        if id(placeholder) in external_of:
            new.add_capture(external_of[id(placeholder)], mirror)
        else:  # an argument, or a call-time capture registered below
            new.inputs.append(mirror)
    # Call-time ("by reference") captures, e.g. tf.distribute's collective keys:
    # their closures are evaluated at every call and fed to these placeholders.
    captures = old.function_captures
    for key, internal in captures.by_ref_internal.items():
        mirrored = nest.map_structure(lambda t: new.get_tensor_by_name(t.name), internal)
        new.function_captures.add_or_replace(
            key=key, external=captures.by_ref_external[key], internal=mirrored,
            tracetype=captures.by_ref_tracetype[key], is_by_ref=True)
    new.outputs = [new.get_tensor_by_name(t.name) for t in old.outputs]
    new.control_outputs = [new.get_operation_by_name(op.name) for op in old.control_outputs]

    def mirror_output(value):
        if isinstance(value, tf.Tensor):
            return new.get_tensor_by_name(value.name)
        if isinstance(value, tf.Operation):
            return new.get_operation_by_name(value.name)
        return value

    leaves = nest.flatten(old.structured_outputs, expand_composites=True)
    if leaves and all(isinstance(leaf, tf.TensorSpec) for leaf in leaves):
        # A loaded SavedModel signature records its outputs as specs, one per
        # graph output, in order.
        new.structured_outputs = nest.pack_sequence_as(
            old.structured_outputs, new.outputs, expand_composites=True)
    else:
        new.structured_outputs = nest.map_structure(
            mirror_output, old.structured_outputs, expand_composites=True)
    new.structured_input_signature = old.structured_input_signature
    new.variables = old.variables
    return new


def _function_name(concrete) -> str:
    name = concrete.name
    return name.decode() if isinstance(name, bytes) else str(name)


def only_calls_handled_functions(graph, config: AmpConfig) -> bool:
    """True if `graph` calls a function tfamp already handled and has no allow-list op.

    Args:
      graph: a FuncGraph (a traced tf.function body).
      config: the rewrite settings (their allow list decides what could convert).

    The graph's own nodes and every library function it reaches, except the
    handled ones, are searched for an allow-list op: with none, rewriting the
    graph again would convert nothing and only log an empty summary.
    """
    called = getattr(graph, "_functions", {})
    if not any(name in _handled_function_names for name in called):
        return False  # the common case, decided without serialising the graph
    graph_def = graph.as_graph_def()
    library = {f.signature.name: f for f in graph_def.library.function}
    allow = config.op_lists.allow
    seen: set[str] = set()
    calls_handled = False
    pending = [list(graph_def.node)]
    while pending:
        for node in pending.pop():
            if node.op in allow:
                return False
            for name in _called_names(node, library):
                if name in _handled_function_names:
                    calls_handled = True
                elif name not in seen:
                    seen.add(name)
                    pending.append(list(library[name].node_def))
    return calls_handled


def _called_names(node, library) -> list[str]:
    names = [node.op] if node.op in library else []
    for value in node.attr.values():
        if value.HasField("func"):
            names.append(value.func.name)
        names.extend(f.name for f in value.list.func)
    return [n for n in names if n in library]


# The fields Function.__init__ sets (RewrittenFunction never runs it), and the first
# trace's, which tf_keras's TensorBoard callback reads to write the train graph (the
# step as traced, float32): read from the wrapped tf.function.
_FUNCTION_FIELDS = frozenset({
    "_lock", "_python_function", "_function_type", "_default_values", "_function_cache",
    "_function_captures", "_attributes", "_is_pure", "_shared_rendezvous", "_autograph",
    "_experimental_autograph_options", "_reduce_retracing", "_jit_compile",
    "_created_variables", "_variable_creation_config", "_no_variable_creation_config",
    "_descriptor_cache", "_name", "_key_for_call_stats", "_omit_frequent_tracing_warning",
    "_concrete_variable_creation_fn",
})


class RewrittenFunction(polymorphic_function.Function):
    """A tf.function whose every concrete function runs tfamp-rewritten.

    Call it like the original. Each new input signature traces the original,
    rewrites that graph once, and caches the result. ``reports`` holds one
    RewriteReport per rewritten concrete function.

    It is a ``tf.function`` wherever TensorFlow asks (``isinstance`` of its
    ``Function`` class), and every way TensorFlow reads one gets the rewritten
    graphs: ``get_concrete_function``, ``experimental_get_compiler_ir``,
    ``tf.saved_model.save`` (as a module attribute or in ``signatures=``). The
    tracing itself is the original tf.function's: this class never runs
    ``Function.__init__``, and what it does not answer itself (the tracing
    count, ``function_spec``, options) the original answers.
    """

    def __init__(self, fn: Callable, config: AmpConfig | None = None, *,
                 check: bool = False, after_call: Callable[[Any], None] | None = None,
                 on_report: Callable[[RewriteReport], None] | None = None,
                 on_trace: Callable[[Any, RewrittenGraph], None] | None = None,
                 before_new_trace_runs: Callable[[Any, Any, tuple, dict], None] | None = None,
                 float32_when_saving: bool = False,
                 config_of: Callable[[], AmpConfig] | None = None,
                 after_eager_call: Callable[[Any, tuple, dict, Any], None] | None = None,
                 **tf_function_kwargs):
        if not callable(fn):
            raise TypeError(
                f"tfamp.function expects a Python function or a tf.function, "
                f"received {type(fn).__name__}.")
        if isinstance(fn, RewrittenFunction):
            # Rewrite its tf.function with these settings, not its rewritten graphs
            # again (e.g. tfamp.function around a tf.function under TFAMP_ENABLE).
            fn = fn._tf_function
        if isinstance(fn, tf.types.experimental.PolymorphicFunction):
            if tf_function_kwargs:
                raise TypeError(
                    f"tf.function options {sorted(tf_function_kwargs)} were given "
                    f"for an existing tf.function; set them where it is created.")
            self._tf_function = fn
        else:
            self._tf_function = tf.function(fn, **tf_function_kwargs)
        self._config = config or AmpConfig()
        # () -> the AmpConfig to rewrite with now, where it can change while the
        # function lives (TFAMP_ENABLE's process config, which a custom loop's float32
        # fallback extends): a trace rewritten with another config is rewritten again.
        self._config_of = config_of
        self._check = check
        self._after_call = after_call
        self._on_report = on_report
        self._on_trace = on_trace
        # (tf.function, rewritten ConcreteFunction, args, kwargs) -> None, called
        # eagerly before each rewritten trace first runs (a custom loop's
        # start-scale probe: tfamp.runtime.startup); ids of those that ran
        self._before_new_trace_runs = before_new_trace_runs
        self._ran: set[int] = set()
        # (tf.function, args, kwargs, outputs) -> None, after each call made eagerly (a
        # custom loop's float32 fallback watching its skipped steps: runtime.startup)
        self._after_eager_call = after_eager_call
        # Under TFAMP_ENABLE every tf.function is one of these, those Keras traces to
        # save a model too (SavedModel, and TFLite's converter, which saves one
        # first): a script that saves its float32 model gets a float32 one, as
        # without tfamp (tfamp export makes a 16-bit one, checked against float32).
        # So is a function the script calls inside its tf.data pipeline (pix2pix's
        # augmentation), which runs on the host, where 16 bits gain nothing: it runs
        # as traced, float32 (a product of values past 65504 gave inf and nan).
        self._float32_when_saving = float32_when_saving
        # id(traced) -> (traced, rewritten, report, the config it was rewritten with)
        self._rewritten: dict[int, tuple[Any, Any, RewriteReport | None, AmpConfig]] = {}
        self._logged: set[str] = set()  # the summary lines its traces logged
        # One bound RewrittenFunction per instance, as tf.function keeps (not in
        # the instance's __dict__, where a tf.Module would save it as a function).
        self._bound = weakref.WeakKeyDictionary()
        functools.update_wrapper(self, fn, updated=())  # name and docstring only

    @property
    def config(self) -> AmpConfig:
        return self._config_of() if self._config_of is not None else self._config

    @property
    def reports(self) -> list[RewriteReport]:
        return [entry[2] for entry in self._rewritten.values() if entry[2] is not None]

    def _current(self, concrete):
        """The rewritten ConcreteFunction of traced `concrete` with the config of now,
        or None where it has none yet."""
        entry = self._rewritten.get(id(concrete))
        if entry is None or entry[0] is not concrete or entry[3] is not self.config:
            return None
        return entry[1]

    def set_after_call(self, after_call: Callable[[Any], None] | None) -> None:
        """Sets the hook run with the outputs after every call (e.g. a monitor)."""
        self._after_call = after_call

    def set_on_trace(self, on_trace: Callable[[Any, RewrittenGraph], None] | None) -> None:
        """Sets the hook run with each new traced (float32) ConcreteFunction and its
        rewrite (``RewrittenGraph``, not yet built: read it, do not keep or change
        it), before the rewrite first runs."""
        self._on_trace = on_trace

    def __getattr__(self, name: str):
        # Anything else a tf.function offers answers for the original, and so do
        # the fields Function.__init__ sets, which TensorFlow's own code reads
        # (`fn._jit_compile`, ...). Other private names are not forwarded:
        # Trackable keeps its own state in them.
        if name.startswith("_") and name not in _FUNCTION_FIELDS:
            raise AttributeError(name)
        return getattr(self._tf_function, name)

    def __getstate__(self):  # Function's own expects the fields its __init__ sets
        state = self.__dict__.copy()
        state.pop("_bound", None)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._bound = weakref.WeakKeyDictionary()

    # -- what the original tf.function answers ----------------------------------

    @property
    def name(self) -> str:
        return self._tf_function.name

    @property
    def python_function(self) -> Callable:
        return self._tf_function.python_function

    @property
    def input_signature(self):
        return self._tf_function.input_signature

    @property
    def function_spec(self):
        return self._tf_function.function_spec

    @property
    def function_type(self):
        return self._tf_function.function_type

    def experimental_get_tracing_count(self) -> int:
        return self._tf_function.experimental_get_tracing_count()

    def pretty_printed_concrete_signatures(self, verbose=True) -> str:
        return self._tf_function.pretty_printed_concrete_signatures(verbose)

    def get_initialization_function(self, *args, **kwargs):
        return self._tf_function.get_initialization_function(*args, **kwargs)

    # -- the rewritten concrete functions ---------------------------------------

    def get_concrete_function(self, *args, **kwargs):
        """The rewritten ConcreteFunction for these arguments (traced if new)."""
        with _tracing_for_tfamp():
            concrete = self._tf_function.get_concrete_function(*args, **kwargs)
        rewritten = self._current(concrete)
        return rewritten if rewritten is not None else self._rewritten_for(concrete)

    def _get_concrete_function_garbage_collected(self, *args, **kwargs):
        # What tf.saved_model's signatures= asks a tf.function for.
        return self.get_concrete_function(*args, **kwargs)

    def _list_all_concrete_functions(self) -> list:
        # Every traced signature, rewritten; Function's own
        # _list_all_concrete_functions_for_serialization (what SavedModel
        # saves) and experimental_get_compiler_ir build on this and
        # get_concrete_function.
        if self.input_signature is not None:
            self.get_concrete_function()
        originals = self._tf_function._list_all_concrete_functions()
        return [self._rewritten_for(concrete) for concrete in originals]

    def _rewritten_for(self, concrete):
        if self._float32_when_saving and _in_save_context():
            return concrete
        config = self.config
        rewritten = self._current(concrete)
        if rewritten is None:
            if only_calls_handled_functions(concrete.graph, config):
                # e.g. Keras 3's multi_step_on_iterator around the rewritten step:
                # nothing of its own to convert, so no second rewrite or log line.
                log.debug("tfamp: %s only calls functions tfamp already rewrote; run as "
                          "traced", _display_name(concrete.graph.name))
                _handled_function_names.add(_function_name(concrete))
                self._rewritten[id(concrete)] = (concrete, concrete, None, config)
                return concrete
            new_graph_def, report = _rewrite(concrete, config)
            if self._on_trace is not None:
                # A new trace, before it first runs: the start-scale probe reads the
                # traced float32 graph and checks its scale on the rewritten one
                # (tfamp.keras.start_scale), which it must neither keep nor change.
                self._on_trace(concrete, RewrittenGraph(new_graph_def, report))
            rewritten, report = _built(concrete, new_graph_def, report, check=self._check,
                                       logged=self._logged)
            if not report.converted:
                rewritten = concrete  # nothing to gain: run the original as traced
            _handled_function_names.add(_function_name(rewritten))
            self._rewritten[id(concrete)] = (concrete, rewritten, report, config)
            if self._on_report is not None:
                self._on_report(report)
        return rewritten

    def _clone(self, python_function):
        # How tf.distribute's MirroredStrategy.run lifts a tf.function around its
        # replica loop: the clone must be rewritten too.
        return self._rewrapped(self._tf_function._clone(python_function))

    def _decorate(self, decorator):
        self._tf_function._decorate(decorator)  # in place, before any trace

    def with_config(self, config: AmpConfig) -> RewrittenFunction:
        """The same tf.function rewritten with `config` (nothing rewritten yet; its
        traces are reused). Used when a model's settings change after its functions
        were built (e.g. the float32 fallback, ``tfamp.keras.fallback``)."""
        return RewrittenFunction(self._tf_function, config, check=self._check,
                                 after_call=self._after_call, on_report=self._on_report,
                                 on_trace=self._on_trace,
                                 before_new_trace_runs=self._before_new_trace_runs,
                                 float32_when_saving=self._float32_when_saving,
                                 after_eager_call=self._after_eager_call)

    def _rewrapped(self, tf_function) -> RewrittenFunction:
        return RewrittenFunction(tf_function, self._config, check=self._check,
                                 after_call=self._after_call, on_report=self._on_report,
                                 on_trace=self._on_trace,
                                 before_new_trace_runs=self._before_new_trace_runs,
                                 float32_when_saving=self._float32_when_saving,
                                 config_of=self._config_of,
                                 after_eager_call=self._after_eager_call)

    # Called inside another function's trace (a user's tf.function around a
    # tfamp.function), autograph would otherwise convert this call and, through it,
    # the whole rewrite pass: 25-40 s on the first trace of a two-op function.
    @tf.autograph.experimental.do_not_convert
    def __call__(self, *args, **kwargs):
        if (self._float32_when_saving and not tf.executing_eagerly()
                and _in_input_pipeline()):
            left_in_pipelines.add(self.__name__)
            return self._tf_function(*args, **kwargs)
        # A first call traces, rewrites and (under XLA) compiles: said in one line
        # when it takes long (runtime/progress.py).
        entered = progress.enter(self)
        try:
            outputs = self._call_traced(args, kwargs)
            if outputs is _NOT_TRACED:
                concrete = self.get_concrete_function(*args, **kwargs)
                config = self.config
                if (self._before_first_run(concrete, args, kwargs)
                        and self.config is not config):  # (the hook moved layers to float32)
                    concrete = self.get_concrete_function(*args, **kwargs)
                outputs = concrete(*args, **kwargs)
        finally:
            progress.leave(entered)
        if self._after_call is not None:
            self._after_call(outputs)
        if self._after_eager_call is not None and tf.executing_eagerly():
            self._after_eager_call(self._tf_function, args, kwargs, outputs)
        return outputs

    def _before_first_run(self, concrete, args, kwargs) -> bool:
        """Runs the before-first-run hook once per rewritten trace; True if it ran
        (and may have changed the config: the caller looks the trace up again)."""
        if self._before_new_trace_runs is None or id(concrete) in self._ran:
            return False
        if not tf.executing_eagerly():  # (called inside another trace: it does not run now)
            return False
        self._ran.add(id(concrete))
        self._before_new_trace_runs(self._tf_function, concrete, args, kwargs)
        return True

    def _call_traced(self, args, kwargs):
        """The call of an already rewritten trace, as cheap as a tf.function's own.

        What ``tf.function`` does on a call, with the rewritten ConcreteFunction in
        place of the traced one: the arguments are canonicalised once, the trace is
        looked up in the original's cache, and the flat call skips the structured
        re-binding a ConcreteFunction call does. Returns ``_NOT_TRACED`` (and runs
        nothing) when the original was never called, a new trace would be needed,
        or the trace has no rewrite yet: the full path below handles those.
        """
        original = self._tf_function
        config = (original._no_variable_creation_config if original._created_variables
                  else original._variable_creation_config)
        if config is None:
            return _NOT_TRACED
        bound = function_type_utils.canonicalize_function_inputs(
            args, kwargs, original._function_type, original._default_values,
            original._is_pure)
        with _tracing_for_tfamp():
            concrete = tracing_compilation.trace_function(bound.args, bound.kwargs, config)
        rewritten = self._current(concrete)
        if rewritten is None:
            return _NOT_TRACED
        if (self._before_first_run(rewritten, args, kwargs)
                and self._current(concrete) is not rewritten):  # (the hook moved layers)
            return _NOT_TRACED
        flat = rewritten.function_type.unpack_inputs(
            rewritten.function_type.bind(*bound.args, **bound.kwargs))
        return rewritten._call_flat(flat, captured_inputs=rewritten.captured_inputs)

    def __get__(self, instance, owner):
        # As a method decorator: bind like a tf.function does, one per instance.
        if instance is None:
            return self
        bound = self._bound.get(instance)
        if bound is None:
            bound = self._rewrapped(self._tf_function.__get__(instance, owner))
            self._bound[instance] = bound
        return bound


def rewrite_function(fn: Callable, config: AmpConfig | None = None, *,
                     check: bool = False, **tf_function_kwargs) -> RewrittenFunction:
    """Returns `fn` (a tf.function or Python function) running in mixed precision.

    Args:
      fn: the function to trace and rewrite.
      config: the rewrite settings; ``AmpConfig()`` if None.
      check: validate every rewritten graph with ``check_graph_def`` (slower).
      **tf_function_kwargs: passed to ``tf.function`` when `fn` is plain Python.

    Example:
      >>> step = tfamp.rewrite_function(train_step)   # a tf.function
      >>> loss = step(x, y)                           # runs rewritten
      >>> print(step.reports[0].summary_line())
    """
    return RewrittenFunction(fn, config, check=check, **tf_function_kwargs)


def function(fn: Callable | None = None, *, config: AmpConfig | None = None,
             check: bool = False, **tf_function_kwargs):
    """Decorator form of ``rewrite_function``.

    Use as ``@tfamp.function`` or ``@tfamp.function(config=AmpConfig(...))``.
    """
    if fn is None:
        return functools.partial(function, config=config, check=check, **tf_function_kwargs)
    return RewrittenFunction(fn, config, check=check, **tf_function_kwargs)
