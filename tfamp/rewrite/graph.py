"""Read-only view of a GraphDef and its function library: ports, edges, dtypes.

A ``GraphView`` holds one ``Body`` per place nodes live: the top graph and each
library function. Every node's inputs and outputs are resolved to ``Port``s
(dtype and the type attribute that sets it) and every data edge to its producer,
so later stages never parse input strings or OpDefs themselves.

GraphDef inputs read ``node:3``; FunctionDef inputs read ``node:out_arg:0`` or
an argument name. Both resolve to a ``TensorRef`` with a flat output index.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from typing import NamedTuple

from tensorflow.core.framework import graph_pb2, op_def_pb2, types_pb2
from tensorflow.python.framework import op_def_registry, tensor_util

DT_FLOAT = types_pb2.DT_FLOAT
DT_HALF = types_pb2.DT_HALF
DT_BFLOAT16 = types_pb2.DT_BFLOAT16
FLOAT_TYPES = frozenset({DT_FLOAT, DT_HALF, DT_BFLOAT16})

# Attributes whose value names a function the node calls.
FUNC_ATTRS = ("f", "body", "cond", "then_branch", "else_branch", "branches")
# The attribute, on a FunctionDef or a call site, that says XLA compiles the
# function (tf.function(jit_compile=...) sets it, True or False).
XLA_MUST_COMPILE = "_XlaMustCompile"


def dtype_name(dtype: int) -> str:
    """'float32', 'float16', 'int32', ... for a DataType enum."""
    names = {DT_FLOAT: "float32", DT_HALF: "float16", DT_BFLOAT16: "bfloat16"}
    if dtype in names:
        return names[dtype]
    return types_pb2.DataType.Name(dtype).removeprefix("DT_").lower()


@dataclasses.dataclass(frozen=True)
class Port:
    """One input or output of a node.

    Attributes:
      dtype: the DataType enum it carries now.
      type_attr: the node attribute that sets it ("T", or "Tin[2]" for element
        2 of a list attribute), or None when the OpDef or function signature
        fixes the type.
      is_ref: a TF1 reference (``is_ref`` in the OpDef, or a ``*_REF`` dtype):
        the port is a variable's storage, not a value.
    """

    dtype: int
    type_attr: str | None
    is_ref: bool = False


class TensorRef(NamedTuple):
    """A tensor in a body: output `index` of node `node`, or argument `node`.

    A NamedTuple rather than a frozen dataclass: refs are dict keys everywhere
    in the pass, and a tuple hashes and compares in C (about 6% of the pass
    time on a ResNet-50 training step).
    """

    node: str
    index: int = 0
    is_arg: bool = False


@dataclasses.dataclass(slots=True)
class Node:
    """A node with its ports and resolved data inputs."""

    name: str
    op: str
    node_def: object  # the NodeDef proto (read only here)
    known_op: bool
    inputs: list[Port]
    outputs: list[Port]
    data_inputs: list[tuple[TensorRef, str]]  # (producer, input string as written)
    called_functions: list[str]
    # The type attributes that set a float32 port, inputs then outputs, each
    # once: the node's candidate slots for colouring.
    float_type_attrs: tuple[str, ...]
    # output arg name -> flat index of its first output (read-only, may be shared)
    output_offsets: dict[str, int] = dataclasses.field(default_factory=dict, repr=False)


@dataclasses.dataclass
class Body:
    """The nodes of the top graph (name "") or of one library function."""

    name: str
    is_function: bool
    nodes: dict[str, Node]
    arg_dtypes: dict[str, int]
    # FunctionDef ret name -> (producer, string as written, signature dtype).
    rets: dict[str, tuple[TensorRef, str, int]]
    # producer -> [(consumer node name, flat input index)]
    consumers: dict[TensorRef, list[tuple[str, int]]]
    # FunctionDef attribute names (e.g. "api_implements"); empty for the top graph.
    function_attrs: frozenset[str] = frozenset()
    # Whether the FunctionDef says XLA must compile it (``_XlaMustCompile``:
    # tf.function(jit_compile=True)); False for the top graph.
    xla_must_compile: bool = False
    # With build_view's `earlier`: the nodes whose NodeDef is new or differs
    # from the one of the same name there (every other node, and every edge
    # between two such others, reads exactly as before). None when the body is
    # not compared (no `earlier`, a new function, or a changed signature).
    edited: frozenset[str] | None = None
    # source node -> the nodes with a control input on it ("^source"); built
    # while reading the top graph and kept up to date by _patch_top_body, else
    # read from the NodeDefs on first use (see waiters()).
    _waiters: dict[str, list[str]] | None = dataclasses.field(
        default=None, repr=False, compare=False)

    def waiters(self) -> dict[str, list[str]]:
        """Source node name -> names of the nodes that wait on it (control inputs)."""
        if self._waiters is None:
            waiters: dict[str, list[str]] = {}
            for name, node in self.nodes.items():
                texts = node.node_def.input
                if len(texts) > len(node.data_inputs):
                    for text in texts:
                        if text.startswith("^"):
                            waiters.setdefault(text[1:], []).append(name)
            self._waiters = waiters
        return self._waiters

    def producer_port(self, ref: TensorRef) -> Port | None:
        """The port that produces `ref`, or None if its producer is unknown."""
        if ref.is_arg:
            dtype = self.arg_dtypes.get(ref.node)
            return None if dtype is None else Port(dtype, None)
        node = self.nodes.get(ref.node)
        if node is None or ref.index >= len(node.outputs):
            return None
        return node.outputs[ref.index]

    def topological_order(self) -> list[str]:
        """Node names, producers before consumers (ignoring back edges)."""
        indegree = {name: 0 for name in self.nodes}
        for name, node in self.nodes.items():
            for ref, _ in node.data_inputs:
                if not ref.is_arg and ref.node in self.nodes:
                    indegree[name] += 1
        ready = [name for name, deg in indegree.items() if deg == 0]
        order = []
        while ready:
            name = ready.pop()
            order.append(name)
            for ref in self.output_refs(name):
                for consumer, _ in self.consumers.get(ref, ()):
                    indegree[consumer] -= 1
                    if indegree[consumer] == 0:
                        ready.append(consumer)
        if len(order) < len(self.nodes):  # cycles (TF1 loops): append the rest
            placed = set(order)
            order.extend(n for n in self.nodes if n not in placed)
        return order

    @functools.cached_property
    def ops(self) -> frozenset[str]:
        """The op types of its nodes (does the body have any loop, TensorList...?)."""
        return frozenset({node.op for node in self.nodes.values()})

    def output_refs(self, name: str) -> Iterator[TensorRef]:
        for index in range(len(self.nodes[name].outputs)):
            yield TensorRef(name, index)


@dataclasses.dataclass
class GraphView:
    """All bodies of a GraphDef: the top graph first, then library functions."""

    bodies: list[Body]
    signatures: dict[str, op_def_pb2.OpDef]
    # With build_view's `earlier`: library functions whose signature is new or
    # differs from the one there; None without `earlier`.
    edited_signatures: frozenset[str] | None = None
    # What read the ports (its caches hold for another view of a graph with
    # the same function signatures).
    resolver: _PortResolver | None = dataclasses.field(default=None, repr=False,
                                                        compare=False)

    def node_count(self) -> int:
        return sum(len(body.nodes) for body in self.bodies)


def build_view(graph_def: graph_pb2.GraphDef, *,
               earlier: GraphView | None = None,
               written: dict[str, dict[str, object]] | None = None) -> GraphView:
    """Resolves every node, port and edge of `graph_def` and its library.

    Args:
      graph_def: the graph to read; it is not modified.
      earlier: a view of the graph `graph_def` was edited from (the pass reads
        its result again this way). A NodeDef equal to the one of the same
        name in the same body there, of an op that is no library function in
        either graph, takes that node's ports and called functions instead
        of reading its attributes again: the same NodeDef and OpDef give the
        same ports. In the top graph, where an input string alone names its
        tensor, it takes the earlier Node object itself (whose ``node_def`` is
        then the earlier, equal NodeDef); in a function its inputs are resolved
        again. Bodies and the view record what differs (``Body.edited``,
        ``GraphView.edited_signatures``).
      written: with `earlier`, what the writer of `graph_def` added or changed
        since `earlier`'s graph: body name -> {node name: NodeDef, or None for
        a node removed} (``insert_casts``' and ``hoist``'s records). In a body
        listed there, every other NodeDef is taken as equal to the earlier one
        without comparing them, and the top graph's edges are patched rather
        than read again: the cost is that of the edits, not of the graph.
        Bodies not listed are compared.

    Returns:
      A GraphView whose bodies refer to `graph_def`'s own NodeDefs, or to
      equal ones of `earlier`.
    """
    signatures = {f.signature.name: f.signature for f in graph_def.library.function}
    if earlier is not None and earlier.resolver is not None and earlier.signatures == signatures:
        resolver = earlier.resolver  # (the same OpDefs and signatures give the same ports)
    else:
        resolver = _PortResolver(signatures)
    before: dict[str, dict[str, Node]] = {}
    edited_signatures = None
    if earlier is not None:
        library_ops = set(signatures) | set(earlier.signatures)
        edited_signatures = frozenset(
            name for name, signature in signatures.items()
            if earlier.signatures.get(name) != signature)
        before = {body.name: body.nodes if not library_ops else {
                      name: node for name, node in body.nodes.items()
                      if node.op not in library_ops}
                  for body in earlier.bodies
                  if body.name not in edited_signatures}
    written = written or {}
    earlier_bodies = {body.name: body for body in earlier.bodies} if earlier else {}
    if "" in written and "" in before:
        bodies = [_patch_top_body(earlier_bodies[""], before[""], written[""], resolver,
                                  graph_def)]
    else:
        bodies = [_build_body("", graph_def.node, resolver, None, before.get(""))]
    for fdef in graph_def.library.function:
        name = fdef.signature.name
        bodies.append(_build_body(name, fdef.node_def, resolver, fdef, before.get(name),
                                  written.get(name)))
    return GraphView(bodies=bodies, signatures=signatures,
                     edited_signatures=edited_signatures, resolver=resolver)


class _PortResolver:
    """Computes a node's ports from its OpDef (or function signature) and attrs.

    A training step has thousands of nodes but few distinct (op, type
    attributes) pairs, and reading protobuf fields is slow: each OpDef is read
    once into a plain recipe, and a node only reads the attributes its ports
    depend on. Nodes with the same op and the same values for those attributes
    share one result (port lists are read-only).
    """

    def __init__(self, signatures: dict[str, op_def_pb2.OpDef]):
        self._signatures = signatures
        # op -> _OpRecipe, or None for an op with neither an OpDef nor a signature
        self._recipes: dict[str, _OpRecipe | None] = {}
        # (op, attribute values) -> (inputs, outputs, output offsets, float type attrs)
        self._ports: dict[tuple, tuple[list[Port], list[Port], dict[str, int],
                                       tuple[str, ...]]] = {}

    def op_def(self, op: str) -> op_def_pb2.OpDef | None:
        return self._signatures.get(op) or op_def_registry.get(op)

    def recipe(self, op: str) -> _OpRecipe | None:
        """What ports and called functions of `op` depend on; None if `op` is unknown."""
        if op not in self._recipes:
            op_def = self.op_def(op)
            self._recipes[op] = None if op_def is None else _OpRecipe.of(
                op_def, calls_itself=op in self._signatures)
        return self._recipes[op]

    def ports(self, node_def, recipe: _OpRecipe
              ) -> tuple[list[Port], list[Port], dict[str, int], tuple[str, ...]]:
        """(input ports, output ports, offset of each output arg, float type
        attributes; see Node) of `node_def`."""
        attr = node_def.attr
        values = []  # (_attr_value's usual case written out: every node has some)
        for name, kind in recipe.attrs:
            value = attr.get(name)
            if value is None:
                values.append(_attr_value(node_def, attr, recipe, name, kind))
            elif kind == "type":
                values.append(value.type)
            elif kind == "number":
                values.append(value.i)
            else:
                values.append(tuple(value.list.type))
        key = (recipe, tuple(values))
        found = self._ports.get(key)
        if found is None:
            known = dict(zip((name for name, _ in recipe.attrs), key[1], strict=True))
            inputs, _ = _ports_of(recipe.input_args, known)
            outputs, offsets = _ports_of(recipe.output_args, known)
            float_attrs = tuple(dict.fromkeys(
                port.type_attr for port in inputs + outputs
                if port.dtype == DT_FLOAT and port.type_attr))
            found = self._ports[key] = (inputs, outputs, offsets, float_attrs)
        return found


# (name, type_list_attr, number_attr, type_attr, fixed type, is_ref) of one OpDef arg.
_ArgRecipe = tuple[str, str, str, str, int, bool]


@dataclasses.dataclass(frozen=True, eq=False)
class _OpRecipe:
    """The facts of one OpDef the view needs, read from the proto once."""

    op_def: op_def_pb2.OpDef
    input_args: tuple[_ArgRecipe, ...]
    output_args: tuple[_ArgRecipe, ...]
    # (attribute, "list" | "number" | "type") the ports depend on, in the order
    # the args name them
    attrs: tuple[tuple[str, str], ...]
    # attribute name -> its default value (an empty AttrValue when the OpDef
    # gives none), for attributes a node leaves out
    defaults: dict
    # FUNC_ATTRS this OpDef declares (a NodeDef may not carry undeclared attributes)
    func_attrs: tuple[str, ...]
    # the op is itself a library function
    calls_itself: bool

    @classmethod
    def of(cls, op_def, calls_itself: bool) -> _OpRecipe:
        def args(arg_defs):
            return tuple((arg.name, arg.type_list_attr, arg.number_attr, arg.type_attr,
                          arg.type, bool(arg.is_ref)) for arg in arg_defs)

        input_args, output_args = args(op_def.input_arg), args(op_def.output_arg)
        attrs: dict[tuple[str, str], None] = {}
        for _, list_attr, number_attr, type_attr, _, _ in input_args + output_args:
            if list_attr:
                attrs[(list_attr, "list")] = None
                continue
            if number_attr:
                attrs[(number_attr, "number")] = None
            if type_attr:
                attrs[(type_attr, "type")] = None
        declared = {attr_def.name: attr_def for attr_def in op_def.attr}
        return cls(
            op_def=op_def, input_args=input_args, output_args=output_args,
            attrs=tuple(attrs),
            defaults={name: d.default_value for name, d in declared.items()},
            func_attrs=tuple(name for name in FUNC_ATTRS if name in declared),
            calls_itself=calls_itself)


def _attr_value(node_def, attr, recipe: _OpRecipe, name: str, kind: str):
    """A type, count or type list attribute of a node, or its OpDef default."""
    value = attr.get(name)
    if value is None:
        value = recipe.defaults.get(name)
    if value is None:
        raise ValueError(
            f"node {node_def.name!r} ({node_def.op}) has no attribute {name!r} and "
            f"its OpDef gives no default; the GraphDef is incomplete or corrupt.")
    if kind == "type":
        return value.type
    if kind == "number":
        return value.i
    return tuple(value.list.type)


def _ports_of(args: tuple[_ArgRecipe, ...], values: dict) -> tuple[list[Port], dict[str, int]]:
    """Flat ports of `args` (OpDef input or output args) and each arg's offset."""
    ports: list[Port] = []
    offsets: dict[str, int] = {}
    for name, list_attr, number_attr, type_attr, fixed, is_ref in args:
        offsets[name] = len(ports)
        if list_attr:
            ports.extend(_port(t, f"{list_attr}[{k}]", is_ref or t > _REF_OFFSET)
                         for k, t in enumerate(values[list_attr]))
            continue
        count = values[number_attr] if number_attr else 1
        dtype = values[type_attr] if type_attr else fixed
        port = _port(dtype, type_attr or None, is_ref or dtype > _REF_OFFSET)
        ports.extend([port] * count)
    return ports, offsets


