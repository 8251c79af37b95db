"""What the accuracy check of ``tfamp export`` runs on: the user's batches
(``--inputs FILE.npz``) or random inputs shaped like the signature's.

Random inputs: float inputs are standard normal; an open batch dimension is
``batch_size`` and any other open dimension ``length``. Integer inputs are
drawn from [0, N): N is the number of rows of the smallest embedding table the
input indexes, where the graph shows one (token ids), else 2 (segment ids,
masks, flags: any integer input is likely to accept 0 and 1). Boolean inputs are
random, string inputs empty. ``CheckInputs.note`` says which was done.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from tfamp.rewrite.graph import TensorRef, build_view
from tfamp.serving.dataflow import Flow
from tfamp.serving.errors import ExportError
from tfamp.serving.source import Signature

DEFAULT_BATCH = 2
DEFAULT_LENGTH = 16
RANDOM_BATCHES = 2
SMALL_INTS = 2
# Ops an integer index passes through unchanged on its way to a Gather.
_INDEX_COPIES = frozenset({"Cast", "Identity", "Reshape", "ExpandDims", "Squeeze",
                           "StridedSlice", "Slice", "Transpose"})


@dataclasses.dataclass
class CheckInputs:
    """The batches one signature is checked on, and how they were made."""

    batches: list[dict[str, Any]]  # input name -> tf.Tensor
    note: str
    random: bool


def check_inputs(signature: Signature, npz: list[Path], *, batch_size: int = DEFAULT_BATCH,
                 length: int = DEFAULT_LENGTH, seed: int = 0) -> CheckInputs:
    """The batches to check `signature` on.

    Args:
      signature: the signature.
      npz: .npz files, one batch each, keyed by the signature's input names; a
        file lacking one of them is an error. Empty: random inputs.
      batch_size, length: the sizes of open dimensions of random inputs.
      seed: for random inputs.

    Raises:
      ExportError: an unreadable file, a missing input, a shape or dtype that
        does not fit the signature.
    """
    specs = signature.input_specs
    if npz:
        batches = [_read_npz(path, specs, signature.name) for path in npz]
        names = ", ".join(str(p) for p in npz)
        return CheckInputs(batches, f"{len(batches)} batch{'es' if len(batches) > 1 else ''} "
                                    f"from {names}", random=False)
    rows = _index_rows(signature)
    rng = np.random.default_rng(seed)
    batches = [_random_batch(specs, rows, rng, batch_size, length)
               for _ in range(RANDOM_BATCHES)]
    parts = []
    for name, spec in specs.items():
        if spec.dtype.is_integer:
            bound = rows.get(name)
            parts.append(f"{name}: integers in [0, {bound}) (the rows of the table it "
                         f"indexes)" if bound else
                         f"{name}: integers in [0, {SMALL_INTS}) (no table size known; "
                         f"pass --inputs for real ids)")
        elif spec.dtype.is_bool:
            parts.append(f"{name}: random booleans")
        elif spec.dtype == "string":
            parts.append(f"{name}: empty strings")
    shapes = "; ".join(f"{n}: {list(_shape(s, batch_size, length))}" for n, s in specs.items())
    note = (f"random inputs ({RANDOM_BATCHES} batches; {shapes}; floats standard normal"
            + (f"; {'; '.join(parts)}" if parts else "") + "): pass --inputs FILE.npz to "
            "check on real data")
    return CheckInputs(batches, note, random=True)


def _shape(spec, batch_size: int, length: int) -> tuple[int, ...]:
    dims = spec.shape.as_list() if spec.shape.rank is not None else [None]
    return tuple((batch_size if i == 0 else length) if d is None else d
                 for i, d in enumerate(dims))


def _random_batch(specs, rows: dict[str, int], rng, batch_size: int, length: int):
    import tensorflow as tf

    batch = {}
    for name, spec in specs.items():
        shape = _shape(spec, batch_size, length)
        if spec.dtype.is_floating:
            value = rng.standard_normal(shape)
        elif spec.dtype.is_integer:
            value = rng.integers(0, rows.get(name, SMALL_INTS), size=shape)
        elif spec.dtype.is_bool:
            value = rng.integers(0, 2, size=shape).astype(bool)
        elif spec.dtype == tf.string:
            value = np.full(shape, b"", dtype=object)
        else:
            value = np.zeros(shape)
        batch[name] = tf.constant(value, spec.dtype)
    return batch


def _read_npz(path: Path, specs, signature: str) -> dict[str, Any]:
    import tensorflow as tf

    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {k: data[k] for k in data.files}
    except (OSError, ValueError) as err:
        raise ExportError(f"--inputs {path}: not a readable .npz file ({err}); save one "
                          f"with numpy.savez(path, **{{input name: array}})") from err
    missing = [name for name in specs if name not in arrays]
    if missing:
        raise ExportError(f"--inputs {path}: no array named {missing[0]!r}; signature "
                          f"{signature!r} takes {', '.join(specs)}, the file has "
                          f"{', '.join(arrays) or 'nothing'}")
    batch = {}
    for name, spec in specs.items():
        array = arrays[name]
        if not spec.shape.is_compatible_with(array.shape):
            raise ExportError(f"--inputs {path}: {name!r} has shape {list(array.shape)}; "
                              f"signature {signature!r} takes {spec.shape}")
        try:
            batch[name] = tf.constant(array, spec.dtype)
        except (TypeError, ValueError) as err:
            raise ExportError(f"--inputs {path}: {name!r} is {array.dtype}, which does not "
                              f"convert to the signature's {spec.dtype.name}") from err
    return batch


def _index_rows(signature: Signature) -> dict[str, int]:
    """Integer input name -> rows of the smallest table it indexes (where the graph says)."""
    graph = signature.function.graph
    captured = {id(internal) for _, internal in graph.captures}
    arguments = [t for t in graph.inputs if id(t) not in captured]
    # the graph's argument placeholders follow the flat (keyword) call order
    names = list(getattr(signature.function, "_arg_keywords", None) or
                 sorted(signature.input_specs))
    if len(arguments) != len(names):
        return {}
    view = build_view(graph.as_graph_def(add_shapes=True))
    flow = Flow(view)
    rows_of_read: dict[tuple[str, str], int] = {}
    for capture in signature.captures:
        if capture.variable is None or not capture.variable.shape.rank:
            continue
        first = capture.variable.shape[0]
        uses = flow.uses("", TensorRef(capture.placeholder.split(":")[0], 0))
        for use in uses.reads:
            if first is not None:
                rows_of_read[(use.body, use.node)] = int(first)
    found = {}
    for name, tensor in zip(names, arguments, strict=True):
        if not tensor.dtype.is_integer:
            continue
        bounds = _gathered_rows(flow, TensorRef(tensor.op.name, 0), rows_of_read)
        if bounds:
            found[name] = min(bounds)
    return found


def _gathered_rows(flow: Flow, start: TensorRef, rows_of_read) -> list[int]:
    bounds = []
    pending = [("", start)]
    seen = set()
    while pending:
        where, ref = pending.pop()
        if (where, ref) in seen or len(seen) > 1000:
            continue
        seen.add((where, ref))
        for use in flow.uses(where, ref).reads:
            node = flow.bodies[use.body].nodes[use.node]
            # (Keras 3's Embedding wraps negative ids: select(ids < 0, ids + n, ids))
            if (node.op in _INDEX_COPIES and use.index == 0) or (
                    node.op in ("Select", "SelectV2") and use.index in (1, 2)) or (
                    node.op in ("Add", "AddV2")):
                pending.append((use.body, TensorRef(use.node, 0)))
            elif node.op == "ResourceGather" and use.index == 1:
                if (use.body, use.node) in rows_of_read:
                    bounds.append(rows_of_read[(use.body, use.node)])
            elif node.op in ("GatherV2", "Gather") and use.index == 1:
                params, _ = node.data_inputs[0]
                if not params.is_arg and (use.body, params.node) in rows_of_read:
                    bounds.append(rows_of_read[(use.body, params.node)])
    return bounds
