"""Applies a Coloring: retypes converted nodes and inserts Casts at region edges.

``insert_casts(graph_def, view, coloring) -> (new_graph_def, casts, written)``. Owns Cast
naming and sharing: one Cast per (source tensor, destination dtype), shared by
every consumer that needs it, and never a Cast of a Cast back to the type it
started from (the consumer is wired to the original tensor instead).
"""

from __future__ import annotations

import dataclasses
import re

from tensorflow.core.framework import full_type_pb2, graph_pb2, types_pb2

from tfamp.rewrite.coloring import Coloring
from tfamp.rewrite.graph import FLOAT_TYPES, Body, GraphView, TensorRef, dtype_name

_SHORT = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
# Every Cast tfamp inserts is named "<source>/tfamp_cast_<port>_to_<f16|bf16|f32>",
# with "_<n>" appended when that name is taken.
_TFAMP_CAST_NAME = re.compile(r"/tfamp_cast_\d+_to_(?:f16|bf16|f32)(?:_\d+)?$")


# A TensorList's element type as TensorFlow's full type records it (NodeDef.experimental_type).
_FULL_TYPE = {types_pb2.DT_FLOAT: full_type_pb2.TFT_FLOAT,
              types_pb2.DT_HALF: full_type_pb2.TFT_HALF,
              types_pb2.DT_BFLOAT16: full_type_pb2.TFT_BFLOAT16}


def _tensor_types(full) -> list:
    """The element types (FullTypeDefs) of every TFT_TENSOR inside `full`."""
    found, stack = [], [full]
    while stack:
        full = stack.pop()
        if full.type_id == full_type_pb2.TFT_TENSOR:
            found.extend(full.args)
        else:
            stack.extend(full.args)
    return found


def full_type_mismatch(node_def) -> bool:
    """Does a TensorList op's full type name an element type other than its
    ``element_dtype`` (one of the float types tfamp retypes)?"""
    if not node_def.HasField("experimental_type") or "element_dtype" not in node_def.attr:
        return False
    wanted = _FULL_TYPE.get(node_def.attr["element_dtype"].type)
    return wanted is not None and any(
        arg.type_id in _FULL_TYPE.values() and arg.type_id != wanted
        for arg in _tensor_types(node_def.experimental_type))


def _retype_full_type(node_def, target: int) -> None:
    """A retyped TensorList op's full type (``experimental_type``: its list's
    TFT_ARRAY[TFT_TENSOR[element type]]) says the new element type too.

    TensorFlow checks full types when it instantiates a function: a While
    lowered to frames merges the loop's list with the one it pushes to, and a
    list still said to hold float32 there fails that check ("Type inference
    failed. This indicates an invalid graph", a warning per function)."""
    if node_def.HasField("experimental_type"):
        for arg in _tensor_types(node_def.experimental_type):
            if arg.type_id == _FULL_TYPE[types_pb2.DT_FLOAT]:
                arg.type_id = _FULL_TYPE[target]


def is_tfamp_cast(node_name: str) -> bool:
    """True if `node_name` is the name of a Cast that tfamp inserted."""
    return _TFAMP_CAST_NAME.search(node_name) is not None


@dataclasses.dataclass(frozen=True)
class CastRecord:
    """One inserted Cast and the boundary it bridges."""

    name: str
    function: str
    source: str  # the tensor it reads, as written in its body
    src_dtype: str
    dst_dtype: str
    consumers: tuple[str, ...]  # nodes (or "<ret NAME>") it feeds

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# body name -> {node name: the NodeDef written}: what insert_casts added or changed.
Written = dict[str, dict[str, object]]