# Reference dtypes are the value dtypes + 100 (DT_FLOAT_REF = 101, ...).
_REF_OFFSET = 100


@functools.cache
def _port(dtype: int, type_attr: str | None, is_ref: bool) -> Port:
    return Port(dtype, type_attr, is_ref)


def _new_node(node_def, resolver: _PortResolver, no_ports=([], [], {}, ())) -> Node:
    op = node_def.op
    recipe = resolver.recipe(op)
    inputs, outputs, offsets, float_attrs = (
        no_ports if recipe is None else resolver.ports(node_def, recipe))
    # (positional: name, op, node_def, known_op, inputs, outputs, data_inputs,
    # called_functions, float_type_attrs, output_offsets; about twice as fast)
    return Node(node_def.name, op, node_def, recipe is not None, inputs, outputs, [],
                _called_functions(node_def, recipe)
                if recipe is None or recipe.func_attrs or recipe.calls_itself else [],
                float_attrs, offsets)


def _patch_top_body(earlier: Body, same: dict[str, Node], written: dict[str, object],
                    resolver: _PortResolver, graph_def) -> Body:
    """The top graph after the edits `written` records (see build_view).

    Nodes neither written nor calling a library function (those are not in
    `same`) are the earlier Node objects; the others are read from their
    NodeDefs. Consumer lists change only where a re-read node's inputs do.
    """
    redo = dict(written)
    if len(same) < len(earlier.nodes):  # calls of library functions: read again
        missing = {name for name in earlier.nodes if name not in same} - redo.keys()
        if missing:
            redo.update((n.name, n) for n in graph_def.node if n.name in missing)
    nodes = dict(earlier.nodes)
    consumers = dict(earlier.consumers)
    copied: set[TensorRef] = set()  # consumer lists already copied from `earlier`

    def consumer_list(ref: TensorRef) -> list:
        if ref not in copied:
            copied.add(ref)
            consumers[ref] = list(consumers.get(ref, ()))
        return consumers[ref]

    waiters = None
    if earlier._waiters is not None:  # (control edges: the old ones out, the new in)
        waiters = dict(earlier._waiters)
        waited: set[str] = set()  # lists already copied

        def waiter_list(source: str) -> list:
            if source not in waited:
                waited.add(source)
                waiters[source] = list(waiters.get(source, ()))
            return waiters[source]

        for name, node_def in redo.items():
            old = earlier.nodes.get(name)
            if old is not None:
                for text in old.node_def.input:
                    if text.startswith("^"):
                        waiter_list(text[1:]).remove(name)
            if node_def is not None:
                for text in node_def.input:
                    if text.startswith("^"):
                        waiter_list(text[1:]).append(name)
        for source in waited:
            if not waiters[source]:
                del waiters[source]
    removed = [name for name, node_def in redo.items() if node_def is None]
    for name in removed:  # (nothing reads a removed node: its readers were rewritten)
        del redo[name]
        for index, (ref, _) in enumerate(nodes.pop(name).data_inputs):
            consumer_list(ref).remove((name, index))
    for name, node_def in redo.items():
        old = nodes.get(name)
        node = nodes[name] = _new_node(node_def, resolver)
        data_inputs = node.data_inputs
        texts = [text for text in node_def.input if not text.startswith("^")]
        if old is not None:
            if [text for _, text in old.data_inputs] == texts:  # (a retyped node)
                data_inputs.extend(old.data_inputs)  # the same tensors and edges
                continue
            for index, (ref, _) in enumerate(old.data_inputs):
                consumer_list(ref).remove((name, index))
        for text in texts:
            ref = _parse_input(text, False, None, None)
            consumer_list(ref).append((name, len(data_inputs)))
            data_inputs.append((ref, text))
    for ref in copied:
        if not consumers[ref]:
            del consumers[ref]
    return Body(name="", is_function=False, nodes=nodes, arg_dtypes={}, rets={},
                consumers=consumers, edited=frozenset(redo), _waiters=waiters)


