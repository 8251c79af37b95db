"""The loss-scale update shared by tfamp's Keras 3 optimizer and TFAMP_ENABLE's custom loops.

Only TensorFlow (no Keras import), so the start-up hook's custom-loop patches
can use it for tf_keras and Keras 3 optimizers alike:

* ``finite_flags`` / ``all_reduce_flags``: one flag per gradient, all-reduced
  over replicas, so every replica makes the same apply-or-skip decision;
* ``update_scale``: the dynamic / fixed scale rules on a set of variables;
* ``apply_if_finite``: run an optimizer update only when every gradient is
  finite on every replica, from a replica context (with ``merge_call`` where
  the strategy needs it: an optimizer's update calls ``merge_call`` itself,
  which a ``tf.cond`` in a replica context cannot contain). Its skip branch
  counts the skipped step: a branch with work of its own is what lets XLA
  turn the conditional into selects (see ``apply_if_finite``);
* what the tape patches ask of a ``tape.gradient`` call: ``is_loss_target``
  (a float loss: a scalar, or a per-example / per-pixel vector differentiated
  with respect to variables; the gradient of a non-scalar target is the
  gradient of its sum, so seeding every element with the scale scales it
  exactly), and whether a loss-scale optimizer scaled it already
  (``mark_scaled`` / ``is_scaled``: tfamp's and Keras's own optimizers mark the
  loss they scale, so no patch scales it a second time);
* ``loss_scale_ops``: every op the loss-scale machinery creates (the seed, the
  unscaling, the finiteness flags, the scale and its update) carries the node
  attribute ``_tfamp_loss_scale``; the rewrite keeps such nodes float32 whatever
  the op lists say (``rewrite/coloring.py``). The scale update is written as
  selects (no ``tf.cond`` branch, which is a graph of its own, to mark again).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2

from tfamp.rewrite.reasons import LOSS_SCALE_ATTR

# A skipped step records the indices of its first few non-finite gradients.
BAD_NAMES_KEPT = 3
# The attribute a loss-scale optimizer sets on a loss it has scaled.
SCALED_LOSS_MARK = "_tfamp_scaled_loss"
_MARK = {LOSS_SCALE_ATTR: attr_value_pb2.AttrValue(b=True)}


@contextlib.contextmanager
def loss_scale_ops():
    """Ops created within carry ``_tfamp_loss_scale``: the rewrite keeps them float32.

    Applies to the current graph only (a ``tf.cond`` branch or loop body is a
    graph of its own: enter it again there). Nothing happens eagerly.

    Never hold it across a cross-replica synchronisation (``all_reduce``,
    ``merge_call``): the graph's attribute scope is shared by every thread, and
    MirroredStrategy runs the other replicas' threads there, whose ops (a whole
    forward pass) would be marked too and kept float32.
    """
    if tf.executing_eagerly():
        yield
        return
    with tf.compat.v1.get_default_graph()._attr_scope(_MARK):
        yield


def is_loss_target(target, sources) -> bool:
    """True if ``tape.gradient(target, sources)`` differentiates a loss tfamp scales.

    A loss is a float tensor (or a list of them): a scalar, or of any shape
    when some source is a variable. ``tape.gradient`` of a non-scalar target
    is the gradient of the sum of its elements (TensorFlow seeds every element
    with 1), so seeding every element with the scale instead scales the
    gradients exactly: a per-example or per-pixel loss vector differentiated
    for the weights (SimCLR's contrastive loss, a diffusion model's per-pixel
    error). A non-scalar target differentiated only for tensors is a
    Jacobian-type value the step computes with (a gradient penalty's
    d critic / d input), not a loss: left alone.
    """
    flat = tf.nest.flatten(target)
    if not flat or not all(isinstance(t, (tf.Tensor, tf.Variable)) and t.dtype.is_floating
                           for t in flat):
        return False
    if all(t.shape.rank == 0 for t in flat):
        return True
    return any(_is_variable(s) for s in tf.nest.flatten(sources))


def _is_variable(value) -> bool:
    """A tf.Variable or a Keras 3 variable (whose ``_value`` is one)."""
    return isinstance(value, tf.Variable) or isinstance(getattr(value, "_value", None),
                                                        tf.Variable)


def mark_scaled(loss) -> None:
    """Marks `loss` as scaled already (a value that takes no attribute, such as a
    Python float in eager code, is left unmarked)."""
    with contextlib.suppress(AttributeError, TypeError):
        setattr(loss, SCALED_LOSS_MARK, True)


def is_scaled(loss) -> bool:
    """True if a loss-scale optimizer marked `loss` (or one of a list of losses) as
    scaled (``mark_scaled``)."""
    return any(bool(getattr(t, SCALED_LOSS_MARK, False)) for t in tf.nest.flatten(loss))


def finite_flags(grads) -> tf.Tensor:
    """One bool per non-None gradient: all of its values are finite."""
    def values(g):
        return g.values if isinstance(g, tf.IndexedSlices) else g

    grads = [g for g in grads if g is not None]
    with loss_scale_ops():
        if not grads:
            return tf.ones([0], tf.bool)
        return tf.stack([tf.reduce_all(tf.math.is_finite(values(g))) for g in grads])


def all_reduce_flags(flags: tf.Tensor) -> tf.Tensor:
    """In a replica context of a strategy: a gradient is finite only if it is on every replica."""
    if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
        return flags
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return flags
    with loss_scale_ops():
        local_bad = tf.cast(tf.logical_not(flags), tf.float32)
    # Outside the scope: MirroredStrategy runs the other replicas' threads while
    # this one waits in the all-reduce (see loss_scale_ops).
    bad = context.all_reduce(tf.distribute.ReduceOp.SUM, local_bad)
    with loss_scale_ops():
        return tf.equal(bad, 0.0)


def update_scale(flags, *, scale, good_steps, skipped_steps, floor_skips, first_nonfinite,
                 dynamic: bool, growth_interval: int, min_scale: float):
    """Updates the scale state after a step whose gradient flags are `flags`.

    Every state argument is a variable (tf.Variable or keras.Variable), except
    `skipped_steps`, which may be None when the caller's skip branch counts
    skipped steps itself (``apply_if_finite``). Call it once per step: in a
    cross-replica context, or with no strategy. Written as selects, not
    ``tf.cond``: every variable is assigned its new value (the old one where
    nothing changes), so the step's only conditional is apply-or-skip, and
    that one XLA turns into selects too (``apply_if_finite``). Under XLA:GPU a
    conditional left in the step copies its predicate to the host and waits
    for it, once per step.

    Returns:
      (all gradients finite, the group of assignments).
    """
    with loss_scale_ops():
        first_bad = first_bad_indices(flags)
        finite = _finite_from_record(first_bad)
        current = tf.cast(tf.convert_to_tensor(scale), tf.float32)
        good = tf.cast(tf.convert_to_tensor(good_steps), tf.int64)
        counter = good + 1
        grow = tf.logical_and(finite, counter >= growth_interval) if dynamic else tf.constant(False)
        doubled = current * 2.0
        grown = tf.where(tf.math.is_finite(doubled), doubled, current)
        halved = tf.maximum(current / 2.0, min_scale)
        new_scale = tf.where(finite, tf.where(grow, grown, current),
                             halved if dynamic else current)
        new_good = tf.where(tf.logical_and(finite, tf.logical_not(grow)), counter,
                            tf.zeros_like(counter)) if dynamic else tf.zeros_like(counter)
        floor = tf.cast(tf.convert_to_tensor(floor_skips), tf.int64)
        new_floor = tf.where(finite, tf.zeros_like(floor),
                             tf.where(current <= min_scale, floor + 1, tf.zeros_like(floor)))
        new_first = kept_bad_indices(flags, tf.convert_to_tensor(first_nonfinite))
        updates = [
            scale.assign(tf.cast(new_scale, scale.dtype)),
            good_steps.assign(tf.cast(new_good, good_steps.dtype)),
            floor_skips.assign(tf.cast(new_floor, floor_skips.dtype)),
            first_nonfinite.assign(tf.cast(new_first, first_nonfinite.dtype)),
        ]
        if skipped_steps is not None:
            skipped = tf.cast(tf.convert_to_tensor(skipped_steps), tf.int64)
            new_skipped = skipped + tf.cast(tf.logical_not(finite), tf.int64)
            updates.append(skipped_steps.assign(tf.cast(new_skipped, skipped_steps.dtype)))
        group = tf.group(*[u for u in updates if isinstance(u, (tf.Operation, tf.Tensor))])
    return finite, group


def _finite_from_record(first_bad) -> tf.Tensor:
    """No bad flag: every slot of the record is -1 (the same verdict as ``all_finite``).

    Read off the whole record, not its first slot, and not shared with the
    apply-or-skip predicate: under XLA:GPU that predicate is one scalar read by
    every weight update, so it is computed once and each scale variable's select
    became a kernel of its own (XLA does not merge sibling fusions whose only
    shared operand is a scalar). Computed here from the record (s32[3]), the
    verdict fuses into each select, the selects share a non-scalar operand, and
    XLA merges them into one kernel (measured: the scale, good-step and floor
    selects, three kernels, became part of one multi-output fusion).
    """
    return tf.reduce_all(tf.less(first_bad, 0))


def first_bad_indices(flags) -> tf.Tensor:
    """The positions of the first ``BAD_NAMES_KEPT`` False flags, padded with -1 (int32).

    Static shapes only (no ``tf.where`` of a condition, whose output size depends
    on the data), so XLA compiles it without a dynamic shape; and no sort
    (``top_k``): each bad flag's rank among the bad flags is a count of the bad
    flags before it (one reduction over flags x flags, a few thousand elements
    for a model's few hundred gradients), and the k-th index is the bad position
    of rank k (a second reduction). XLA fuses both, and the scale update that
    reads them, into a few small kernels; a sort took three of its own
    (measured: BUILD_NOTES.md, session 12).
    """
    flags = tf.convert_to_tensor(flags)
    return _kth_bad_or(flags, lambda any_bad: -tf.ones([BAD_NAMES_KEPT], tf.int32))


def kept_bad_indices(flags, previous) -> tf.Tensor:
    """``first_bad_indices`` when a flag is False, else `previous` (the record kept).

    The same reduction as ``first_bad_indices``, with `previous` (or -1, on a
    bad step) in its last column, so the record's new value comes out of the
    reduction itself: XLA computes both reductions, of one shape and one input,
    in one kernel (a multi-output fusion), where a select after the reduction
    (``tf.where(finite, previous, first_bad)``) was a kernel of its own (an
    s32[3] select cannot join the scalar selects of the scale update). Measured
    (H100 program, compiled without a GPU): a 40-block test model 658 -> 657
    kernels; an LSTM (9 gradients) 4803 -> 4802, with the scale log's copy gone
    too (``scale_state.step_log_values``).
    """
    flags = tf.convert_to_tensor(flags)
    previous = tf.cast(tf.convert_to_tensor(previous), tf.int32)
    return _kth_bad_or(flags, lambda any_bad: tf.where(any_bad, -tf.ones_like(previous),
                                                       previous))


def _kth_bad_or(flags, last_column) -> tf.Tensor:
    """Row k: the position of the bad flag of rank k, else ``last_column(any_bad)[k]``.

    One Max reduction over [BAD_NAMES_KEPT, N + 1]: the N flags' columns (the
    bad position of rank k, else -1) and a last column, every value >= -1. The
    ranks are counted for N + 1 positions: the last counts every bad flag, so
    whether any flag is bad needs no reduction of its own. The last column is a
    select on the column index, not a concatenation, which XLA made a kernel of
    its own when the flags are few (9, an LSTM's).
    """
    size = tf.size(flags)
    columns = tf.range(size + 1)
    bad = tf.pad(tf.logical_not(flags), [[0, 1]])  # the last column is no flag
    earlier = columns[tf.newaxis, :] < columns[:, tf.newaxis]  # [p, q]: q before p
    rank = tf.reduce_sum(tf.cast(tf.logical_and(bad[tf.newaxis, :], earlier), tf.int32), axis=1)
    wanted = tf.range(BAD_NAMES_KEPT)[:, tf.newaxis]
    match = tf.logical_and(bad[tf.newaxis, :], tf.equal(rank[tf.newaxis, :], wanted))
    last = last_column(tf.greater(rank[size], 0))
    other = tf.where(tf.equal(columns, size)[tf.newaxis, :], last[:, tf.newaxis],
                     -tf.ones_like(match, tf.int32))
    found = tf.where(match, tf.broadcast_to(columns, tf.shape(match)), other)
    return tf.reduce_max(found, axis=1)


def all_finite(flags) -> tf.Tensor:
    """True when no flag is False: read off ``first_bad_indices`` (no first bad one).

    The apply-or-skip predicate and the scale update both call this, so the
    compiled step computes one verdict from the reductions the record of bad
    gradients needs anyway, instead of a separate conjunction of every flag.
    """
    with loss_scale_ops():
        return tf.less(first_bad_indices(flags)[0], 0)


def unscale(grad, scale):
    """`grad / scale` computed in float32, returned in the gradient's dtype."""
    if grad is None:
        return None
    with loss_scale_ops():
        scale = tf.cast(tf.convert_to_tensor(scale), tf.float32)
        if isinstance(grad, tf.IndexedSlices):
            values = tf.cast(grad.values, tf.float32) / scale
            return tf.IndexedSlices(tf.cast(values, grad.values.dtype), grad.indices,
                                    grad.dense_shape)
        return tf.cast(tf.cast(grad, tf.float32) / scale, grad.dtype)


def seed(target, scale):
    """The initial gradient of a scaled backprop: `scale` in the shape and dtype of
    `target` (of each target, for a list: the structure ``output_gradients`` takes)."""
    with loss_scale_ops():
        scale = tf.cast(tf.convert_to_tensor(scale), tf.float32)
        return tf.nest.map_structure(
            lambda t: tf.cast(tf.fill(tf.shape(t), scale), t.dtype), target)


def apply_if_finite(grads, apply_fn: Callable, update_fn: Callable, *, skipped_steps,
                    skip_fn: Callable | None = None) -> None:
    """Calls ``apply_fn(grads)`` if every gradient is finite on every replica.

    The skip branch adds one to `skipped_steps` (then calls `skip_fn`), so
    `update_fn` is told not to count skipped steps (``count_skipped=False``).
    Why the count sits in the branch: XLA's conditional simplifier turns a
    two-branch conditional whose branches hold only element-wise and cheap
    ops into selects, unless one branch is empty (only parameters and
    tuples), which it deems cheaper than a select. A skip branch that only
    returns its inputs kept the conditional, and with it a predicate copied to
    the host and waited for once per step on a GPU; with the count in it,
    a momentum or Adam step compiles to selects like Keras's own
    loss-scaled step (measured: BUILD_NOTES.md, session 12).

    Args:
      grads: this replica's gradients (None entries allowed).
      apply_fn: the optimizer update, called with each replica's own gradients.
      update_fn: called once per step as ``update_fn(flags, count_skipped=False)``
        with the all-reduced flags (the scale update).
      skipped_steps: the owner's skipped-step counter (a variable).
      skip_fn: called too on a non-finite step (e.g. to count ``iterations``);
        optional.
    """
    grads = list(grads)
    flags = all_reduce_flags(finite_flags(grads))
    finite = all_finite(flags)
    context = tf.distribute.get_replica_context()
    needs_merge = (tf.distribute.has_strategy() and context is not None
                   and not tf.__internal__.distribute.strategy_supports_no_merge_call())

    def run(fn, *args):
        fn(*args)

    def skip():
        with loss_scale_ops():  # a branch is a graph of its own: mark again
            skipped_steps.assign_add(tf.ones([], skipped_steps.dtype))
        if skip_fn is not None:
            skip_fn()

    if not needs_merge:
        if tf.executing_eagerly():
            if bool(finite):
                apply_fn(grads)
            else:
                skip()
        else:
            tf.cond(finite, lambda: run(apply_fn, grads), skip)
        update_fn(flags, count_skipped=False)
        return

    def cross_replica(distribution, flags, grads):
        flags = distribution.experimental_local_results(flags)[0]

        def apply():
            distribution.extended.call_for_each_replica(apply_fn, args=(grads,))

        tf.cond(all_finite(flags), apply, skip)
        update_fn(flags, count_skipped=False)

    context.merge_call(cross_replica, args=(flags, grads))


def apply_gradients_if_finite(optimizer, original: Callable, grads_and_vars, args, kwargs,
                              update_fn: Callable, *, skipped_steps):
    """A tf_keras ``apply_gradients`` (`original`) that skips a non-finite step.

    Builds the optimizer first, so its slots exist before the conditional
    update; a skipped step still advances ``iterations``, as tf_keras's own
    loss-scale wrapper does (learning-rate schedules keep counting batches).

    Returns:
      ``optimizer.iterations``, like ``apply_gradients``.
    """
    grads_and_vars = list(grads_and_vars)
    variables = [v for _, v in grads_and_vars]
    if not (getattr(optimizer, "built", False) or getattr(optimizer, "_built", False)):
        with tf.init_scope():
            if hasattr(optimizer, "build"):
                optimizer.build(variables)
            else:  # a legacy optimizer (keras.optimizers.legacy.*): creates what is missing
                optimizer._create_all_weights(variables)

    def apply(grads):
        original(optimizer, list(zip(grads, variables, strict=True)), *args, **kwargs)

    def skip():
        optimizer.iterations.assign_add(1)

    apply_if_finite([g for g, _ in grads_and_vars], apply, update_fn,
                    skipped_steps=skipped_steps, skip_fn=skip)
    return optimizer.iterations


def apply_keras3_if_finite(optimizer, original: Callable, grads, trainable_variables,
                           update_fn: Callable, *, skipped_steps) -> None:
    """A Keras 3 ``apply`` (`original`) that skips a non-finite step.

    Builds the optimizer first, so its variables exist before the conditional
    update; a skipped step touches no optimizer variable (Keras 3's rule).
    """
    grads = list(grads)
    if trainable_variables is not None:
        trainable_variables = list(trainable_variables)
        if not optimizer.built:
            with tf.init_scope():
                optimizer.build(trainable_variables)
    apply_if_finite(grads, lambda g: original(optimizer, g, trainable_variables), update_fn,
                    skipped_steps=skipped_steps)
