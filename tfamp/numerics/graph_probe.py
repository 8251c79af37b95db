"""Ranges of traced graphs and saved model files (``tfamp inspect --ranges``).

``collect_graph_ranges`` runs a traced inference graph (a SavedModel
signature) in float32 and buckets the forward activations of the ops tfamp
would convert; ``synthetic_batches`` makes its inputs. (For a file, Keras or
SavedModel: ``tfamp.keras.range_probe.collect_file_ranges``.)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tfamp.numerics.range_report import RangeReport
from tfamp.numerics.ranges import TensorRange, accumulate, bucket_counts_many
from tfamp.numerics.run_graph import run_imported

FORWARD_ONLY_NOTE = ("a SavedModel holds the forward pass only: forward activations of the "
                     "ops tfamp converts were collected, no gradients")


def collect_graph_ranges(concrete, batches: Iterable[Sequence], config=None, *,
                         name: str = "graph", progress=None) -> RangeReport:
    """Forward activations of the ops tfamp would convert, for a traced function.

    For SavedModel signatures and other inference graphs: the float32 graph
    runs on each batch with every float output of a top-graph node the rewrite
    converts bucketed on the device (``bucket_counts``).

    Args:
      concrete: a ConcreteFunction (e.g. ``loaded.signatures["serving_default"]``).
      batches: per batch, the flat list of tensor arguments.
      config: the rewrite settings deciding which ops count (AmpConfig() if None).
      name: the model name for the report.
      progress: called with the number of batches done after each one.
    """

    from tfamp.config import AmpConfig
    from tfamp.rewrite import rewrite_graph_def
    from tfamp.rewrite.graph import FLOAT_TYPES, build_view

    config = config or AmpConfig()
    graph_def = concrete.graph.as_graph_def()
    _, report = rewrite_graph_def(graph_def, config,
                                  outputs=[t.name for t in concrete.graph.outputs],
                                  function_name=name)
    function, inner = "", None
    calls = [n for n in graph_def.node if n.op in ("StatefulPartitionedCall", "PartitionedCall")]
    if not any(n.converted and not n.function for n in report.nodes) and len(calls) == 1:
        # A SavedModel signature: one call of the model's function. Measure its body.
        from tensorflow.python.framework.function_def_to_graph import function_def_to_graph

        function = calls[0].attr["f"].func.name
        fdef = next(f for f in graph_def.library.function if f.signature.name == function)
        callee = function_def_to_graph(fdef)
        inner = (calls[0], callee.as_graph_def(), [t.name for t in callee.inputs])
        target = inner[1]
    else:
        target = graph_def
    converted = {n.name for n in report.nodes if n.converted and n.function == function}
    body = build_view(target).bodies[0]
    fetches = [f"{node}:{i}" for node in body.topological_order() if node in converted
               for i, port in enumerate(body.nodes[node].outputs) if port.dtype in FLOAT_TYPES]
    if not fetches:
        raise ValueError(f"{name}: the rewrite converts no op, so there are no 16-bit "
                         f"activations to measure")

    def buckets(tensors):
        return bucket_counts_many(tensors)

    tensors: list[TensorRange] = []
    steps = 0
    for args in batches:
        counts, maxes = run_imported(concrete, graph_def, fetches, list(args), post=buckets,
                                     inner=inner)
        accumulate(tensors, [
            TensorRange.from_vector(fetch.removesuffix(":0"), fetch.rsplit("/", 1)[0]
                                    if "/" in fetch else "", "activation", row, top)
            for fetch, row, top in zip(fetches, counts, maxes, strict=True)])
        steps += 1
        if progress is not None:
            progress(steps)
    return RangeReport(model=name, steps=steps, loss_scale=None, tensors=tensors,
                       notes=[FORWARD_ONLY_NOTE])


def synthetic_batches(specs: Sequence, count: int, *, batch: int = 8, seed: int = 0,
                      classes: int | None = None) -> list[list]:
    """`count` batches of random tensors for `specs` (tf.TensorSpec-like).

    Float inputs are standard normal; integer ones are class labels below
    `classes` (or zeros). An unknown dimension is `batch` if it is the first, else 1.
    """
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(seed)
    result = []
    for _ in range(count):
        values = []
        for spec in specs:
            dims = spec.shape.as_list() if spec.shape.rank is not None else [None]
            shape = [(batch if i == 0 else 1) if d is None else d for i, d in enumerate(dims)]
            if spec.dtype.is_floating:
                values.append(tf.constant(rng.standard_normal(shape), spec.dtype))
            elif spec.dtype.is_integer:
                high = classes or 1
                values.append(tf.constant(rng.integers(0, high, size=shape), spec.dtype))
            else:
                values.append(tf.zeros(shape, spec.dtype))
        result.append(values)
    return result