def _read_top_body(node_defs, resolver: _PortResolver) -> Body | None:
    """_build_body for a top graph read afresh, in one pass over the NodeDefs.

    In the top graph an input string alone names its tensor, so each node's
    edges are resolved as it is read; strings recur (a tensor with several
    consumers) and are parsed once. None if two nodes share a name (the
    general reading keeps the last one's edges only).
    """
    nodes: dict[str, Node] = {}
    consumers: dict[TensorRef, list[tuple[str, int]]] = {}
    add_consumer = consumers.setdefault
    refs: dict[str, TensorRef] = {}
    waiters: dict[str, list[str]] = {}
    new_node = _new_node
    new = tuple.__new__  # (TensorRef(...) without its Python-level __new__)
    for node_def in node_defs:
        node = new_node(node_def, resolver)
        node_name = node.name
        nodes[node_name] = node
        data_inputs = node.data_inputs
        for text in node_def.input:
            ref = refs.get(text)
            if ref is None:
                if text.startswith("^"):
                    waiters.setdefault(text[1:], []).append(node_name)
                    continue
                source, _, index = text.partition(":")
                ref = refs[text] = new(TensorRef, (source, int(index) if index else 0, False))
            add_consumer(ref, []).append((node_name, len(data_inputs)))
            data_inputs.append((ref, text))
    if len(nodes) != len(node_defs):
        return None
    return Body(name="", is_function=False, nodes=nodes, arg_dtypes={}, rets={},
                consumers=consumers, _waiters=waiters)


