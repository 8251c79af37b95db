"""The 16-bit serving function of one signature: tfamp's rewrite of its graph, weights
stored in 16-bit where only 16-bit ops read them, bound to the new variables.

The graph is rewritten as ``tfamp rewrite`` would (the same report), the weights
are folded (``weights``), and the edited GraphDef is imported as a new
ConcreteFunction with the signature's own call signature
(``runtime.runner.concrete_from_graph_def``), its captured placeholders bound to
the 16-bit variables made here or to the original float32 ones.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tensorflow.core.framework import graph_pb2

from tfamp.config import AmpConfig
from tfamp.rewrite import rewrite_graph_def
from tfamp.rewrite.check import find_problems
from tfamp.rewrite.graph import build_view
from tfamp.rewrite.report import RewriteReport
from tfamp.runtime.runner import concrete_from_graph_def
from tfamp.serving.errors import ExportError
from tfamp.serving.source import Signature
from tfamp.serving.weights import WeightPlan, plan_weights, store_16bit


@dataclasses.dataclass
class Rewritten:
    """One signature's rewrite and what it allows for its weights."""

    signature: Signature
    graph_def: graph_pb2.GraphDef        # tfamp's rewrite, weights not yet folded
    report: RewriteReport
    plans: dict[str, WeightPlan]         # captured placeholder node -> decision


def rewrite_signature(signature: Signature, config: AmpConfig) -> Rewritten:
    """Rewrites `signature`'s graph with `config` and plans its weights.

    Raises:
      ExportError: the rewrite refused the graph (it says why).
    """
    graph = signature.function.graph
    graph_def = graph.as_graph_def(add_shapes=True)  # shapes: decisions by bytes
    outputs = [t.name for t in graph.outputs]
    try:
        new_graph_def, report = rewrite_graph_def(graph_def, config, outputs=outputs,
                                                  function_name=signature.name)
    except ValueError as err:  # a graph the pass cannot take, or GraphCheckError
        raise ExportError(f"signature {signature.name!r}: {err}") from err
    placeholders = [c.placeholder.split(":")[0] for c in signature.captures
                    if c.variable is not None]
    plans = plan_weights(new_graph_def, placeholders, outputs, config.target_enum)
    return Rewritten(signature, new_graph_def, report, plans)


def build_function(rewritten: Rewritten, stored: set[str], target: int,
                   new_variables: dict[int, Any]) -> tuple[Any, graph_pb2.GraphDef]:
    """The signature's 16-bit ConcreteFunction and the GraphDef it runs.

    Args:
      rewritten: the signature's rewrite.
      stored: captured placeholder node names whose weights are stored 16-bit
        (decided across every signature capturing them).
      target: the 16-bit DataType enum.
      new_variables: id(original variable) -> its 16-bit replacement.

    Raises:
      ExportError: the edited graph is not valid (a tfamp defect; the message
        names the problem).
    """
    plans = [p for name, p in rewritten.plans.items() if name in stored]
    graph_def = store_16bit(rewritten.graph_def, plans, target)
    if plans:
        before = {p.message for p in find_problems(build_view(rewritten.graph_def),
                                                   round_trips=False)}
        problems = [p.message for p in find_problems(build_view(graph_def), round_trips=False)
                    if p.message not in before]
        if problems:
            raise ExportError(
                f"signature {rewritten.signature.name!r}: storing weights in 16-bit made an "
                f"invalid graph ({problems[0]}); export with --keep-fp32 naming that node, "
                f"and report this to tfamp")
    captures = {}
    for capture in rewritten.signature.captures:
        name = capture.placeholder.split(":")[0]
        if name in stored:
            captures[capture.placeholder] = new_variables[id(capture.variable)].handle
    function = concrete_from_graph_def(graph_def, rewritten.signature.function,
                                       captures=captures)
    return function, graph_def


def new_16bit_variable(variable, dtype) -> Any:
    """A variable holding `variable`'s value in `dtype` (same name and trainability)."""
    import tensorflow as tf

    name = variable.name.split(":")[0]
    return tf.Variable(tf.cast(variable.read_value(), dtype), trainable=variable.trainable,
                       name=name)
