"""Ranges of traced graphs and saved model files (``tfamp inspect --ranges``).

``collect_graph_ranges`` runs a traced inference graph (a SavedModel
signature) in float32 and buckets the forward activations of the ops tfamp
would convert; ``collect_file_ranges`` picks the right probe for a file: the
Keras probe (``tfamp.numerics.keras_probe``) for a compiled Keras file, the
graph probe for a SavedModel; ``synthetic_batches`` makes their inputs.
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


def collect_file_ranges(path, *, steps: int = 3, signature: str | None = None,
                        config=None, batch_size: int = 8, progress=None) -> RangeReport:
    """Ranges of a saved model on `steps` synthetic batches (``tfamp inspect --ranges``).

    A compiled Keras file (.keras, .h5; tf_keras or Keras 3) gives activations, activation
    gradients and weight gradients (random inputs, random targets shaped like
    the outputs; integer labels for sparse losses). A SavedModel directory
    gives forward activations only (FORWARD_ONLY_NOTE). Each batch has
    `batch_size` rows; `progress` is called with the batches done after each.

    Raises:
      ValueError: the path is neither, or the Keras model was saved uncompiled.
    """
    from pathlib import Path

    import tensorflow as tf

    path = Path(path)
    if path.suffix.lower() in (".keras", ".h5"):
        from tfamp.inspect.graph_files import load_keras_file, target_specs
        from tfamp.keras.flavour import flavour_of
        from tfamp.numerics.keras_probe import collect_keras_ranges

        model, _ = load_keras_file(path)  # tf_keras or Keras 3, by the file's keras_version
        if not flavour_of(model).has_loss(model):
            raise ValueError(f"{path} was saved without compile(): gradients need the "
                             f"loss; compile the model before saving it")
        x_specs = [tf.TensorSpec([None, *t.shape[1:]], t.dtype) for t in model.inputs]
        y_specs = target_specs(model, None)
        sparse = y_specs[0].dtype == tf.int64
        classes = int(model.outputs[0].shape[-1]) if sparse else None
        xs = synthetic_batches(x_specs, steps, seed=0, batch=batch_size)
        ys = synthetic_batches(y_specs, steps, seed=1, classes=classes, batch=batch_size)
        batches = [(x[0] if len(x) == 1 else x, y[0] if len(y) == 1 else y)
                   for x, y in zip(xs, ys, strict=True)]
        report = collect_keras_ranges(model, batches, steps=steps, progress=progress)
        report.notes.append(f"inputs and targets were random (synthetic batches of "
                            f"{batch_size})")
        return report
    if path.is_dir() and ((path / "saved_model.pb").is_file()
                          or (path / "saved_model.pbtxt").is_file()):
        loaded = tf.saved_model.load(str(path))
        wanted = signature or "serving_default"
        if wanted not in loaded.signatures:
            raise ValueError(f"{path} has no signature {wanted!r}; available: "
                             f"{', '.join(sorted(loaded.signatures)) or 'none'}")
        concrete = loaded.signatures[wanted]
        internal = {id(t) for _, t in concrete.graph.captures}
        specs = [tf.TensorSpec(t.shape, t.dtype) for t in concrete.graph.inputs
                 if id(t) not in internal]
        report = collect_graph_ranges(concrete, synthetic_batches(specs, steps,
                                                                  batch=batch_size),
                                      config, name=f"{path.name}:{wanted}", progress=progress)
        report.notes.append(f"inputs were random (synthetic batches of {batch_size} where "
                            f"the batch dimension is open)")
        return report
    raise ValueError(f"--ranges needs a Keras model file (.keras, .h5) or a SavedModel "
                     f"directory; {path} is neither")
