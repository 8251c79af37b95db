"""What a skipped step does to the epoch's metrics: its inf/nan values are left out.

A step whose gradients are not finite is skipped (no weight moves), but Keras
updates its metrics inside the train step, before the update is decided: the
loss tracker's running mean took the step's inf/nan, the epoch's ``loss`` in
History and the progress bar read NaN for the rest of the epoch, and
``keras.callbacks.TerminateOnNaN`` stopped a run that the float32 fallback had
just rescued. The rule (both Kerases, ``tfamp.enable`` and ``TFAMP_ENABLE``):

* a metric that a skipped step made inf/nan is put back as it was before the
  step, so an overflowing forward pass (a layer the fallback then moves to
  float32) does not poison the epoch's running mean; a skipped step with a
  finite loss (its gradients overflowed at too large a scale) counts, as in
  Keras: that loss is the model's true loss at its weights;
* the logs of such a step (per batch: progress bar, callbacks) show the
  running values without it, before any other step Keras's value for an
  empty mean, 0; a value the step returns that is not a metric's (a raw loss
  tensor) is the step's own and is left as it is;
* an epoch that left a metric empty this way (every step skipped with inf/nan)
  ends with NaN for it: nothing finite was measured (``epoch_results``);
* a skipped step whose logs held an inf/nan is counted
  (``StepGuard.nonfinite_skips``): the float32 fallback's sign that a forward
  pass overflowed, which no loss scale fixes.

In the graph: the metric variables are read before the step and, if the
scale owner's skipped-step counter moved during it, assigned back (a select,
no conditional); per replica, in the replica context (Keras's metric
variables are sync-on-read: each replica keeps its own part). A log that is a
metric's result is one value for every replica, and tf_keras sums the
replicas' logs: it is chosen once for all of them (``_choose_once``), or every
batch log would read the loss times the replicas, and a step rescued on one
replica inf.
"""

from __future__ import annotations

import math
import threading
import weakref

import numpy as np
import tensorflow as tf

from tfamp.keras.scale_update import loss_scale_ops


def _metrics(model) -> list:
    try:
        return list(model.metrics)
    except (AttributeError, ValueError, RuntimeError):
        return []


def _read(variable) -> tf.Tensor:
    return tf.identity(tf.convert_to_tensor(variable))


def counter_variable(strategy):
    """A per-replica count (sync on read, summed): how many skipped steps had inf/nan logs.

    Made outside any trace, in the model's strategy scope; never checkpointed.
    """
    with tf.init_scope(), strategy.scope():
        return tf.Variable(0, dtype=tf.int64, trainable=False, name="tfamp_nonfinite_skips",
                           synchronization=tf.VariableSynchronization.ON_READ,
                           aggregation=tf.VariableAggregation.SUM)


class StepGuard:
    """One trace of a train step: the metrics before it, and what to do after it.

    Args:
      model: the enabled model.
      skipped_steps: the scale owner's skipped-step counter (a variable), read
        now and after the step.
      nonfinite_skips: ``counter_variable`` of the model, or None.
      replica_logs_summed: Keras sums the replicas' logs (tf_keras): a log that
        is one value for every replica (a metric's result) is chosen once for
        all of them, not once per replica, which the sum would multiply.
    """

    def __init__(self, model, skipped_steps, nonfinite_skips=None, *,
                 replica_logs_summed: bool = False):
        self._model = model
        self._replica_logs_summed = replica_logs_summed
        self._skipped_steps = skipped_steps
        self._nonfinite_skips = nonfinite_skips
        self._metrics = _metrics_of_this_trace(model)
        self._variables = [v for m in self._metrics for v in m.variables]
        with loss_scale_ops():
            self._before = [_read(v) for v in self._variables]
            self._skipped_before = _read(skipped_steps)

    def finish(self, logs):
        """After the step: puts back what a skipped step poisoned; returns its logs.

        Ordering is TensorFlow's automatic control dependencies: reads and
        assigns of one variable run in the order they were written here.
        """
        with loss_scale_ops():
            skipped = tf.greater(_read(self._skipped_steps), self._skipped_before)
            if self._nonfinite_skips is not None:
                self._nonfinite_skips.assign_add(
                    tf.cast(tf.logical_and(skipped, _any_nonfinite(logs)), tf.int64))
            put_back = {}
            for metric, before in self._per_metric():
                after = [_read(v) for v in metric.variables]
                poisoned = [tf.logical_not(tf.reduce_all(tf.math.is_finite(a)))
                            for a in after if a.dtype.is_floating]
                back = (tf.logical_and(skipped, tf.reduce_any(tf.stack(poisoned)))
                        if poisoned else tf.constant(False))
                put_back[id(metric)] = back
                for variable, old, new in zip(metric.variables, before, after, strict=True):
                    variable.assign(tf.where(back, old, new))
        if not isinstance(logs, dict) or not self._metrics:
            return logs
        # Read after the assigns (not under loss_scale_ops: tf_keras's result() is
        # a merge_call under MirroredStrategy, which the mark must not span).
        fresh = {}
        for metric in self._metrics:
            result = metric.result()
            items = result.items() if isinstance(result, dict) else [(metric.name, result)]
            for key, value in items:
                fresh[key] = (put_back[id(metric)], value)
        chosen = {}
        for key, value in logs.items():
            if key not in fresh or not _is_float_tensor(value):
                continue
            use_fresh, now = fresh[key]
            now = tf.convert_to_tensor(now)
            if now.shape == value.shape:
                chosen[key] = (use_fresh, now, value)
        once = {}
        if (self._replica_logs_summed and tf.distribute.has_strategy()
                and not tf.distribute.in_cross_replica_context()):
            once = tf.distribute.get_replica_context().merge_call(
                _choose_once, args=(chosen,))
        logs = dict(logs)
        with loss_scale_ops():
            for key, (use_fresh, now, value) in chosen.items():
                logs[key] = (once[key] if once.get(key) is not None
                             else _choose(use_fresh, now, value))
        return logs

    def _per_metric(self):
        at = 0
        for metric in self._metrics:
            count = len(metric.variables)
            yield metric, self._before[at:at + count]
            at += count


