"""Which bodies of a graph XLA compiles (and so need XLA kernels; see kernels.py)."""

from __future__ import annotations

from tfamp.rewrite.graph import GraphView, must_compile


def xla_compiled(view: GraphView, runtime: str) -> frozenset[str]:
    """The names of the bodies ("" for the top graph) that XLA compiles.

    Args:
      view: the graph and its library.
      runtime: the step's runtime (``runtime_cost``); "xla" means the whole
        step is compiled (Keras 3's ``jit_compile``), so every body is.

    Returns:
      With "xla", every body. Otherwise the functions marked to be compiled
      (``_XlaMustCompile`` true on the FunctionDef or on a call site:
      ``tf.function(jit_compile=True)`` nested in a step that is not), and
      every function those call: XLA compiles a cluster with all it calls.
    """
    bodies = {body.name: body for body in view.bodies}
    if runtime == "xla":
        return frozenset(bodies)
    stack = [name for name, body in bodies.items() if body.xla_must_compile]
    for body in view.bodies:
        for node in body.nodes.values():
            if node.called_functions and must_compile(node.node_def.attr):
                stack.extend(node.called_functions)
    compiled: set[str] = set()
    while stack:
        name = stack.pop()
        if name in compiled or name not in bodies:
            continue
        compiled.add(name)
        for node in bodies[name].nodes.values():
            stack.extend(node.called_functions)
    return frozenset(compiled)