def insert_casts(graph_def: graph_pb2.GraphDef, view: GraphView, coloring: Coloring
                 ) -> tuple[graph_pb2.GraphDef, list[CastRecord], Written]:
    """Returns a retyped copy of `graph_def` with Casts at every dtype boundary.

    Args:
      graph_def: the graph `view` was built from; not modified.
      view: its GraphView.
      coloring: decisions for every node of `view`.

    Returns:
      (new GraphDef, one CastRecord per inserted Cast, the NodeDefs written):
      the copy starts equal to `graph_def`, and every edit below goes through
      a NodeDef recorded in `written` (per body, including function copies),
      so every other NodeDef of the result equals the input's.
    """
    new_graph_def = graph_pb2.GraphDef()
    new_graph_def.CopyFrom(graph_def)
    functions = {f.signature.name: f for f in new_graph_def.library.function}
    bodies = list(view.bodies)
    by_name = {body.name: body for body in view.bodies}
    # Callers that disagree get a copy, added in name order: the clones are found
    # in NodeDef attribute-map order, which varies from process to process.
    for clone, original in sorted(coloring.clones.items()):
        fdef = new_graph_def.library.function.add()
        fdef.CopyFrom(functions[original])
        fdef.signature.name = clone
        functions[clone] = fdef
        bodies.append(dataclasses.replace(by_name[original], name=clone))
    casts: list[CastRecord] = []
    editors: dict[str, _BodyEditor] = {}
    for body in bodies:
        fdef = functions.get(body.name) if body.is_function else None
        node_list = fdef.node_def if fdef is not None else new_graph_def.node
        if fdef is not None and body.name in coloring.signatures:
            _retype_signature(fdef, coloring.signatures[body.name])
        editor = editors[body.name] = _BodyEditor(body, node_list, fdef, coloring)
        casts.extend(editor.run())
    _retarget_calls(editors, coloring.call_targets)
    return new_graph_def, casts, {name: e.written for name, e in editors.items()}


def _retarget_calls(editors: dict[str, _BodyEditor], call_targets) -> None:
    """Points each redirected call site at the function copy it now calls."""
    for (body, node, attr, index), function in call_targets.items():
        editor = editors[body]
        node_def = editor.written[node] = editor.node_def(node)
        value = node_def.attr[attr]
        if value.HasField("func"):
            value.func.name = function
        else:
            value.list.func[index].name = function


def _retype_signature(fdef, types) -> None:
    """Sets the argument and result dtypes boundaries.solve changed."""
    for arg in fdef.signature.input_arg:
        arg.type = types.args.get(arg.name, arg.type)
    for arg in fdef.signature.output_arg:
        arg.type = types.rets.get(arg.name, arg.type)


