"""The GradientTape and optimizer patches that scale an enabled model's losses.

Installed once per process, the first time an enabled model needs them (its
train step is traced, or it is called in the user's own tf.function), and
inert unless a step scope, a rewritten model call or a pending scaled step is
there (``step_scope.py``):

* ``GradientTape.gradient`` of a float loss (``scale_update.is_loss_target``)
  is seeded with the owner's scale and unscaled in float32, and leaves one
  pending scaled step for this trace and thread. The owner is the enabled
  model's in its train step (``StepScope``), else the one of the enabled model
  whose rewritten call the loss depends on (a custom loop). During the
  start-scale probe the tape records instead (``step_scope.current_probe``).
* The tf_keras ``apply_gradients`` (its legacy optimizers' too) and Keras 3
  ``apply`` of any optimizer that is not tfamp's own: the next update after a
  pending scaled step checks finiteness (all-reduced over replicas), skips a
  non-finite step and updates that owner's scale
  (``scale_update.apply_*_if_finite``); tfamp's loss-scale optimizers do so
  themselves. An eager update of gradients a traced function scaled and
  returned (no update in its trace took them) checks them for that owner too
  (``step_scope.returned_owner``).
"""

from __future__ import annotations

import functools
import threading

import tensorflow as tf

from tfamp.keras import scale_update, step_scope
from tfamp.keras.notices import warn_once

_lock = threading.Lock()
_installed = False


def install() -> None:
    """GradientTape.gradient and the optimizers' update, once per process."""
    global _installed
    with _lock:
        if _installed:
            return
        _installed = True
        _patch_tape()
        _patch_tf_keras_optimizer()
        _patch_keras3_optimizer()


def owner_for(target, sources):
    """The scale owner for ``tape.gradient(target, sources)`` here, or None (do not scale)."""
    if (tf.executing_eagerly() or not scale_update.is_loss_target(target, sources)
            or scale_update.is_scaled(target)):
        return None
    scope = step_scope.current_step()
    if scope is not None:
        return scope.owner_for_tape()
    return _custom_loop_owner(target, sources)


def _custom_loop_owner(target, sources):
    """In a custom loop: the owner of the enabled model whose rewritten call the loss
    depends on and whose variables are among the sources."""
    source_ids = step_scope.variable_ids(sources)
    owners, loops = {}, []
    # The nearest models first; where none of theirs is differentiated, the models
    # behind them (a GAN's generator loss, computed by the discriminator: its
    # gradient went unscaled, and with a small loss the generator did not train).
    for through in (False, True):
        for loop in step_scope.loops_reached(target, through=through):
            model = loop.model_ref()
            if model is None or not (
                    step_scope.variable_ids(model.trainable_variables) & source_ids):
                continue
            owner = loop.scale_owner()
            if owner is not None:
                owners[id(owner)] = owner
                loops.append(loop)
        if owners:
            break
    if len(owners) > 1:
        warn_once("owners", "tfamp: one loss depends on enabled models with different "
                  "loss-scale optimizers and is differentiated for both; tfamp cannot "
                  "scale it with two scales, so these gradients are not loss-scaled. "
                  "Compute one loss per model (per optimizer).")
        return None
    for loop in loops:
        loop.note_start_scale()
    return next(iter(owners.values()), None)


# tfamp's own graph code: AutoGraph (converting the user's step) must leave it as written.
@tf.autograph.experimental.do_not_convert
def _scaled_gradient(original, tape, target, sources, owner, kwargs):
    with scale_update.loss_scale_ops():
        scale = tf.cast(owner.scale_tensor(), tf.float32)
    grads = _differentiate(original, tape, target, sources,
                           scale_update.seed(target, scale), kwargs)
    step_scope.push_pending(owner, sources)
    return tf.nest.map_structure(lambda g: scale_update.unscale(g, scale), grads)


def _differentiate(original, tape, target, sources, seed, kwargs):
    """``original(tape, target, sources, seed)``; recorded for the start-scale probe
    when the train step being traced asks (its first trace: ``StepScope.recorder``)."""
    scope = step_scope.current_step()
    recorder = getattr(scope, "recorder", None) if scope is not None else None
    if recorder is None:
        return original(tape, target, sources, seed, **kwargs)
    return recorder.record(original, tape, target, sources, seed, kwargs)


