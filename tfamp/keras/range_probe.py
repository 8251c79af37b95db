"""The range probe for Keras models (``KerasRangeProbe``, ``collect_keras_ranges``) and files.

The probe runs, for one batch, a separate tf.function that computes the
model's loss in float32 and back-propagates it, and buckets on the device (see
``tfamp.numerics.ranges.bucket_counts``) every layer's forward output, the
gradient of the loss with respect to that output (the activation gradient
backprop hands to the layer below) and every weight gradient. For Sequential
and Functional models the layer outputs come from a functional sub-model that
returns every layer's output, so the gradients are taken on the same tensors
that feed the next layer. Subclassed models have no such graph of layers:
only weight gradients are collected (the report says so).

The probe changes nothing: it applies no gradients, and restores the model's
non-trainable variables (BatchNorm statistics) and metric variables it touched.

tf_keras and Keras 3 models (TensorFlow backend) are handled alike; what
differs between them (layer graph, variable names, loss check) is asked of
``tfamp.keras.flavour``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import tensorflow as tf
import tf_keras as keras

from tfamp.keras.flavour import flavour_of
from tfamp.numerics import ranges as ranges_lib
from tfamp.numerics.graph_probe import collect_graph_ranges, synthetic_batches
from tfamp.numerics.monitor import DEFAULT_OUTPUT_DIR, DEFAULT_STEPS
from tfamp.numerics.range_report import RangeReport
from tfamp.numerics.ranges import TensorRange
from tfamp.runtime.plain import plain_calls, plain_function

__all__ = ["DEFAULT_OUTPUT_DIR", "DEFAULT_STEPS", "KerasRangeProbe", "collect_file_ranges",
           "collect_keras_ranges", "current_loss_scale", "dynamic_settings",
           "state_variables", "unpack_batch"]
SUBCLASSED_NOTE = ("subclassed model: no graph of layers to take outputs from, so only "
                   "weight gradients were collected (build it as a Sequential or "
                   "Functional model to see activation gradients)")
FLOAT32_NOTE = ("magnitudes are float32 reference values (the probe runs unconverted); "
                "shares say what float16 would do to them at each scale")


class KerasRangeProbe:
    """Buckets a Keras model's activations and gradients for one batch at a time.

    Args:
      model: a built tf_keras or Keras 3 (TensorFlow backend) model compiled
        with a loss.

    Example:
      >>> probe = KerasRangeProbe(model)
      >>> entries = probe.collect(x_batch, y_batch)   # list[TensorRange]
    """

    def __init__(self, model):
        self.flavour = flavour_of(model)
        if not self.flavour.has_loss(model):
            raise ValueError(
                f"model {model.name!r} has no loss: compile it first "
                f"(model.compile(optimizer=..., loss=...)); the ranges of gradients need "
                f"the loss the model trains on")
        self.model = model
        self.notes = [FLOAT32_NOTE]
        self._labels, self._sub, self._pred_index = _intermediate_outputs(model, self.flavour)
        if self._sub is None:
            self.notes.insert(0, SUBCLASSED_NOTE)
        self._fn = plain_function(self._step)
        self._ready = False

    def _step(self, x, y, sample_weight):
        model = self.model
        variables = model.trainable_variables
        # Restored in the same graph at the end (automatic control dependencies
        # keep reads first and these assigns last): BatchNorm statistics and
        # metric variables must not remember this pass.
        state = state_variables(model)
        saved = [tf.identity(v.read_value() if hasattr(v, "read_value") else v.value)
                 for v in state]
        with tf.GradientTape() as tape, plain_calls():  # float32 on purpose
            if self._sub is not None:
                outputs = tf.nest.flatten(self._sub(x, training=True))
                tape.watch(outputs)
                y_pred = tf.nest.pack_sequence_as(
                    model.outputs if len(model.outputs) > 1 else model.outputs[0],
                    [outputs[i] for i in self._pred_index])
            else:
                outputs = []
                y_pred = model(x, training=True)
            loss = model.compute_loss(x, y, y_pred, sample_weight)
        grads = tape.gradient(loss, list(outputs) + list(variables))
        act_grads, weight_grads = grads[:len(outputs)], grads[len(outputs):]
        tensors = []
        for label, out, grad in zip(self._labels, outputs, act_grads, strict=True):
            if out.dtype.is_floating:
                tensors.append(("activation", label, out))
                if grad is not None:
                    tensors.append(("activation_gradient", label, grad))
        for var, grad in zip(variables, weight_grads, strict=True):
            if grad is None:
                continue
            if isinstance(grad, tf.IndexedSlices):
                grad = grad.values
            tensors.append(("weight_gradient", self.flavour.variable_label(var), grad))
        counts, maxes = ranges_lib.bucket_counts_many([t for _, _, t in tensors])
        self._kinds = [(kind, label) for kind, label, _ in tensors]  # set while tracing
        known = {id(v) for v in state}
        restores = [v.assign(value) for v, value in zip(state, saved, strict=True)]
        # Metric variables compute_loss created while tracing start from zeros.
        restores += [v.assign(tf.zeros_like(v)) for v in state_variables(model)
                     if id(v) not in known]
        with tf.control_dependencies(restores):
            return tf.identity(counts), tf.identity(maxes)

    def collect(self, x, y=None, sample_weight=None) -> list[TensorRange]:
        """Runs the probe on one batch; returns one TensorRange per tensor."""
        if not self._ready:
            # compute_loss may create the loss metrics while tracing. The graph
            # must list them among the variables it restores, so trace again.
            before = len(state_variables(self.model))
            self._fn.get_concrete_function(x, y, sample_weight)
            if len(state_variables(self.model)) != before:
                self._fn = plain_function(self._step)
            self._ready = True
        counts, maxes = self._fn(x, y, sample_weight)
        counts, maxes = counts.numpy(), maxes.numpy()
        return [TensorRange.from_vector(label, _layer_of(kind, label), kind, row, top)
                for (kind, label), row, top in zip(self._kinds, counts, maxes, strict=True)]


def state_variables(model) -> list:
    """Variables a forward pass in training mode or compute_loss may update
    (non-trainable weights such as BatchNorm statistics, metric variables)."""
    seen, result = set(), []
    for variable in [*model.non_trainable_variables,
                     *(v for m in model.metrics for v in m.variables)]:
        if id(variable) not in seen:
            seen.add(id(variable))
            result.append(variable)
    return result


def _intermediate_outputs(model, flavour):
    """(labels, sub-model returning every layer's outputs, index of each model output).

    (labels=[], None, None) for models without a graph of layers.
    """
    if not flavour.is_graph_network(model):
        return [], None, None
    labels, tensors = [], []
    for layer in model.layers:
        if flavour.is_input_layer(layer):
            continue
        try:
            output = layer.output
        except (AttributeError, RuntimeError, ValueError):
            continue  # a layer used at several places has no single output
        flat = tf.nest.flatten(output)
        for i, tensor in enumerate(flat):
            labels.append(layer.name if len(flat) == 1 else f"{layer.name}:{i}")
            tensors.append(tensor)
    position = {id(t): i for i, t in enumerate(tensors)}
    pred_index = []
    for output in model.outputs:
        if id(output) not in position:  # e.g. an output that is an input
            return [], None, None
        pred_index.append(position[id(output)])
    sub = flavour.keras.Model(model.inputs, tensors, name=f"{model.name}_tfamp_ranges")
    return labels, sub, pred_index


def _layer_of(kind: str, label: str) -> str:
    if kind == "weight_gradient":
        return label.rsplit("/", 1)[0] if "/" in label else label
    return label.split(":")[0]


def current_loss_scale(model) -> float | None:
    """The loss scale of the model's optimizer now, None if it does not scale."""
    optimizer = getattr(model, "optimizer", None)
    scale = getattr(optimizer, "loss_scale", None) if optimizer is not None else None
    if scale is None:
        scale = getattr(optimizer, "dynamic_scale", None)  # Keras 3's LossScaleOptimizer
    if scale is None and isinstance(getattr(optimizer, "initial_scale", None), (int, float)):
        scale = optimizer.initial_scale  # Keras 3's, not built yet
    if scale is None:
        return None
    try:
        return float(scale.numpy() if hasattr(scale, "numpy") else scale)
    except (TypeError, ValueError):
        return None


def collect_keras_ranges(model, batches: Iterable, *, steps: int = DEFAULT_STEPS,
                         loss_scale: float | None = None, progress=None) -> RangeReport:
    """Collects ranges for up to `steps` batches (weights are not changed).

    Args:
      model: a compiled tf_keras or Keras 3 model.
      batches: an iterable of (x, y) or (x, y, sample_weight) tuples, e.g. a
        batched tf.data.Dataset.
      steps: how many batches to use.
      loss_scale: the scale to report as current; the optimizer's if None.
      progress: called with the number of batches done after each one (e.g.
        ``tfamp.runtime.progress.Counter.done``).

    Returns:
      The RangeReport.

    Example:
      >>> report = collect_keras_ranges(model, [(x[:32], y[:32])], steps=1)
      >>> print(report.summary_text())
    """
    probe = KerasRangeProbe(model)
    tensors: list[TensorRange] = []
    done = 0
    for batch in batches:
        if done >= steps:
            break
        x, y, sample_weight = unpack_batch(batch)
        ranges_lib.accumulate(tensors, probe.collect(x, y, sample_weight))
        done += 1
        if progress is not None:
            progress(done)
    if not done:
        raise ValueError("collect_keras_ranges received no batches; pass at least one "
                         "(x, y) batch")
    scale = loss_scale if loss_scale is not None else current_loss_scale(model)
    return RangeReport(model=model.name, steps=done, loss_scale=scale, tensors=tensors,
                       notes=list(probe.notes), **dynamic_settings(model))


def dynamic_settings(model) -> dict[str, Any]:
    """The dynamic loss-scale settings the range advice reasons from: the growth
    interval, and where the scale started (the start scale tfamp probed from the
    first batch's gradients, else the optimizer's numeric initial scale)."""
    optimizer = getattr(model, "optimizer", None)
    growth = getattr(optimizer, "dynamic_growth_steps", None)
    settings = {}
    if isinstance(growth, (int, np.integer)):
        settings["growth_interval"] = int(growth)
    probed = getattr(getattr(model, "_tfamp_state", None), "start_scale", None)
    initial = getattr(optimizer, "initial_scale", None)
    if getattr(probed, "scale", None):
        settings["initial_scale"] = float(probed.scale)
    elif isinstance(initial, (int, float, np.number)) and not isinstance(initial, bool):
        settings["initial_scale"] = float(initial)
    return settings


def unpack_batch(batch) -> tuple[Any, Any, Any]:
    """(x, y, sample_weight) from a batch tuple, as Keras unpacks it."""
    return keras.utils.unpack_x_y_sample_weight(batch)


def collect_file_ranges(path, *, steps: int = 3, signature: str | None = None,
                        config=None, batch_size: int = 8, progress=None) -> RangeReport:
    """Ranges of a saved model on `steps` synthetic batches (``tfamp inspect --ranges``).

    A compiled Keras file (.keras, .h5; tf_keras or Keras 3) gives activations, activation
    gradients and weight gradients (random inputs, random targets shaped like
    the outputs; integer labels for sparse losses). A SavedModel directory
    gives forward activations only (``graph_probe.FORWARD_ONLY_NOTE``). Each batch has
    `batch_size` rows; `progress` is called with the batches done after each.

    Raises:
      ValueError: the path is neither, or the Keras model was saved uncompiled.
    """
    from pathlib import Path

    import tensorflow as tf

    path = Path(path)
    if path.suffix.lower() in (".keras", ".h5"):
        from tfamp.inspect.graph_files import load_keras_file, target_specs

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