def _choose(use_fresh, now, value):
    """The metric's fresh result where `use_fresh`, else the step's logged `value`."""
    return tf.where(use_fresh, tf.cast(now, value.dtype), value)


def _choose_once(strategy, chosen):
    """(merge_call) Each log that is one value for every replica, chosen once:
    the fresh result where any replica put its metric back. None for a log that
    differs per replica (a raw loss tensor): each replica chooses its own."""
    once = {}
    with loss_scale_ops():
        for key, (use_fresh, now, value) in chosen.items():
            if isinstance(value, tf.distribute.DistributedValues):
                once[key] = None
                continue
            flags = strategy.experimental_local_results(use_fresh)
            any_fresh = tf.reduce_any(tf.stack([tf.convert_to_tensor(f) for f in flags]))
            now = strategy.experimental_local_results(now)[0]
            once[key] = _choose(any_fresh, now, value)
    return once


_trace_metrics: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_trace_lock = threading.Lock()


def _metrics_of_this_trace(model) -> list:
    """The model's metrics when this trace's first replica began its step.

    Keras builds some metrics inside the first trace of the step (tf_keras's
    compiled loss, Keras 3's compiled metrics); under MirroredStrategy the
    second replica's step starts after the first has built them. Every replica
    of one trace guards the same metrics (each ``result()`` is a merge_call
    under tf_keras, which the replicas must make alike); tf.function traces
    again once variables were created, and that trace guards them all.
    """
    graph = tf.compat.v1.get_default_graph()
    with _trace_lock:
        per_model = _trace_metrics.setdefault(graph, {})
        if id(model) not in per_model:
            per_model[id(model)] = [m for m in _metrics(model) if m.variables]
        return per_model[id(model)]


def _is_float_tensor(value) -> bool:
    return isinstance(value, tf.Tensor) and value.dtype.is_floating


def _any_nonfinite(logs) -> tf.Tensor:
    values = [tf.reduce_all(tf.math.is_finite(t)) for t in tf.nest.flatten(logs)
              if _is_float_tensor(t)]
    if not values:
        return tf.constant(False)
    return tf.logical_not(tf.reduce_all(tf.stack(values)))


# -- the epoch's end ---------------------------------------------------------------------

def epoch_results(model, results: dict) -> dict:
    """`results` with NaN for every metric that received nothing this epoch.

    Called at the end of an epoch in which every step was skipped: a metric whose
    variables are all still zero (Keras resets them at the epoch's start) was
    put back at every step, and its empty mean (0) would say the run trained
    to a loss of 0.
    """
    results = dict(results)
    for metric in _metrics(model):
        values = [np.asarray(v.numpy()) for v in metric.variables]
        if not values or any(np.any(v != 0) for v in values):
            continue
        keys = [metric.name]
        try:
            result = metric.result()
            if isinstance(result, dict):
                keys = list(result)
        except Exception:  # an empty metric that cannot say its keys: its name
            pass
        for key in keys:
            if key in results:
                results[key] = math.nan
    return results
