"""The first inf/nan op of a Keras model's training step on one batch (tf_keras and Keras 3).

``keras_step_locator`` traces the model's loss and gradients once (a plain
float32 function: forward, ``compute_loss``, ``tape.gradient``, no update; or
the model's own ``train_step`` in the start-scale probe's mode, which
differentiates every loss unscaled and applies nothing) and
answers ``locate(config)`` for any AmpConfig by rewriting that graph as tfamp
would and running it with a check after every op
(``tfamp.numerics.nonfinite.locate_nonfinite``). The model's non-trainable and
metric variables are restored after each answer. Used by the float32 fallback
(``fallback.py``) and the stuck-at-floor warning (``diagnose_keras_model``).
"""

from __future__ import annotations

import contextlib

import tensorflow as tf

from tfamp.config import AmpConfig
from tfamp.keras import call_scopes, replicas, scale_update
from tfamp.keras import tape as tape_hooks
from tfamp.keras.flavour import flavour_of
from tfamp.keras.range_probe import state_variables
from tfamp.keras.start_scale import NoLossDifferentiated, Recorder, assigned_variables
from tfamp.keras.step_scope import probe_mode
from tfamp.numerics import nonfinite
from tfamp.numerics.nonfinite import NonFiniteOp
from tfamp.runtime.plain import plain_calls, plain_function


def locate_keras_nonfinite(model, x, y=None, sample_weight=None, *,
                           config: AmpConfig | None = None,
                           loss_scale: float = 1.0, strategy=None) -> NonFiniteOp | None:
    """The first inf/nan op of a Keras model's training step on one batch.

    Computes the loss (times `loss_scale`) and its gradients in the graph tfamp
    would run, applies nothing, and restores the model's non-trainable and
    metric variables, so weights, optimizer state and loss scale are unchanged.

    Args:
      model: a compiled tf_keras or Keras 3 (TensorFlow backend) model.
      x, y, sample_weight: one batch.
      config: the rewrite settings (the model's ``tfamp.enable`` config if None).
      loss_scale: the loss scale to run the step at.
      strategy: the model's tf.distribute strategy (the step runs per replica).
    """
    if config is None:
        state = getattr(model, "_tfamp_state", None)
        config = state.config if state is not None else AmpConfig()
    with keras_step_locator(model, x, y, sample_weight, loss_scale=loss_scale,
                            strategy=strategy) as locate:
        return locate(config)


@contextlib.contextmanager
def keras_step_locator(model, x, y=None, sample_weight=None, *, loss_scale: float = 1.0,
                       strategy=None):
    """``locate(config)`` for one batch of a Keras model's step, traced once.

    Yields a function that answers like ``locate_keras_nonfinite`` for any
    AmpConfig; the step is traced once for all of them (only the rewrite and the
    runs repeat). The model's non-trainable and metric variables are restored
    after each answer. Under a tf.distribute `strategy` the loss and gradients
    are computed the way the step computes them: once per replica, in a replica
    context, each replica on its share of the batch (the graph then holds every
    local replica's copy, and the first inf/nan of any of them is found).

    A model class with a ``train_step`` of its own (SimCLR's contrastive step, a
    GAN's) is located in that step (``own_step_gradients``), at loss scale 1,
    whether or not it was compiled with a loss: ``compute_loss`` need not be
    what it differentiates.

    Example:
      >>> with keras_step_locator(model, x, y) as locate:
      ...     first, second = locate(AmpConfig()), locate(AmpConfig(keep_fp32=["head/"]))
    """
    variables = model.trainable_variables
    flavour = flavour_of(model)
    state = getattr(model, "_tfamp_state", None)
    own_step = flavour.own_train_step(state.cls if state is not None else type(model))
    pattern = call_scopes.pattern_for(model)  # (a finding's keep_fp32: every call of it)
    # A step XLA compiles (Keras's jit_compile) is rewritten with XLA's placement; the
    # locator's own trace is not compiled, so it asks for that placement by name.
    compiled = getattr(model, "jit_compile", False) is True

    def loss_and_grads(x, y, sample_weight, scale, *, own):
        x, y, sample_weight = replicas.replica_rows((x, y, sample_weight))
        if own:
            return own_step_gradients(model, own_step, flavour.pack_batch(x, y, sample_weight))
        # The whole step is rewritten below: the model's call must not be on its own.
        with tf.GradientTape() as tape, plain_calls():
            y_pred = model(x, training=True)
            loss = model.compute_loss(x, y, y_pred, sample_weight)
            scaled = loss * tf.cast(scale, loss.dtype)
        # Scaled here, at `loss_scale`: under TFAMP_ENABLE the tape must not scale it
        # again with the process's custom-loop scale.
        scale_update.mark_scaled(scaled)
        grads = tape.gradient(scaled, variables)
        return loss, [g for g in grads if g is not None]

    def trace(own: bool):
        def every_replica(x, y, sample_weight, scale):
            return replicas.run_per_replica(
                strategy, lambda *args: loss_and_grads(*args, own=own),
                x, y, sample_weight, scale)
        return plain_function(every_replica).get_concrete_function(
            x, y, sample_weight, scale)

    saved = [(c, c.numpy()) for v in state_variables(model)
             for c in replicas.local_components(v)]
    metrics_before = {id(m) for m in model.metrics}

    def restore():
        for component, value in saved:
            component.assign(value)
        for metric in model.metrics:
            if id(metric) not in metrics_before:
                metric.reset_state()

    try:
        concrete = None
        if own_step is not None:
            scale = tf.constant(1.0, tf.float32)  # (probe mode: every loss unscaled)
            try:
                concrete = trace(own=True)
                loss_scale = 1.0
            except NoLossDifferentiated:  # (gradients taken some other way)
                if not flavour.has_loss(model):
                    raise
            if concrete is not None:  # (its own metrics, a random generator's state, ...)
                known = {id(v) for v in state_variables(model)}
                saved += [(c, c.numpy()) for v in assigned_variables(concrete)
                          if id(v) not in known for c in replicas.local_components(v)]
        if concrete is None:
            scale = tf.constant(float(loss_scale), tf.float32)
            concrete = trace(own=False)

        def locate(config: AmpConfig) -> NonFiniteOp | None:
            if config.runtime == "auto" and compiled:  # (the step's placement, not the
                config = config.replace(runtime="xla")  # locator's uncompiled trace's)
            try:
                return nonfinite.locate_nonfinite(concrete, (x, y, sample_weight, scale), config,
                                                  loss_scale=loss_scale, scope_pattern=pattern)
            finally:
                restore()

        yield locate
    finally:
        restore()