def _build_body(name: str, node_defs, resolver: _PortResolver, fdef,
                before: dict[str, Node] | None,
                written: dict[str, object] | None = None) -> Body:
    is_function = fdef is not None
    if not is_function and before is None:
        body = _read_top_body(node_defs, resolver)
        if body is not None:
            return body
    arg_dtypes = {}
    if is_function:
        arg_dtypes = {arg.name: arg.type for arg in fdef.signature.input_arg}
    nodes: dict[str, Node] = {}
    output_offsets: dict[str, dict[str, int]] = {}
    input_texts: dict[str, list[str]] = {}  # read from the protos once
    edited: set[str] | None = None if before is None else set()
    for node_def in node_defs:
        node_name = node_def.name
        same = before.get(node_name) if before else None
        if same is not None and (node_name not in written if written is not None
                                 else same.node_def == node_def):  # see build_view
            # In the top graph an input string alone names its tensor; in a
            # function it depends on the producer's output args: parse again.
            if not is_function:
                nodes[node_name] = same
                output_offsets[node_name] = same.output_offsets
                input_texts.pop(node_name, None)  # a node of the same name before it
                continue
            nodes[node_name] = Node(
                name=node_name, op=same.op, node_def=node_def, known_op=same.known_op,
                inputs=same.inputs, outputs=same.outputs,
                data_inputs=[],
                called_functions=same.called_functions,
                float_type_attrs=same.float_type_attrs, output_offsets=same.output_offsets)
            output_offsets[node_name] = same.output_offsets
            input_texts[node_name] = [text for _, text in same.data_inputs]
            continue
        if edited is not None:
            edited.add(node_name)
        node = nodes[node_name] = _new_node(node_def, resolver)
        output_offsets[node_name] = node.output_offsets
        input_texts[node_name] = list(node_def.input)

    consumers: dict[TensorRef, list[tuple[str, int]]] = {}
    add_consumer = consumers.setdefault
    for node in nodes.values():
        data_inputs = node.data_inputs
        node_name = node.name
        texts = input_texts.get(node_name)
        if texts is None:  # a reused node, its inputs resolved already
            for index, (ref, _) in enumerate(data_inputs):
                add_consumer(ref, []).append((node_name, index))
            continue
        for text in texts:
            if text.startswith("^"):
                continue
            if is_function:
                ref = _parse_input(text, True, arg_dtypes, output_offsets)
            else:  # _parse_input's top-graph case, written out (every edge)
                source, _, index = text.partition(":")
                ref = TensorRef(source, int(index) if index else 0)
            add_consumer(ref, []).append((node_name, len(data_inputs)))
            data_inputs.append((ref, text))

    rets = {}
    if is_function:
        for arg in fdef.signature.output_arg:
            text = fdef.ret[arg.name]
            ref = _parse_input(text, True, arg_dtypes, output_offsets)
            rets[arg.name] = (ref, text, arg.type)
    return Body(name=name, is_function=is_function, nodes=nodes,
                arg_dtypes=arg_dtypes, rets=rets, consumers=consumers,
                function_attrs=frozenset(fdef.attr) if is_function else frozenset(),
                xla_must_compile=is_function and must_compile(fdef.attr),
                edited=None if edited is None else frozenset(edited))