def _patch_tape() -> None:
    original = tf.GradientTape.gradient

    @functools.wraps(original)
    def gradient(self, target, sources, output_gradients=None, **kwargs):
        probe = step_scope.current_probe()
        if probe is not None:  # the start-scale probe: unscaled, recorded
            return probe.gradient(original, self, target, sources, output_gradients, kwargs)
        if output_gradients is None:
            owner = owner_for(target, sources)
            if owner is not None:
                return _scaled_gradient(original, self, target, sources, owner, kwargs)
            if _records_losses(target, sources):  # scaled by a loss-scale optimizer
                seed = tf.nest.map_structure(tf.ones_like, target)  # the tape's own seed
                return _differentiate(original, self, target, sources, seed, kwargs)
        return original(self, target, sources, output_gradients, **kwargs)

    tf.GradientTape.gradient = gradient


def _records_losses(target, sources) -> bool:
    """A train step being traced records its losses (for the probe), and this is one."""
    scope = step_scope.current_step()
    return (scope is not None and getattr(scope, "recorder", None) is not None
            and not tf.executing_eagerly() and scale_update.is_loss_target(target, sources))


def is_tfamp_optimizer(optimizer) -> bool:
    """tfamp's own loss-scale optimizer (either Keras): it checks its updates itself."""
    module = type(optimizer).__module__
    return module.startswith("tfamp.") and "LossScaleOptimizer" in type(optimizer).__name__


def _update(owner, flags, *, count_skipped: bool = True) -> None:
    owner.update_from_flags(flags, count_skipped=count_skipped)


def _patch_tf_keras_optimizer() -> None:
    try:
        import tf_keras
    except ImportError:
        return
    # Its optimizers and its legacy ones (keras.optimizers.legacy.*): same contract.
    for optimizer_class in (tf_keras.optimizers.Optimizer, tf_keras.optimizers.legacy.Optimizer):
        optimizer_class.apply_gradients = _tf_keras_apply_gradients(
            optimizer_class.apply_gradients)


def _tf_keras_apply_gradients(original):
    @functools.wraps(original)
    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        if step_scope.current_probe() is not None:
            return step_scope.probe_apply_result(self)
        if is_tfamp_optimizer(self):
            return original(self, grads_and_vars, *args, **kwargs)
        owner = step_scope.take_pending()
        if not step_scope.is_inner_optimizer(self):
            step_scope.note_update(owner)
        if owner is None and tf.executing_eagerly():
            grads_and_vars = list(grads_and_vars)
            owner = step_scope.returned_owner([v for _, v in grads_and_vars])
        if owner is None:
            return original(self, grads_and_vars, *args, **kwargs)
        return scale_update.apply_gradients_if_finite(
            self, original, grads_and_vars, args, kwargs,
            functools.partial(_update, owner), skipped_steps=owner.skipped_steps)

    return apply_gradients


def _patch_keras3_optimizer() -> None:
    from tfamp.keras.flavour import keras3_module

    keras = keras3_module()
    if keras is None:
        return
    optimizer_class = keras.optimizers.Optimizer
    original = optimizer_class.apply

    @functools.wraps(original)
    def apply(self, grads, trainable_variables=None):
        if step_scope.current_probe() is not None:
            return None  # the start-scale probe applies nothing
        if is_tfamp_optimizer(self):
            return original(self, grads, trainable_variables)
        owner = step_scope.take_pending()
        if not step_scope.is_inner_optimizer(self):
            step_scope.note_update(owner)
        if owner is None and tf.executing_eagerly():
            owner = step_scope.returned_owner(
                getattr(self, "_trainable_variables", ()) if trainable_variables is None
                else trainable_variables)
        if owner is None:
            return original(self, grads, trainable_variables)
        scale_update.apply_keras3_if_finite(self, original, grads, trainable_variables,
                                            functools.partial(_update, owner),
                                            skipped_steps=owner.skipped_steps)
        return None

    optimizer_class.apply = apply