@contextlib.contextmanager
def step_locator(step, args: tuple, kwargs: dict, *, scope_pattern=None):
    """``locate(config)`` for one batch of a custom loop's training step, traced once.

    The step (a Python function that trains on one batch: its tapes and optimizer
    updates, as ``TFAMP_ENABLE`` rewrites it whole) is traced in probe mode
    (``step_scope.probe_mode``): every tape's float loss differentiated unscaled,
    every optimizer update skipped; the variables the trace still writes (a
    BatchNorm's statistics, a metric, a random generator's state) are restored
    after each answer. Its arguments' leaves must be arrays, tensors or variables
    (a variable is bound to its handle; a distributed batch's are its replicas'
    tensors; the step then calls
    ``strategy.run`` itself, and every replica's copy is checked). `scope_pattern`:
    a layer scope's keep_fp32 pattern (``call_scopes.pattern_for``; default: the
    scope itself).

    Raises:
      NoLossDifferentiated: the step differentiated no float loss with a tape.

    Example:
      >>> with step_locator(train_step.python_function, (x, y), {}) as locate:
      ...     found = locate(AmpConfig())
    """
    tape_hooks.install()  # (the probe's tape and optimizer hooks; once per process)

    def gradients(args, kwargs):
        recorder = Recorder()
        with probe_mode(recorder), plain_calls():
            step(*args, **kwargs)
        _, weights = recorder.in_graph(tf.compat.v1.get_default_graph())
        if not weights:
            raise NoLossDifferentiated(
                "the step differentiated no float loss with a GradientTape: nothing to locate")
        return [g for _, g in weights]

    concrete = plain_function(gradients).get_concrete_function(args, kwargs)
    written = tuple({id(v): v for v in assigned_variables(concrete)}.values())
    saved = [(c, c.numpy()) for v in written for c in replicas.local_components(v)]

    def restore():
        for component, value in saved:
            component.assign(value)

    def locate(config: AmpConfig) -> NonFiniteOp | None:
        try:
            return nonfinite.locate_nonfinite(concrete, (args, kwargs), config, loss_scale=1.0,
                                              scope_pattern=scope_pattern)
        finally:
            restore()

    # What the step writes besides its updates (a BatchNorm's moving statistics, ...):
    # skipped steps may have filled them with inf/nan (``fallback.reset_moving_statistics``).
    locate.written = written
    try:
        yield locate
    finally:
        restore()


def own_step_gradients(model, train_step, batch):
    """(0, the weight gradients) of a model's own ``train_step`` on `batch`, traced in
    probe mode (``step_scope.probe_mode``): every tape's float loss differentiated
    unscaled, every optimizer update skipped. A step of two optimizers (a GAN's, a
    contrastive and a probe one) gives both updates' gradients."""
    tape_hooks.install()  # (the probe's tape and optimizer hooks; once per process)
    recorder = Recorder()
    with probe_mode(recorder), plain_calls():
        train_step(model, batch)
    _, weights = recorder.in_graph(tf.compat.v1.get_default_graph())
    if not weights:
        raise NoLossDifferentiated(
            f"model {model.name!r}'s train_step differentiated no float loss with a "
            f"GradientTape: nothing to locate")
    return tf.zeros([]), [g for _, g in weights]


def diagnose_keras_model(model) -> str | None:
    """For the stuck-at-floor warning: localise on the batch tfamp kept.

    Uses the batch ``tfamp.enable``'s hooks kept (fit's first, or the running
    ``train_on_batch`` call's), the model's tfamp config
    and the optimizer's current loss scale. Returns a sentence, or None when no
    batch is known.
    """
    from tfamp.keras.range_probe import current_loss_scale, unpack_batch

    source = getattr(model, "_tfamp_fit_batch", None)
    batch = source() if source is not None else None
    if batch is None:
        return None
    x, y, sample_weight = unpack_batch(batch)
    scale = current_loss_scale(model) or 1.0
    found = locate_keras_nonfinite(model, x, y, sample_weight, loss_scale=scale,
                                   strategy=flavour_of(model).distribute_strategy(model))
    if found is None:
        return (f"re-running the batch tfamp kept (fit's first, or this train_on_batch "
                f"call's) at loss scale {scale:g} gave no inf/nan, so the failing "
                f"batches differ (check the data).")
    return found.describe()