def _parse_input(text: str, is_function: bool, arg_dtypes, output_offsets) -> TensorRef:
    if is_function:
        parts = text.split(":")
        if len(parts) == 1:
            return TensorRef(text, 0, is_arg=text in arg_dtypes)
        node, out_arg, index = parts[0], parts[1], int(parts[2]) if len(parts) > 2 else 0
        offset = output_offsets.get(node, {}).get(out_arg, 0)
        return TensorRef(node, offset + index)
    node, _, index = text.partition(":")
    return TensorRef(node, int(index) if index else 0)


def must_compile(attrs) -> bool:
    """True if NodeDef or FunctionDef attributes `attrs` say XLA compiles it."""
    value = attrs.get(XLA_MUST_COMPILE)
    return value is not None and value.b


def _called_functions(node_def, recipe: _OpRecipe | None) -> list[str]:
    called = []
    if recipe is not None and recipe.calls_itself:
        called.append(node_def.op)
    attr = node_def.attr
    for attr_name in FUNC_ATTRS if recipe is None else recipe.func_attrs:
        value = attr.get(attr_name)
        if value is not None:
            if value.HasField("func"):
                called.append(value.func.name)
            called.extend(f.name for f in value.list.func)
    return called


_FLOAT_CONSTS = frozenset({types_pb2.DT_FLOAT, types_pb2.DT_DOUBLE, types_pb2.DT_HALF,
                           types_pb2.DT_BFLOAT16})


