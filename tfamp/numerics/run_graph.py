"""Running a GraphDef (a step's graph, rewritten or instrumented) on the live variables.

``run_imported`` imports the GraphDef into a fresh tf.function with the traced
function's captures (its variables) bound, so a rewritten or instrumented copy
of a step runs on the model's current weights without changing them.
"""

from __future__ import annotations

import itertools

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2

from tfamp.runtime.plain import plain_function

_counter = itertools.count()


def run_imported(concrete, graph_def: graph_pb2.GraphDef, fetches: list[str],
                 flat_args: list, post=None, inner=None) -> list[np.ndarray]:
    """Runs `graph_def` (concrete's graph or a rewrite of it) on its live captures.

    Args:
      concrete: the ConcreteFunction whose captures (variables) to bind.
      graph_def: its graph, possibly rewritten or instrumented.
      fetches: tensor names to return.
      flat_args: the tensor arguments, flattened.
      post: optional; maps the fetched tensors to other tensors inside the
        same graph (e.g. on-device histograms), so only its results leave.
      inner: optional (call NodeDef, callee GraphDef, callee argument tensor
        names): `fetches` name tensors of the callee, which is imported with
        its arguments bound to the call's inputs (a SavedModel signature is a
        single call of the model's function).
    """
    from tfamp.runtime.runner import _register_renamed_library

    graph_def_copy = graph_pb2.GraphDef()
    graph_def_copy.CopyFrom(graph_def)
    _register_renamed_library(graph_def_copy, f"_tfamp_nf{next(_counter)}")
    old = concrete.graph
    internal_ids = {id(internal) for _, internal in old.captures}
    arguments = [t for t in old.inputs if id(t) not in internal_ids]
    captures = [(internal.name, external) for external, internal in old.captures]
    if len(arguments) != len(flat_args):
        raise ValueError(f"the step takes {len(arguments)} tensor arguments, received "
                         f"{len(flat_args)}")

    def run(*values):
        graph = tf.compat.v1.get_default_graph()
        # (a variable passed as an argument: the trace took its resource handle)
        input_map = {ph.name: graph.capture(value.handle) if isinstance(value, tf.Variable)
                     else value for ph, value in zip(arguments, values, strict=True)}
        for name, external in captures:
            input_map[name] = graph.capture(external)
        if inner is None:
            results = tf.graph_util.import_graph_def(
                graph_def_copy, input_map=input_map, return_elements=fetches, name="")
        else:
            call, callee, arg_names = inner
            sources = [i if ":" in i else f"{i}:0" for i in call.input if not i.startswith("^")]
            unbound = [s for s in sources if s not in input_map]
            if unbound:
                raise ValueError(f"call {call.name!r} takes inputs that are not arguments or "
                                 f"captures ({unbound[:3]}); cannot run its body alone")
            callee_map = {arg: input_map[src]
                          for arg, src in zip(arg_names, sources, strict=True)}
            results = tf.graph_util.import_graph_def(
                callee, input_map=callee_map, return_elements=fetches, name="")
        results = [tf.identity(r) for r in results]
        return list(post(results)) if post is not None else results

    # The plain tf.function: under TFAMP_ENABLE tf.function is tfamp's, which would
    # rewrite the already rewritten graph again with the process's settings.
    outputs = plain_function(run, autograph=False)(*flat_args)
    return [o.numpy() for o in outputs]