class _BodyEditor:
    def __init__(self, body: Body, node_list, fdef, coloring: Coloring):
        self.body = body
        self.node_list = node_list
        self.fdef = fdef
        self.coloring = coloring
        self.target = coloring.target
        # node name -> its position in node_list. The body lists its nodes in
        # the order of the NodeDefs it was read from (a copy of which
        # node_list is), one per name: no need to read every name again.
        if len(body.nodes) != len(node_list):
            raise ValueError(
                f"{body.name or 'the top graph'} has {len(node_list)} NodeDefs but "
                f"{len(body.nodes)} distinct names: node names must be unique "
                f"(rewrite_graph_def says which).")
        self.position = {name: i for i, name in enumerate(body.nodes)}
        self.taken_names = set(self.position) | set(body.arg_dtypes)
        self.cast_for: dict[tuple[TensorRef, int], str] = {}  # -> consumer text
        signature = coloring.signatures.get(body.name)
        self.arg_dtypes = dict(body.arg_dtypes)
        self.ret_dtypes = {name: dtype for name, (_, _, dtype) in body.rets.items()}
        if signature is not None:
            self.arg_dtypes.update(signature.args)
            self.ret_dtypes.update(signature.rets)
        self.records: dict[str, dict] = {}
        # node name -> NodeDef, for every NodeDef this editor adds or changes
        self.written: dict[str, object] = {}
        # converted node -> its 16-bit type attributes; asked once per edge end
        self._converted = coloring.converted_by_body.get(body.name, {})

    def node_def(self, name: str):
        """The NodeDef of `name` in the graph being written (to edit it)."""
        return self.node_list[self.position[name]]

    def converted(self, node: str) -> tuple[str, ...]:
        return self._converted.get(node, ())

    def new_output_dtype(self, ref: TensorRef) -> int:
        if ref.is_arg:
            return self.arg_dtypes[ref.node]
        port = self.body.nodes[ref.node].outputs[ref.index]
        return self.target if port.type_attr in self.converted(ref.node) else port.dtype

    def run(self) -> list[CastRecord]:
        for name in self._converted:
            self._retype(name)
        # (new_output_dtype and Body.producer_port written out: this visits
        # every edge of the graph)
        nodes, converted, target = self.body.nodes, self._converted, self.target
        body_args, arg_dtypes = self.body.arg_dtypes, self.arg_dtypes
        # With the signature as it was, an edge's two ends can only disagree
        # where one of them was converted: visit those nodes and their readers.
        visit = None
        if self.body.name not in self.coloring.signatures:
            visit = set()
            consumers = self.body.consumers
            for name in converted:
                visit.add(name)
                for index in range(len(nodes[name].outputs)):
                    visit.update(c for c, _ in consumers.get(TensorRef(name, index), ()))
        for name, node in nodes.items():
            if visit is not None and name not in visit:
                continue
            inputs = node.inputs
            own = converted.get(name, ())
            for index, (ref, text) in enumerate(node.data_inputs):
                if index >= len(inputs):
                    continue  # unknown op: left exactly as it was
                if ref.is_arg:
                    if ref.node not in body_args:
                        continue
                    have = arg_dtypes[ref.node]
                else:
                    producer = nodes.get(ref.node)
                    if producer is None or ref.index >= len(producer.outputs):
                        continue  # unknown op: left exactly as it was
                    out = producer.outputs[ref.index]
                    have = (target if out.type_attr in converted.get(ref.node, ())
                            else out.dtype)
                port = inputs[index]
                wanted = target if port.type_attr in own else port.dtype
                if have != wanted:
                    node_def = self.written[name] = self.node_def(name)
                    node_def.input[index] = self._cast(ref, text, wanted, name)
        for ret_name, (ref, text, _) in self.body.rets.items():
            dtype = self.ret_dtypes[ret_name]
            if self.body.producer_port(ref) and self.new_output_dtype(ref) != dtype:
                self.fdef.ret[ret_name] = self._cast(ref, text, dtype, f"<ret {ret_name}>")
        return [CastRecord(consumers=tuple(r.pop("consumers")), **r)
                for r in self.records.values()]

    def _retype(self, name: str) -> None:
        converted = self.converted(name)
        if not converted:
            return
        node_def = self.written[name] = self.node_def(name)
        for attr in converted:
            if "[" in attr:
                base, index = attr[:-1].split("[")
                node_def.attr[base].list.type[int(index)] = self.target
            else:
                node_def.attr[attr].type = self.target
                if attr == "element_dtype":
                    _retype_full_type(node_def, self.target)

    def _cast(self, ref: TensorRef, text: str, dtype: int, consumer: str) -> str:
        """The input string a consumer uses to read `ref` as `dtype`."""
        key = (ref, dtype)
        if key not in self.cast_for:
            self.cast_for[key] = self._bypass(ref, dtype) or self._new_cast(ref, text, dtype)
        result = self.cast_for[key]
        if result in self.records:
            self.records[result]["consumers"].append(consumer)
        return result

    def _bypass(self, ref: TensorRef, dtype: int) -> str | None:
        """If `ref` is a Cast of a tensor already of `dtype`, that tensor's text."""
        if ref.is_arg:
            return None
        node = self.body.nodes[ref.node]
        if node.op != "Cast" or any(i.startswith("^") for i in node.node_def.input):
            return None
        source, source_text = node.data_inputs[0]
        if self.body.producer_port(source) and self.new_output_dtype(source) == dtype:
            return source_text
        return None

    def _new_cast(self, ref: TensorRef, text: str, dtype: int) -> str:
        src_dtype = self.new_output_dtype(ref)
        if src_dtype not in FLOAT_TYPES or dtype not in FLOAT_TYPES:
            raise AssertionError(
                f"tfamp bug: would cast {dtype_name(src_dtype)} {text!r} to "
                f"{dtype_name(dtype)} in {self.body.name or 'the top graph'}; "
                f"only float types are ever retyped. Please report this graph.")
        base = f"{ref.node}/tfamp_cast_{ref.index}_to_{_SHORT[dtype_name(dtype)]}"
        name, suffix = base, 1
        while name in self.taken_names:
            name, suffix = f"{base}_{suffix}", suffix + 1
        self.taken_names.add(name)
        cast = self.written[name] = self.node_list.add()
        cast.name = name
        cast.op = "Cast"
        cast.input.append(text)
        cast.attr["SrcT"].type = src_dtype
        cast.attr["DstT"].type = dtype
        cast.attr["Truncate"].b = False
        if not ref.is_arg:
            cast.device = self.body.nodes[ref.node].node_def.device
        output = f"{name}:y:0" if self.body.is_function else name
        self.records[output] = dict(
            name=name, function=self.body.name, source=text,
            src_dtype=dtype_name(src_dtype), dst_dtype=dtype_name(dtype),
            consumers=[])
        return output