def constant_magnitude(node: Node | None, most: int = 1 << 16) -> float | None:
    """The largest finite |value| of a float Const of at most `most` elements
    (None for another node, a bigger Const, or one with no finite value)."""
    if node is None or node.op != "Const":
        return None
    tensor = node.node_def.attr["value"].tensor
    if tensor.dtype not in _FLOAT_CONSTS:
        return None
    if tensor.dtype == types_pb2.DT_FLOAT and not tensor.tensor_content:
        values = tensor.float_val  # (a scalar or a splat: the common case, no array)
    else:
        elements = 1
        for dim in tensor.tensor_shape.dim:
            elements *= max(dim.size, 0)
        if elements > most:
            return None
        values = tensor_util.MakeNdarray(tensor).reshape(-1).astype("float64").tolist()
    finite = [abs(v) for v in values if v == v and abs(v) != float("inf")]
    return max(finite) if finite else None


def scalar_constant(node: Node | None) -> float | None:
    """The value of a float Const of shape [], else None."""
    if node is None or node.op != "Const":
        return None
    tensor = node.node_def.attr["value"].tensor
    if tensor.tensor_shape.dim or tensor.dtype not in _FLOAT_CONSTS:
        return None
    # (MakeNdarray: a float16/bfloat16 value is stored as its bits in half_val)
    value = tensor_util.MakeNdarray(tensor).reshape(-1)
    return float(value[0]) if value.size else None


