"""tfamp's loss-scale optimizer for Keras 3 (``import keras`` / ``tf.keras``).

Same algorithm as ``tfamp.keras.optimizer_tf_keras`` (tf_keras)::

    scale = initial_scale                      # 2**15
    each step:
        grads = grad(loss * scale) / scale     # unscaled in float32
        flags = [all(isfinite(g)) for g in grads], all-reduced over replicas
        if all flags:
            apply grads; good_steps += 1
            if dynamic and good_steps == growth_interval:  # 2000
                scale *= 2; good_steps = 0
        else:                                  # skip: weights and slots untouched
            skipped_steps += 1; good_steps = 0
            if dynamic: scale = max(scale / 2, min_scale)

``LossScaleOptimizer`` subclasses Keras 3's own ``keras.optimizers.
LossScaleOptimizer`` (its ``scale_loss``, ``step_counter`` / ``dynamic_scale``
variables, learning-rate and ``iterations`` forwarding, config keys) and adds
what Keras 3 lacks: a fixed scale (Keras 3 is dynamic only), a floor other than
"none" (Keras 3 halves without limit), a skipped-step counter, the names of the
first non-finite gradients for the stuck-at-floor warning, a finiteness
decision all-reduced over replicas (Keras 3 takes replica 0's flag when the
strategy needs ``merge_call``, e.g. MirroredStrategy: an overflow on another
replica was applied), and the loss-scaling protocol below.

A skipped step leaves every weight and every optimizer variable untouched,
``iterations`` included (Keras 3's own choice, kept: the inner optimizer is not
called at all).

**Protocol: loss scaling happens exactly once.** Two places may scale:
``scale_loss`` (Keras's train step calls it) and a gradient-tape hook (tfamp's
``TFAMP_ENABLE`` custom-loop patch, or the hook an enabled model's own
``train_step`` runs under). The rules:

* ``scale_loss`` marks the tensor it returns (attribute ``_tfamp_scaled_loss``)
  and counts one pending scaled loss for this optimizer in this trace (graph)
  and thread (= replica);
* a tape hook never scales a marked tensor (it is already scaled);
* ``apply`` divides the gradients by the scale only if a scaled loss is
  pending (and consumes it); otherwise the gradients are already true-size
  (unscaled by a tape hook, or never scaled) and only the finiteness check
  and the scale update run.

Saving: the optimizer's own variable group holds exactly the inner
optimizer's variables (so a process without tfamp restores e.g. Adam's state
from a tfamp file), and the scale state goes to a child group
``tfamp_loss_scale``. A file written by Keras's own LossScaleOptimizer loads
too.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import keras
import tensorflow as tf
from keras.src.saving.keras_saveable import KerasSaveable
from keras.src.utils import tracking

from tfamp.keras import step_scope
from tfamp.keras.scale_state import (
    DEFAULT_GROWTH_INTERVAL,
    DEFAULT_INITIAL_SCALE,
    DEFAULT_MIN_SCALE,
    RECORD_LENGTH,
    STUCK_PATIENCE,
    scale_has_run,
    validate_settings,
    warn_stuck,
)
from tfamp.keras.scale_update import (
    BAD_NAMES_KEPT,
    apply_if_finite,
    loss_scale_ops,
    unscale,
    update_scale,
)
from tfamp.keras.step_scope import INNER_MARK

# -- the optimizer ---------------------------------------------------------------

class _ScaleStateSaveable(KerasSaveable):
    """The child group ``tfamp_loss_scale`` of a saved tfamp optimizer."""

    def __init__(self, variables_fn):
        self._variables_fn = variables_fn

    def _obj_type(self):
        # Keras's saver accepts a fixed set of kinds; a plain container of
        # variables walks like an "Operation" (no child attributes to skip).
        return "Operation"

    def save_own_variables(self, store):
        for variable in self._variables_fn():
            store[_short_name(variable)] = variable.numpy()

    def load_own_variables(self, store):
        for variable in self._variables_fn():
            key = _short_name(variable)
            if key in store.keys():
                variable.assign(store[key])


def _short_name(variable) -> str:
    return variable.path.rsplit("/", 1)[-1]


@keras.saving.register_keras_serializable(package="tfamp")
class LossScaleOptimizer(keras.optimizers.LossScaleOptimizer):
    """Wraps a Keras 3 optimizer with tfamp's loss scaling (see the module docstring).

    Args:
      inner_optimizer: a Keras 3 optimizer (e.g. ``keras.optimizers.Adam()``).
      loss_scale: "dynamic" (default) or a positive number for a fixed scale.
      initial_scale: the starting dynamic scale (2**15).
      growth_interval: good steps before the dynamic scale doubles (2000).
      min_scale: the floor of the dynamic scale (1).
      name: the optimizer's name.

    Example:
      >>> opt = LossScaleOptimizer(keras.optimizers.Adam(), growth_interval=100)
      >>> model.compile(optimizer=opt, loss="mse")
    """

    def __init__(self, inner_optimizer, loss_scale="dynamic", *,
                 initial_scale: float = DEFAULT_INITIAL_SCALE,
                 growth_interval: int = DEFAULT_GROWTH_INTERVAL,
                 min_scale: float = DEFAULT_MIN_SCALE, name=None,
                 dynamic_growth_steps=None, **kwargs):
        if dynamic_growth_steps is not None:  # Keras's own config key
            growth_interval = dynamic_growth_steps
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise TypeError(
                f"tfamp's Keras 3 LossScaleOptimizer wraps a Keras 3 optimizer "
                f"(keras.optimizers.*), received {type(inner_optimizer).__name__}; pass "
                f"e.g. keras.optimizers.Adam().")
        dynamic, start = validate_settings(loss_scale, initial_scale, growth_interval,
                                           min_scale)
        super().__init__(inner_optimizer, initial_scale=start,
                         dynamic_growth_steps=int(growth_interval), name=name, **kwargs)
        self.loss_scale_mode = "dynamic" if dynamic else start
        self.is_dynamic = dynamic
        self.min_scale = float(min_scale)
        self._variable_names: list[str] = []
        self._warned_stuck = False
        setattr(inner_optimizer, INNER_MARK, True)
        self.tfamp_loss_scale = _ScaleStateSaveable(lambda: list(self._variables))

    @tracking.no_automatic_dependency_tracking
    def build(self, var_list):
        if self.built:
            return
        inner = self.inner_optimizer
        if var_list or inner.built:
            super().build(var_list)
        else:
            # Nothing to train now (a GAN's discriminator, frozen, compiled with the
            # optimizer its combined model shares): the inner optimizer is left to
            # build at its first apply, as Keras builds it. Built with no variables,
            # it would refuse every variable it is given later.
            object.__setattr__(inner, "build", lambda variables: None)
            try:
                super().build(var_list)
            finally:
                del inner.__dict__["build"]
        zeros = keras.initializers.Zeros()
        self.skipped_steps = self.add_variable(
            shape=(), dtype="int64", initializer=zeros, aggregation="none",
            name="skipped_steps")
        self.floor_skips = self.add_variable(
            shape=(), dtype="int64", initializer=zeros, aggregation="none",
            name="floor_skips")
        self.first_nonfinite = self.add_variable(
            shape=(BAD_NAMES_KEPT,), dtype="int32",
            initializer=keras.initializers.Constant(-1), aggregation="none",
            name="first_nonfinite")
        # The layers moved to float32 after a float16 overflow (keras/fallback.py).
        self.fallback_fp32 = self.add_variable(
            shape=(RECORD_LENGTH,), dtype="int32", initializer=zeros, aggregation="none",
            name="fallback_fp32")

    # -- what users and logs read --------------------------------------------

    @property
    def loss_scale(self):
        """The current scale (a variable once built)."""
        return self.dynamic_scale if self.built else tf.constant(self.initial_scale)

    def scale_loss(self, loss):
        if step_scope.current_probe() is not None:  # the probe measures true sizes
            return loss
        with loss_scale_ops():
            scaled = super().scale_loss(loss)
        step_scope.mark_scaled_loss(self, scaled)
        return scaled

    # -- applying ------------------------------------------------------------

    def apply(self, grads, trainable_variables=None):
        if step_scope.current_probe() is not None:
            return  # the start-scale probe applies nothing
        # A tape tfamp scaled (custom loop or train step): this optimizer checks it itself.
        pending = step_scope.take_pending()
        grads = list(grads)
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        if tf.distribute.has_strategy() and tf.distribute.in_cross_replica_context():
            raise ValueError("apply() must be called in a replica context.")
        variables = (list(trainable_variables) if trainable_variables is not None
                     else list(self._trainable_variables))
        scaled_here = step_scope.consume_scaled_loss(self)
        update, skipped_steps = self._update_state, self.skipped_steps
        process = (step_scope.take_process_owner(self)
                   if pending is None and not scaled_here else None)
        if process is not None:  # a TFAMP_ENABLE custom loop's tape scaled them
            pending = process
            update, skipped_steps = process.update_from_flags, process.skipped_steps
        step_scope.note_update(pending, scaled=pending is not None or scaled_here)
        if scaled_here:
            scale = self.dynamic_scale
            grads = [g if g is None or self._overwrite_variable_with_gradient(v)
                     else unscale(g, scale) for g, v in zip(grads, variables, strict=True)]
        self._variable_names = [v.path for g, v in zip(grads, variables, strict=True)
                                if g is not None]
        apply_if_finite(grads, lambda g: self.inner_optimizer.apply(g, trainable_variables),
                        update, skipped_steps=skipped_steps)

    # -- what every scale owner answers (scale_state.py) ---------------------

    def scale_tensor(self) -> tf.Tensor:
        """The scale (its initial one until built: the variable exists only then)."""
        if not self.built:
            return tf.constant(float(self.initial_scale), tf.float32)
        return tf.cast(tf.convert_to_tensor(self.dynamic_scale), tf.float32)

    def update_from_flags(self, flags, *, count_skipped: bool = True):
        self._update_state(flags, count_skipped=count_skipped)

    def set_scale(self, value: float) -> None:
        if not self.built:  # build makes the scale variable from initial_scale
            self.initial_scale = float(value)
            return
        self.dynamic_scale.assign(value)

    def has_stepped(self) -> bool:
        return self.built and scale_has_run(self.dynamic_scale, float(self.initial_scale),
                                            self.step_counter, self.skipped_steps)

    def ensure_built(self, variables) -> None:
        """Builds it (outside any trace) if it is not: its scale is a variable only then."""
        if self.built:
            return
        with tf.init_scope():
            self.build(list(variables))

    def _update_state(self, flags, *, count_skipped: bool = True):
        update_scale(flags, scale=self.dynamic_scale, good_steps=self.step_counter,
                     skipped_steps=self.skipped_steps if count_skipped else None,
                     floor_skips=self.floor_skips,
                     first_nonfinite=self.first_nonfinite, dynamic=self.is_dynamic,
                     growth_interval=int(self.dynamic_growth_steps),
                     min_scale=self.min_scale)

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        raise NotImplementedError(
            "tfamp's LossScaleOptimizer supports the TensorFlow backend's stateful "
            "apply only (model.fit, optimizer.apply / apply_gradients).")

    def check_stuck(self, diagnose: Callable[[], str | None] | None = None) -> bool:
        """Warns once if steps keep being skipped with the scale at its floor.

        Args:
          diagnose: called once, when warning, to name the first op that made
            an inf/nan (``tfamp.numerics.nonfinite``); its answer goes into the
            warning. It must not change any state.

        Returns:
          True if the warning was issued now.
        """
        if (self._warned_stuck or not self.built
                or int(self.floor_skips.numpy()) < STUCK_PATIENCE):
            return False
        self._warned_stuck = True
        indices = [int(i) for i in self.first_nonfinite.numpy() if i >= 0]
        names = [self._variable_names[i] for i in indices if i < len(self._variable_names)]
        warn_stuck(self.min_scale, int(self.skipped_steps.numpy()), names, diagnose)
        return True

    # -- saving --------------------------------------------------------------

    def save_own_variables(self, store):
        # The inner optimizer's layout, so a process without tfamp that
        # compiled with the inner optimizer restores its state from this group.
        for i, variable in enumerate(self.inner_optimizer.variables):
            store[str(i)] = variable.numpy()

    def load_own_variables(self, store):
        inner = self.inner_optimizer.variables
        count = len(store.keys())
        if count == len(inner):  # tfamp's layout, or a file saved without tfamp
            for i, variable in enumerate(inner):
                variable.assign(store[str(i)])
            self._restored_inner()
            return
        keras_layout = self._variables[:4] + inner  # Keras's own LossScaleOptimizer
        if count == len(keras_layout) and self.built:
            for i, variable in enumerate(keras_layout):
                variable.assign(store[str(i)])
            return
        warnings.warn(
            f"tfamp: skipping variable loading for optimizer {self.name!r}: the file has "
            f"{count} variables, expected {len(inner)} (the inner optimizer's) or "
            f"{len(keras_layout)} (Keras's LossScaleOptimizer's).", stacklevel=2)

    def _restored_inner(self) -> None:
        """The inner optimizer's state has just been restored from this group.

        Keras's loader visits the inner optimizer next, at
        ``optimizer/inner_optimizer``. A file written without tfamp (a float32
        checkpoint resumed under ``TFAMP_ENABLE``) has no such group, and Keras's
        ``Optimizer.load_own_variables`` warned "Skipping variable loading for
        optimizer 'adam', because it has 6 variables whereas the saved optimizer has
        0 variables" about the state restored here. So the inner's next load from an
        empty group does nothing, silently, once; any other load is Keras's own.
        """
        inner = self.inner_optimizer
        own = type(inner).load_own_variables

        def load_own_variables(store):
            inner.__dict__.pop("load_own_variables", None)  # (once: the class's again)
            if len(store.keys()) or not inner.variables:
                own(inner, store)
        inner.__dict__["load_own_variables"] = load_own_variables

    def get_config(self):
        config = super().get_config()
        config["loss_scale"] = self.loss_scale_mode
        config["min_scale"] = self.min_scale
        config["growth_interval"] = config.pop("dynamic_growth_steps")
        return config
