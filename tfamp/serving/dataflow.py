"""Where a tensor of a signature's top graph is read, through Identity ops and
function calls, in whichever body reads it.

A SavedModel signature's graph is a call of the model's function: its
variables are captured as placeholders of the top graph and passed as arguments
to the call, so their readers live in the function's body (or deeper).
"""

from __future__ import annotations

import dataclasses

from tfamp.rewrite.graph import Body, GraphView, TensorRef

CALL_OPS = frozenset({"PartitionedCall", "StatefulPartitionedCall"})
# Ops that pass a tensor on unchanged (a resource handle or a value).
PASS_THROUGH = frozenset({"Identity"})


@dataclasses.dataclass(frozen=True)
class Use:
    """A node that reads the tensor: in `body` ("" for the top graph), its input `index`."""

    body: str
    node: str
    index: int


@dataclasses.dataclass
class Uses:
    """Every use of one top-graph tensor (calls and Identity ops followed).

    Attributes:
      reads: the nodes that read it and are neither calls nor Identity ops.
      entries: (function, argument index) -> the call sites the tensor entered
        that argument through, as (body, node) pairs.
    """

    reads: list[Use] = dataclasses.field(default_factory=list)
    entries: dict[tuple[str, int], set[tuple[str, str]]] = dataclasses.field(
        default_factory=dict)


class Flow:
    """Follows tensors of one GraphView's top graph into the bodies that read them."""

    def __init__(self, view: GraphView):
        self.view = view
        self.bodies: dict[str, Body] = {body.name: body for body in view.bodies}
        self._call_sites: dict[str, list[tuple[str, str]]] | None = None

    def callee(self, body: Body, node_name: str) -> str | None:
        """The function a call node runs, or None for any other node."""
        node = body.nodes[node_name]
        if node.op in CALL_OPS and node.called_functions:
            return node.called_functions[0]
        if node.op in self.view.signatures:
            return node.op
        return None

    def call_sites(self, function: str) -> list[tuple[str, str]]:
        """Every (body, node) that calls `function` directly."""
        if self._call_sites is None:
            sites: dict[str, list[tuple[str, str]]] = {}
            for body in self.view.bodies:
                for name in body.nodes:
                    called = self.callee(body, name)
                    if called is not None:
                        sites.setdefault(called, []).append((body.name, name))
            self._call_sites = sites
        return self._call_sites.get(function, [])

    def uses(self, body_name: str, ref: TensorRef) -> Uses:
        """The uses of `ref` in body `body_name`, following calls and Identity ops."""
        found = Uses()
        pending = [(body_name, ref)]
        seen = set()
        while pending:
            where, tensor = pending.pop()
            if (where, tensor) in seen:
                continue
            seen.add((where, tensor))
            body = self.bodies[where]
            for consumer, index in body.consumers.get(tensor, ()):
                node = body.nodes[consumer]
                called = self.callee(body, consumer)
                signature = self.view.signatures.get(called) if called else None
                if signature is not None and index < len(signature.input_arg):
                    found.entries.setdefault((called, index), set()).add((where, consumer))
                    arg = signature.input_arg[index].name
                    pending.append((called, TensorRef(arg, 0, True)))
                elif node.op in PASS_THROUGH:
                    pending.append((where, TensorRef(consumer, 0)))
                else:
                    found.reads.append(Use(where, consumer, index))
        return found