def int_constant(node: Node | None) -> tuple[int, ...] | None:
    """The values of an integer Const (a scalar or a vector: reduction axes), else
    None."""
    if node is None or node.op != "Const":
        return None
    tensor = node.node_def.attr["value"].tensor
    if tensor.dtype not in (types_pb2.DT_INT32, types_pb2.DT_INT64):
        return None
    return tuple(int(v) for v in tensor_util.MakeNdarray(tensor).reshape(-1))


# Ops whose output is their first input, unchanged.
IDENTITIES = frozenset({"Identity", "Snapshot"})


def source_in(nodes, ref: TensorRef, ops: frozenset[str], depth: int) -> TensorRef:
    """The tensor `ref` passes on through `ops` (their first input; at most `depth`
    of them), in a body's `nodes`."""
    for _ in range(depth):
        node = None if ref.is_arg else nodes.get(ref.node)
        if node is None or node.op not in ops or not node.data_inputs:
            break
        ref = node.data_inputs[0][0]
    return ref


def variable_key(nodes, ref: TensorRef) -> str:
    """Which variable the resource handle `ref` is ("node:index" of its source,
    through Identity): the same key wherever the handle is passed on."""
    for _ in range(8):
        node = None if ref.is_arg else nodes.get(ref.node)
        if node is None or node.op != "Identity" or not node.data_inputs:
            break
        ref = node.data_inputs[0][0]
    return f"{ref.node}:{ref.index}"
