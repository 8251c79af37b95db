"""Running tfamp's probes the way the step runs, and agreeing on what they found.

Under a tf.distribute strategy a training step runs once per replica, in a
replica context (``strategy.run``), each replica on its own part of the batch,
and Keras's metric variables accept updates only there. tfamp's own probes of
the step (the start-scale probe, the overflow locator) therefore run the same
way (``run_per_replica``: every replica takes its rows of the batch this
worker read), and what each replica finds is then made one answer for every
replica of every worker (``agree_rows``: an all-gather over the strategy, so
each worker ends with the same rows, in the same order). Without a strategy
the probe is the plain single-device call; under a strategy of one replica
(MirroredStrategy on one GPU) it still runs in that replica's context, where
tf_keras's metrics are updated, and the agreement is the plain value.

A worker must reach ``agree_rows`` whether its own probe worked or not (the
gather is collective: one absent worker stalls the others), so callers catch
their own failure, agree on a row saying so, and only then raise.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow.python.distribute import distribute_lib


def is_distributed(strategy) -> bool:
    """True when a step runs on more than one replica (any number of workers)."""
    return strategy is not None and strategy.num_replicas_in_sync > 1


def has_replica_context(strategy) -> bool:
    """True under a tf.distribute strategy of its own, of any number of replicas
    (not TensorFlow's default strategy): a step runs in its replica context."""
    # (TensorFlow's public API says whether a strategy's scope is entered, not
    # whether a strategy object is the default one)
    return strategy is not None and strategy is not distribute_lib._get_default_strategy()


def replica_rows(batch):
    """This replica's rows of `batch` (called in a replica context).

    Replica i of R takes rows [i * n // R, (i + 1) * n // R) of the n rows
    this worker read (at least one row): the share of a batch Keras gives a
    replica. Non-tensor leaves (a missing sample_weight) pass through.
    """
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return batch
    index = tf.cast(context.replica_id_in_sync_group, tf.int32)
    count = context.num_replicas_in_sync

    def cut(value):
        if not isinstance(value, (tf.Tensor, np.ndarray)) or not getattr(value, "shape", ()):
            return value
        rows = tf.shape(value)[0]
        start = tf.minimum(index * rows // count, tf.maximum(rows - 1, 0))
        stop = tf.maximum((index + 1) * rows // count, start + 1)
        return value[start:stop]

    return tf.nest.map_structure(cut, batch)


def host_rows(strategy, value, local_index: int) -> np.ndarray:
    """``replica_rows`` on the host: local replica `local_index`'s rows of `value`."""
    value = np.asarray(value)
    if not is_distributed(strategy) or not value.shape:
        return value
    local = len(strategy.extended.worker_devices)
    resolver = getattr(strategy, "cluster_resolver", None)
    task = int(getattr(resolver, "task_id", 0) or 0) if resolver is not None else 0
    index, count, rows = task * local + local_index, strategy.num_replicas_in_sync, len(value)
    start = min(index * rows // count, max(rows - 1, 0))
    return value[start:max((index + 1) * rows // count, start + 1)]


def run_per_replica(strategy, fn, *args):
    """``fn(*args)`` once per replica, in replica context (inside a tf.function).

    Returns:
      a list with each local replica's result (one element without a strategy).
    """
    if not has_replica_context(strategy):
        return [fn(*args)]
    results = strategy.run(fn, args=args)
    return _local_results(strategy, results)


def _local_results(strategy, results) -> list:
    """[replica 0's structure, replica 1's, ...] of this worker's replicas."""
    flat = tf.nest.flatten(results, expand_composites=False)
    per_leaf = [strategy.experimental_local_results(leaf) for leaf in flat]
    count = len(per_leaf[0]) if per_leaf else 1
    return [tf.nest.pack_sequence_as(results, [leaf[i] for leaf in per_leaf])
            for i in range(count)]


def agree_rows(strategy, row) -> np.ndarray:
    """Every worker's `row` (a 1-D float or int vector of the same length everywhere).

    Returns:
      a [replicas, len(row)] array, the same on every worker (each of a worker's
      replicas contributes that worker's row). Without a strategy: [1, len(row)].
    """
    row = np.asarray(row)
    if not is_distributed(strategy):
        return row[None]
    value = tf.constant(row)[None]
    distributed = strategy.experimental_distribute_values_from_function(lambda _: value)
    return np.asarray(strategy.gather(distributed, axis=0))


def local_components(variable) -> tuple:
    """The per-device variables behind `variable` on this worker (itself when it is
    not distributed); a Keras 3 variable is read through its tf.Variable."""
    inner = getattr(variable, "_value", None)
    if not isinstance(inner, tf.Variable):
        inner = variable
    strategy = getattr(inner, "_distribute_strategy", None)
    if strategy is None:
        return (inner,)
    return tuple(strategy.experimental_local_results(inner))
