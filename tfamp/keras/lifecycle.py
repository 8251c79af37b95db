"""One enabled model's mixed precision: its settings, its state, and every point where tfamp acts.

``tfamp.enable(model)`` makes one ``ModelPrecision`` for the model (kept as
``model._tfamp_state``); the model's per-instance hooks call its points. The
points, in the order they come, with what happens (tf_keras and Keras 3 alike;
where the two differ, ``flavour.py`` answers):

================================  ==============================================
point                             what happens
================================  ==============================================
``enable`` / ``disable``          checks (backend, no other mixed precision),
                                  the model's method hooks, its optimizer
                                  wrapped in tfamp's loss-scale optimizer
``after_compile``                 the new optimizer wrapped (in the model's
                                  strategy scope)
``make_function``                 Keras builds a train / test / predict
                                  function: its step is rewritten; the train
                                  function calls ``after_train_call``
``before_fit``                    fit's first batch kept; the range monitor;
                                  the fit callback (re-applies a restored
                                  fallback record before the first step, marks
                                  each epoch's start); the start scale
                                  (``start_scale.py``: the probe, per replica,
                                  agreed by every worker; now, or at the step's
                                  first trace)
``before_first_train_call``       one device, data other than arrays: the
                                  batches fit's first train call takes from
                                  fit's own iterator, handed back to that call
                                  (``FirstTrainCall``); the first to the probe
``_on_train_trace``               the step's first trace and its rewrite,
                                  before it runs: the probe reads the traced
                                  graph and checks its scale on the rewritten
                                  one (the 16-bit step)
``train_step`` (at trace time)    around each step: every loss scaled once by
                                  the model's scale (``step_scope.py``,
                                  ``tape.py``), a skipped step's inf/nan left out
                                  of the metrics (``step_metrics.py``), the logs'
                                  ``loss_scale`` / ``skipped_steps``
``after_train_call``              the float32 fallback (``fallback.py``: when
                                  to look, decide per replica, agree, apply;
                                  on fit's first batch, or on a
                                  ``train_on_batch`` call's own); else the
                                  stuck-at-floor warning
``epoch_results``                 the epoch's metrics with tfamp's keys set
                                  aside; NaN for a metric nothing finite reached
``state_dict`` / ``load_state_dict``  the scale, skipped steps and moved layers as
                                  plain values (checkpoints carry them in the
                                  optimizer's variables)
================================  ==============================================

The strategy context is this module's business: the probes run per replica
through ``replicas.py``, and every decision that must be the same on every
worker is agreed there before it is applied.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import threading
import weakref

import tensorflow as tf

from tfamp.config import AmpConfig
from tfamp.keras import fallback, replicas, start_scale, step_metrics, step_scope, tape
from tfamp.keras.custom_loop import ModelLoop, call_hook, part_call_hook, unscaled_message
from tfamp.keras.flavour import flavour_of, layers_of
from tfamp.keras.notices import warn
from tfamp.keras.scale_state import ScaleState, current_scale, scale_values, step_log_values
from tfamp.runtime.runner import RewrittenFunction

log = logging.getLogger("tfamp")

# Keys tfamp adds to the logs of an enabled model's train step.
LOG_KEYS = ("loss_scale", "skipped_steps")
# The step functions Keras builds lazily and caches on the model.
FUNCTION_ATTRS = ("train_function", "test_function", "predict_function")


@dataclasses.dataclass(frozen=True)
class Settings:
    """What ``tfamp.enable`` was asked for (validated by ``activation.enable``)."""

    config: AmpConfig
    loss_scale: object  # "dynamic", a number, or None
    initial_scale: float
    growth_interval: int
    min_scale: float
    check: bool = False
    ranges: object = None  # None, True, or an output directory for RangeMonitor
    auto_start: bool = False  # initial_scale="auto": the first fit probes the gradients


# On a tf_keras optimizer: (weakref to tfamp's wrapper around it, its settings).
_WRAPPER = "_tfamp_loss_scale_optimizer"


def _optimizer_classes(flavour) -> tuple[type, ...]:
    """tfamp's loss-scale optimizer classes for the model's Keras."""
    if flavour.is_keras3:
        from tfamp.keras.optimizer_keras3 import LossScaleOptimizer
        return (LossScaleOptimizer,)
    from tfamp.keras.optimizer_tf_keras import LegacyLossScaleOptimizer, LossScaleOptimizer
    return (LossScaleOptimizer, LegacyLossScaleOptimizer)


def _optimizer_class_for(flavour, optimizer) -> type:
    """tfamp's loss-scale optimizer class that wraps `optimizer`."""
    if flavour.is_keras3:
        from tfamp.keras.optimizer_keras3 import LossScaleOptimizer
        return LossScaleOptimizer
    from tfamp.keras.optimizer_tf_keras import loss_scale_optimizer_class
    return loss_scale_optimizer_class(optimizer)


class ModelPrecision:
    """An enabled model's mixed precision (see the module docstring for the points).

    Attributes:
      settings: what enable was asked for.
      config: the AmpConfig the model's functions run with now (the float32
        fallback adds to its ``keep_fp32``).
      start_scale: the ``start_scale.StartScale`` once probed; False when not.
      fallback: the ``fallback.FallbackState``.
    """

    def __init__(self, model, settings: Settings):
        self.model = model
        self.cls = type(model)
        self.flavour = flavour_of(model)
        self.settings = settings
        self.config = settings.config
        self.start_scale = None
        self.fallback = fallback.FallbackState()
        self.step_owner = None  # the scale owner the train step applied, once traced
        self.nonfinite_skips = None  # step_metrics.counter_variable, before a train fn
        self.epoch_skipped_at = None  # skipped steps at the training epoch's start
        self.epoch_calls = 0  # train function calls this epoch
        self.warned_unscaled = False
        self._own_state = None  # a ScaleState when the model has no tfamp optimizer
        self._seen_nonfinite = None  # the agreed nonfinite counts at the last look
        self._pending_probe = None  # fit's first batch, for the probe in the step's trace
        self.probe_first_step = False  # the probe waits for fit's first train call
        self._fit_data = None  # (args, kwargs) of that fit, while the probe waits
        self._in_fit = False  # inside the model's fit hook (its probe is set up there)
        self._record_read_on_batch = False  # the first train_on_batch read the record
        self._recorders: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.loop = ModelLoop(model, self.cls.call, lambda: self.config, settings.check,
                              self.built_scale_owner)

    # -- enable / disable ---------------------------------------------------------

    def enable(self) -> None:
        model = self.model
        self.flavour.check_backend()
        self._check_no_other_mixed_precision()
        previous = getattr(model, "_tfamp_state", None)
        if previous is not None:
            previous.disable()
        object.__setattr__(model, "_tfamp_state", self)
        self._install_hooks()
        self.flavour.show_logs_per_step(LOG_KEYS)
        if getattr(model, "optimizer", None) is not None:
            model.optimizer = self._wrapped_optimizer()
        self._reset_functions()

    def disable(self) -> None:
        model = self.model
        for name in model.__dict__.pop("_tfamp_hooks", ()):
            model.__dict__.pop(name, None)
        for part_ref in model.__dict__.pop("_tfamp_parts", ()):
            part = part_ref()
            if part is not None:
                part.__dict__.pop("call", None)
        optimizer = getattr(model, "optimizer", None)
        if isinstance(optimizer, _optimizer_classes(self.flavour)):
            inner = optimizer.inner_optimizer
            inner.__dict__.pop(step_scope.INNER_MARK, None)
            inner.__dict__.pop(_WRAPPER, None)
            if not self.flavour.is_keras3:
                inner._is_wrapped_by_loss_scale_optimizer = False
            model.optimizer = inner
        object.__setattr__(model, "_tfamp_state", None)
        self._reset_functions()

    def _check_no_other_mixed_precision(self) -> None:
        policy = self.flavour.mixed_policy(self.model)
        if policy is not None:
            raise ValueError(
                f"a Keras {policy!r} policy is in force and so is tfamp: they would both "
                f"convert the model. Use one: for tfamp, call "
                f"{self.flavour.set_policy_hint()} before building the model; or keep "
                f"the Keras policy and do not call tfamp.enable.")
        if tf.config.optimizer.get_experimental_options().get("auto_mixed_precision"):
            raise ValueError(
                "TensorFlow's own auto_mixed_precision graph rewrite is on "
                "(tf.config.optimizer.set_experimental_options) and so is tfamp: they would "
                "both convert the graph. Turn TensorFlow's off with "
                "tf.config.optimizer.set_experimental_options({'auto_mixed_precision': "
                "False}), or do not call tfamp.enable.")

    def _install_hooks(self) -> None:
        model, cls = self.model, self.cls

        def compile(*args, **kwargs):  # noqa: A001  (mirrors Model.compile)
            result = cls.compile(model, *args, **kwargs)
            self.after_compile()
            return result

        def fit(*args, **kwargs):
            self._in_fit = True
            try:
                args, kwargs = self.before_fit(args, kwargs)
                return cls.fit(model, *args, **kwargs)
            finally:  # a probe waits for this fit's first step only
                self.probe_first_step, self._pending_probe = False, None
                self._fit_data, self._in_fit = None, False

        def train_on_batch(*args, **kwargs):
            return self.train_on_batch(args, kwargs)

        def maker(attr):
            def make(force=False):
                return self.make_function(attr, force)
            return make

        base_metrics = getattr(cls, self.flavour.metrics_method)
        hooks = {
            "call": call_hook(model, self.loop),
            "compile": compile,
            "fit": fit,
            "train_on_batch": train_on_batch,
            "train_step": self.train_step,
            self.flavour.metrics_method: lambda logs: self.epoch_results(base_metrics, logs),
            "make_train_function": maker("train_function"),
            "make_test_function": maker("test_function"),
            "make_predict_function": maker("predict_function"),
        }
        for name, hook in hooks.items():
            object.__setattr__(model, name, hook)
        object.__setattr__(model, "_tfamp_hooks", tuple(hooks))
        # Its nested models (not enabled themselves) say so when a custom loop calls
        # one alone: that part of the step would run float32 without a word.
        warned = [False]
        parts = [layer for layer in _nested_models(model, self.flavour.model_class)
                 if getattr(layer, "_tfamp_state", None) is None
                 and "call" not in layer.__dict__]
        for part in parts:
            object.__setattr__(part, "call", part_call_hook(part, model.name, warned))
        object.__setattr__(model, "_tfamp_parts", tuple(weakref.ref(p) for p in parts))

    def _reset_functions(self) -> None:
        """Drops the step functions Keras cached, so the next call builds them anew."""
        for attr in FUNCTION_ATTRS:
            if hasattr(self.model, attr):
                object.__setattr__(self.model, attr, None)

    # -- compile ------------------------------------------------------------------

    def after_compile(self) -> None:
        self.model.optimizer = self._wrapped_optimizer()

    def _wrapped_optimizer(self):
        """The model's optimizer in tfamp's loss-scale optimizer (unchanged without scaling).

        Made in the model's tf.distribute scope (as if ``enable`` had been called
        inside ``strategy.scope()``), and, on Keras 3, built now where the optimizer
        is (Keras's loader builds the optimizer it compiles), so that
        ``load_weights`` right after ``enable`` finds every variable to restore.
        An optimizer not built yet is left to build where Keras builds it (its
        first step, BackupAndRestore, the loader): one shared by several models
        (a GAN's) must be built with the variables of the model that first
        trains, not of the first compiled.
        """
        optimizer = self.model.optimizer
        settings = self.settings
        if settings.loss_scale is None or optimizer is None or isinstance(
                optimizer, _optimizer_classes(self.flavour)):
            return optimizer
        if isinstance(optimizer, self.flavour.keras_loss_scale_optimizer):
            raise ValueError(
                "the model's optimizer is already a Keras LossScaleOptimizer; tfamp wraps "
                "the optimizer itself. Compile with the inner optimizer "
                "(optimizer.inner_optimizer), or pass loss_scale=None to tfamp.enable.")
        if not (isinstance(optimizer, self.flavour.optimizer_base)
                or self.flavour.is_legacy_optimizer(optimizer)):
            kind = f"{type(optimizer).__module__}.{type(optimizer).__name__}"
            raise TypeError(
                f"tfamp loss scaling needs a {self.flavour.label} optimizer "
                f"(keras.optimizers.*), the model has {kind}; compile "
                f"with e.g. keras.optimizers.Adam(), or pass loss_scale=None.")
        wanted = (settings.loss_scale, settings.initial_scale, settings.growth_interval,
                  settings.min_scale)
        shared = self._shared_wrapper(optimizer, wanted)
        if shared is not None:
            return shared
        with self.strategy().scope():
            wrapped = _optimizer_class_for(self.flavour, optimizer)(
                optimizer, settings.loss_scale, initial_scale=settings.initial_scale,
                growth_interval=settings.growth_interval, min_scale=settings.min_scale)
            if (self.flavour.is_keras3 and getattr(optimizer, "built", False)
                    and self.model.built and self.model.trainable_variables):
                wrapped.ensure_built(self.model.trainable_variables)
        if not self.flavour.is_keras3:
            object.__setattr__(optimizer, _WRAPPER, (weakref.ref(wrapped), wanted))
        return wrapped

    def _shared_wrapper(self, optimizer, wanted):
        """tfamp's wrapper already around `optimizer` (tf_keras), or None.

        tf_keras wraps an optimizer once: a GAN's discriminator and combined model,
        compiled with one optimizer as Keras 2 scripts do, share one wrapper and so
        one scale (as under Keras's own policy). Its settings must be this model's.
        """
        record = optimizer.__dict__.get(_WRAPPER)
        wrapped = record[0]() if record is not None else None
        if wrapped is None or not getattr(optimizer, "_is_wrapped_by_loss_scale_optimizer",
                                          False):
            return None
        if record[1] != wanted:
            raise ValueError(
                f"model {self.model.name!r} is compiled with an optimizer "
                f"({type(optimizer).__name__}) that another enabled model also uses, with "
                f"other loss-scale settings (loss_scale, initial_scale, growth_interval, "
                f"min_scale): {record[1]} there, {wanted} here. tf_keras wraps an "
                f"optimizer once, so the models share one scale: enable them with the same "
                f"settings, or compile this model with an optimizer of its own.")
        return wrapped

    # -- the scale ------------------------------------------------------------------

    def strategy(self):
        return self.flavour.distribute_strategy(self.model)

    def loss_scale_optimizer(self):
        """The model's tfamp loss-scale optimizer, or None."""
        optimizer = getattr(self.model, "optimizer", None)
        return optimizer if isinstance(optimizer, _optimizer_classes(self.flavour)) else None

    def scale_owner(self):
        """What keeps the model's scale: its loss-scale optimizer, else a scale state
        of its own (None without loss scaling). Not built (see ``built_scale_owner``)."""
        if self.settings.loss_scale is None:
            return None
        optimizer = self.loss_scale_optimizer()
        if optimizer is not None:
            return optimizer
        if self._own_state is None:
            settings = self.settings
            self._own_state = ScaleState.for_setting(
                settings.loss_scale, settings.initial_scale, settings.growth_interval,
                settings.min_scale)
        return self._own_state

    def built_scale_owner(self):
        """``scale_owner`` with its variables made (for a step being traced)."""
        owner = self.scale_owner()
        if owner is not None:
            owner.ensure_built(_trainable_variables_so_far(self.model))
        return owner

    def read_scale(self) -> tuple[float, int] | None:
        """(loss scale, skipped steps) the train step applies, as Python numbers
        (None until a step applied a scale, or when it applies none)."""
        if self.step_owner is None:
            return None
        scale, skipped = scale_values(self.step_owner)
        return float(scale.numpy()), int(skipped.numpy())

    def float16_lists(self):
        """The float16 op lists (the probe's: what stays float32 bounds nothing), or None."""
        return self.config.op_lists if self.config.dtype == "float16" else None

    # -- step functions ---------------------------------------------------------------

    def make_function(self, attr: str, force: bool = False):
        """Keras's ``make_<attr>``, with the step rewritten by the model's settings."""
        if attr == "train_function":
            self._before_train_function()
            current = self.model.__dict__.get(attr)
            if isinstance(current, FirstTrainCall):
                object.__setattr__(self.model, attr, current.function)
        made, rewritten = self.flavour.make_step_function(
            self.model, self.cls, attr, force, self._rewrite)
        if made is not None and not rewritten:
            log.warning("tfamp: %s runs eagerly (run_eagerly=True), so there is no graph "
                        "to rewrite; it stays float32.", attr)
        elif rewritten and attr == "train_function":
            made.set_after_call(self.after_train_call)
            for function in getattr(made, "rewritten", [made]):
                function.set_on_trace(self._on_train_trace)
        if (attr == "train_function" and made is not None and not self._in_fit
                and not self.probe_first_step and self._owner_to_calibrate() is not None):
            # Not fit's hook: train_on_batch, or the class's fit called past the
            # hook (``keras.Model.fit(model, ...)``). The first call's batch is probed.
            self.probe_first_step = True
        if attr == "train_function" and made is not None and self.probe_first_step:
            made = FirstTrainCall(self, made)
            object.__setattr__(self.model, attr, made)
        return made

    def _rewrite(self, function):
        """`function` (a tf.function) rewritten with the model's settings now."""
        if isinstance(function, RewrittenFunction):
            # Built by TFAMP_ENABLE's tf.function: the model's own settings rule
            # (they differ after a float32 fallback).
            return function if function.config is self.config else function.with_config(
                self.config)
        # Under TFAMP_ENABLE, reports also go where the start-up hook keeps them.
        on_report = getattr(tf.function, "_tfamp_on_report", None)
        return RewrittenFunction(function, self.config, check=self.settings.check,
                                 on_report=on_report)

    def _before_train_function(self) -> None:
        """Made outside any trace, in the model's strategy scope: the count of
        skipped steps with inf/nan logs, and a scale state of the model's own."""
        if self.settings.loss_scale is None:
            return
        if self.nonfinite_skips is None:
            self.nonfinite_skips = step_metrics.counter_variable(self.strategy())
        if self.loss_scale_optimizer() is None and self._own_state is None:
            with self.strategy().scope():
                self.scale_owner()

    # -- before the first fit ---------------------------------------------------------

    def before_fit(self, args, kwargs) -> tuple[tuple, dict]:
        """What an enabled model's ``fit`` does first; returns fit's (args, kwargs)."""
        from tfamp.keras import range_monitor

        object.__setattr__(self.model, "_tfamp_fit_batch",
                           range_monitor.fit_batch_source(args, kwargs))
        if self.settings.ranges is not None:
            monitor = range_monitor.monitor_for_fit(self.settings.ranges, args, kwargs)
            args, kwargs = _with_callback(args, kwargs, monitor)
        if self.settings.loss_scale is not None:
            # Last: BackupAndRestore restores in its on_train_begin before it reads.
            args, kwargs = _with_callback(args, kwargs, self._fit_callback())
        self.start_scale_for_fit(args, kwargs, in_step=True)
        return tuple(args), kwargs

    def start_scale_for_fit(self, args, kwargs, *, in_step: bool = False):
        """The start scale from fit's first batch, once (``initial_scale="auto"``).

        Only for a dynamic scale, an owner that has taken no step, and data fit
        can give a batch of without consuming it. With `in_step` (``fit``'s own
        call) the probe waits for the step's first trace and reads that graph
        (``_on_train_trace``: no second trace of the step) where it can; else it
        traces the step now. Failing, whatever the cause, it warns and training
        starts at the default scale: it never stops a fit.

        Returns:
          the StartScale when probed now, else None.
        """
        owner = self._owner_to_calibrate()
        if owner is None:
            return None
        # One device: a Dataset or generator is read through fit's own iterator at
        # its first train call (FirstTrainCall), so fit's data order is untouched.
        through_fit = in_step and not replicas.is_distributed(self.strategy())
        try:
            batch = start_scale.first_batch(self.flavour, args, kwargs,
                                            dataset=not through_fit)
        except Exception as err:  # same as a probe that failed
            return self._probe_failed(owner, err)
        if batch is None and through_fit:
            self.probe_first_step = True
            self._fit_data = (args, kwargs)
            return None
        if batch is None:
            self.start_scale = False
            warn(f"tfamp: model {self.model.name!r}: no start scale from the gradients: "
                 f"fit's data is not arrays, tensors or a tf.data.Dataset, which tfamp can "
                 f"read a batch from under a tf.distribute strategy without consuming it, "
                 f"so dynamic scaling starts at 2^15 and may skip its first steps. Fix: "
                 f"pass arrays or a tf.data.Dataset, or call "
                 f"tfamp.calibrate_loss_scale(model.train_step, batch, model=model) first.")
            return None
        return self._probe_in_trace_or_now(batch, in_step)

    def _probe_in_trace_or_now(self, batch, in_step: bool = True):
        """The probe on `batch`: in the step's first trace where it can (`in_step`:
        fit's own call), else now. Returns the StartScale when probed now."""
        if in_step and self._probe_in_step_possible():
            self._pending_probe = batch
            return None
        return self._probe(batch)

    def before_first_train_call(self, iterator):
        """Fit's first call of its train function (data other than arrays, one
        device): the start-scale probe on the batch that call trains on.

        Takes the elements that call would take from `iterator` (fit's own) and
        returns the one-shot iterator of them the call must use
        (``start_scale.read_ahead``): fit trains on exactly the batches it would
        have, and no second iterator draws state (a reshuffle seed) from the
        user's dataset. The probe reads the step's first trace, made in this
        call, where it can (``_on_train_trace``); else it traces the step now.
        """
        self.probe_first_step = False
        fit_data, self._fit_data = self._fit_data, None
        owner = self._owner_to_calibrate()
        if owner is None:
            return iterator
        if not start_scale.can_read_ahead(iterator):
            if fit_data is not None:
                # A strategy of one replica (MirroredStrategy on one GPU): fit's
                # iterator is a distributed one, which cannot hand a batch back,
                # so a Dataset is read for one element as under several replicas.
                try:
                    batch = start_scale.first_batch(self.flavour, *fit_data, dataset=True)
                except Exception as err:  # same as a probe that failed
                    self._probe_failed(owner, err)
                    return iterator
                if batch is not None:
                    self._probe_in_trace_or_now(batch)
                    return iterator
            self.start_scale = False
            start = self._scale_or_none(owner)
            warn(f"tfamp: model {self.model.name!r}: no start scale from the gradients: "
                 f"training reads its data through a {type(iterator).__name__}, whose batches "
                 f"tfamp cannot hand back to the step after reading one, so dynamic "
                 f"scaling starts at "
                 f"{'its initial scale' if start is None else format(start, 'g')} and may "
                 f"skip its first steps. Fix: pass initial_scale=<number> to tfamp.enable "
                 f"(TFAMP_INITIAL_SCALE), or give the model's own fit arrays or a "
                 f"tf.data.Dataset.")
            return iterator
        try:
            elements, replay = start_scale.read_ahead(
                iterator, self.flavour.steps_per_execution(self.model))
        except Exception as err:  # nothing was handed on: fit reads on as it would
            self._probe_failed(owner, err)
            return iterator
        if not elements:
            return replay
        self._probe_in_trace_or_now(elements[0])
        return replay

    def _owner_to_calibrate(self):
        """The dynamic scale owner a start-scale probe should set, or None."""
        if not self.settings.auto_start or self.start_scale is not None:
            return None
        owner = self.scale_owner()
        if owner is None or not owner.is_dynamic:
            return None
        if _fully_built(self.model) and not self.model.trainable_variables:
            return None  # nothing to train now (a frozen GAN discriminator): no gradient
        return owner

    def _probe_in_step_possible(self) -> bool:
        """The train step is traced into the graph the rewrite sees, with its batch as
        arguments or one iterator read: Keras 3 (not eagerly), tf_keras on one device
        (not jit_compile, whose step is a function nested in it, nor
        steps_per_execution, whose steps are a loop body; under a strategy its
        replicas read their batch inside a conditional)."""
        model = self.model
        if getattr(model, "run_eagerly", False):
            return False
        if self.flavour.is_keras3:
            return True
        steps = getattr(model, "_steps_per_execution", None)
        steps = int(steps.numpy()) if hasattr(steps, "numpy") else 1
        return (not getattr(model, "jit_compile", False) and steps == 1
                and not replicas.is_distributed(self.strategy()))

    def _on_train_trace(self, concrete, rewritten=None) -> None:
        """The train step's first trace and its rewrite (``runner.RewrittenGraph``),
        before the rewrite first runs: the start-scale probe reads the traced graph
        and checks its scale on the rewritten one."""
        batch, self._pending_probe = self._pending_probe, None
        if batch is None:
            return
        recorder = self._recorders.pop(concrete.graph, None)
        with tf.init_scope():  # (Keras 3 traces the step inside its loop's trace)
            self._probe(batch, trace=(concrete, recorder, batch) if recorder else None,
                        rewritten=rewritten)

    def _recorder_for(self, graph):
        """The probe's recorder of this trace (shared by its replicas' threads). Its
        scale owner is asked for after the trace (building it before the step's
        first call would build a Keras 3 optimizer before an unbuilt model's
        variables exist)."""
        with _recorders_lock:
            recorder = self._recorders.get(graph)
            if recorder is None:
                recorder = start_scale.Recorder(self.float16_lists())
                recorder.owner_of = self.built_scale_owner
                self._recorders[graph] = recorder
            return recorder

    def _probe(self, batch, trace=None, *, rewritten=None, again: bool = False):
        """Probes, sets the owner's scale unless it has taken a step, says so
        (`again`: after the float32 fallback, returns what it found and sets
        nothing: ``_probe_after_fallback`` decides)."""
        model = self.model
        owner = self.scale_owner()
        try:
            from tfamp.keras.range_probe import state_variables

            found = start_scale.probe_step(
                lambda data: _traced_here(self.cls.train_step)(model, data), (batch,), {},
                extra_state=state_variables(model), min_scale=owner.min_scale,
                op_lists=self.float16_lists(), strategy=self.strategy(), trace=trace,
                rewritten=rewritten,
                # layers kept float32 by name: the op lists cannot say so, the rewrite can
                rewrite_config=self.config if self.config.keep_fp32 else None,
                # a probe that traces the step again checks its scale on that
                # trace's rewrite
                check_config=self.config,
                headroom_bits=(start_scale.AFTER_FALLBACK_HEADROOM_BITS if again
                               else start_scale.START_HEADROOM_BITS),
                # (after the fallback its six bits were measured as they are)
                extra_bits=0 if again else None)
            owner = self.built_scale_owner()  # the probe may have built the model
            if again:  # the fallback's caller sets it (only ever up)
                return found
            if owner.has_stepped():  # a restored run keeps its scale
                self.start_scale = False
                return None
            owner.set_scale(found.scale)
        except Exception as err:  # training goes on at the default scale; the user is told
            if again:  # the scale it has stays
                log.info("tfamp: model %r: the loss scale stays (the start-scale probe "
                         "with the moved layers float32 failed: %s: %s).", model.name,
                         type(err).__name__, err)
                return None
            return self._probe_failed(owner, err)
        self.start_scale = found
        log.info("%s", found.message())
        return found

    @staticmethod
    def _scale_or_none(owner):
        try:
            return float(current_scale(owner).numpy())
        except Exception:  # a message must not fail on the value it reports
            return None

    def _probe_failed(self, owner, err):
        self.start_scale = False
        start = self._scale_or_none(owner)
        warn(f"tfamp: model {self.model.name!r}: no start scale from the gradients "
             f"({type(err).__name__}: {err}); dynamic scaling starts at "
             f"{'its initial scale' if start is None else format(start, 'g')}. Fix: pass "
             f"initial_scale=<number> to tfamp.enable (TFAMP_INITIAL_SCALE) to choose it "
             f"yourself.")
        return None

    def _fit_callback(self):
        return _fit_callback_class(self.flavour.callback_base)(self)

    def on_train_begin(self) -> None:
        """Re-applies the patterns a restored checkpoint recorded and this run lacks."""
        variable = self.record_variable()
        if variable is None:
            return
        recorded = fallback.recorded_for(variable.numpy(), self.model.name)
        missing = tuple(p for p in recorded if p not in self.fallback.moved)
        if missing:
            self.apply_fallback(missing)
            decision = fallback.FallbackDecision(fallback.MOVED, missing)
            log.warning("%s", fallback.moved_message(f"model {self.model.name!r}", self.config,
                                                     decision, restored=True))
        owner = self.step_owner or self.loss_scale_optimizer()
        skipped = getattr(owner, "skipped_steps", None)
        if skipped is not None:  # count skipped steps in a row from here
            self.fallback.last_skipped = int(tf.convert_to_tensor(skipped).numpy())

    def on_epoch_begin(self) -> None:
        scale = self.read_scale()
        self.epoch_skipped_at = scale[1] if scale is not None else 0
        self.epoch_calls = 0

    # -- train_on_batch ------------------------------------------------------------------

    def train_on_batch(self, args, kwargs):
        """Keras's ``train_on_batch``. Its list (``return_dict=False``, the default) is
        float32's, without tfamp's log keys: a model with only a loss gets its loss
        as a number, as scripts print it (``"%f" % loss``); a dict keeps them.
        The call's batch is the one the float32 fallback and the stuck warning
        look at while the call runs (a GAN's loop of ``train_on_batch`` calls has
        no fit data to re-read). The first call re-applies a restored fallback
        record, as each fit's start does."""
        if not self._record_read_on_batch and self.settings.loss_scale is not None:
            self._record_read_on_batch = True
            self.on_train_begin()
        with _batch_of_this_call(self.model, args, kwargs):
            return self._train_on_batch(args, kwargs)

    def _train_on_batch(self, args, kwargs):
        cls, model = self.cls, self.model
        signature = _signature(cls.train_on_batch)
        if _passes_keywords_on(signature):
            # A wrapper of Keras's method (a decorator without functools.wraps: a
            # profiler's, a logger's) that hands its keywords on: ask it by keyword.
            if kwargs.get("return_dict", False) or len(args) > 5:
                return cls.train_on_batch(model, *args, **kwargs)
            logs = cls.train_on_batch(model, *args, **{**kwargs, "return_dict": True})
        else:
            try:
                bound = signature.bind(model, *args, **kwargs)
            except TypeError:  # Keras's own call says what is wrong
                return cls.train_on_batch(model, *args, **kwargs)
            bound.apply_defaults()
            if bound.arguments.get("return_dict", True):  # asked for (or not Keras's)
                return cls.train_on_batch(model, *args, **kwargs)
            bound.arguments["return_dict"] = True
            logs = cls.train_on_batch(*bound.args, **bound.kwargs)
        if not isinstance(logs, dict):
            return logs
        return self.flavour.flatten_logs(
            model, {k: v for k, v in logs.items() if k not in LOG_KEYS})

    # -- around each step ---------------------------------------------------------------

    def train_step(self, data):
        """The model's ``train_step`` in its step scope, with tfamp's log keys."""
        cls, model = self.cls, self.model
        if self.settings.loss_scale is None:
            return cls.train_step(model, data)
        tape.install()
        guard = self._step_guard()
        scope = step_scope.StepScope(self.built_scale_owner, self.loss_scale_optimizer)
        if self._pending_probe is not None and not tf.executing_eagerly():
            scope.recorder = self._recorder_for(tf.compat.v1.get_default_graph())
        with step_scope.train_step_scope(scope):
            logs = _traced_here(cls.train_step)(model, data)
        if guard is not None:
            logs = guard.finish(logs)
        if scope.unscaled and not self.warned_unscaled:
            self.warned_unscaled = True
            warn(unscaled_message(model))
        owner = scope.reported_owner()
        if owner is None or not isinstance(logs, dict):
            return logs
        self.step_owner = owner

        def read():
            return step_log_values(owner)

        scale, skipped = _read_once(read) if self.flavour.sums_replica_logs else read()
        logs = dict(logs)
        logs["loss_scale"], logs["skipped_steps"] = scale, skipped
        return logs

    def _step_guard(self):
        if tf.executing_eagerly():
            return None
        if self.flavour.is_keras3 and not _fully_built(self.model):
            # Keras 3 (without a strategy) builds the model in the step's first
            # trace: building the optimizer here, before the model's variables
            # exist, breaks its update. That trace makes variables, so
            # tf.function traces the step again (the trace that runs), guarded.
            # (A model whose build() ran without building its layers, a subclassed
            # model with no build() of its own, is marked built but has none.)
            return None
        owner = self.built_scale_owner()
        skipped = getattr(owner, "skipped_steps", None) if owner is not None else None
        if skipped is None:
            return None
        return step_metrics.StepGuard(self.model, skipped, self.nonfinite_skips,
                                      replica_logs_summed=self.flavour.sums_replica_logs)

    # -- after each train call -------------------------------------------------------------

    def after_train_call(self, outputs) -> None:
        """Moves an op that overflows float16 to float32, else warns (naming the op)
        when the scale is stuck at its floor."""
        del outputs
        self.epoch_calls += 1
        owner = self.step_owner
        if owner is None:
            return
        if self._fallback_after_call(owner):
            return  # the next step runs the new graph: the stuck check waits for it
        from tfamp.keras.overflow_locator import diagnose_keras_model

        owner.check_stuck(diagnose=lambda: fallback.known_cause(self)
                          or diagnose_keras_model(self.model))

    def _fallback_after_call(self, owner) -> bool:
        """True if layers moved to float32 now."""
        state = self.fallback
        if state.stopped or self.record_variable() is None:
            return False
        if not (self.flavour.has_loss(self.model) or self.flavour.own_train_step(self.cls)):
            return False  # no compiled loss and Keras's own step: nothing differentiated
        scale, skipped = (v.numpy() for v in scale_values(owner))
        at_floor = float(scale) <= float(owner.min_scale)
        if not state.should_look(int(skipped), at_floor, self._forward_overflowed):
            return False
        room = fallback.MAX_MOVED - len(state.moved)
        local, repaired, undo, batch = self._decide_locally(room)
        decision = fallback.agree(self.strategy(), local, room=room)
        state.record(decision)
        if decision.kind == fallback.MOVED:
            decision = dataclasses.replace(decision, repaired=repaired)
            self.apply_fallback(decision.patterns)
            log.warning("%s", fallback.moved_message(f"model {self.model.name!r}", self.config,
                                                     decision))
            self._probe_after_fallback(owner, batch)
            return True
        undo()
        if decision.kind == fallback.NOT_FOUND:
            log.debug("tfamp: %d steps skipped in a row on %r but the step is finite at "
                      "loss scale 1: loss scaling's to fix; next look after %d.",
                      state.consecutive, self.model.name, state.next_probe_at)
        elif not (decision.kind == fallback.FAILED and local.kind == fallback.FAILED):
            log.warning("%s", fallback.stopped_message(f"model {self.model.name!r}", decision))
        return False

    def _decide_locally(self, room: int):
        """(this worker's decision, what was repaired, undo, the batch) on fit's first
        batch (None when it cannot be read)."""
        model = self.model
        source = getattr(model, "_tfamp_fit_batch", None)
        try:
            batch = source() if source is not None else None
        except Exception:  # a batch that cannot be read again: nothing to look at
            batch = None
        if batch is None:
            return fallback.FallbackDecision(fallback.NO_BATCH), (), lambda: None, None
        # The skipped steps ran their forward pass: a BatchNorm's moving statistics
        # took the inf/nan in. Repaired first, so the locator sees where it starts;
        # kept only if layers move (the next overflowing step would write them again).
        repaired, undo = fallback.repair_state(model)
        try:
            decision = fallback.decide(model, self.config, self.flavour.unpack_batch(batch),
                                       room=room, strategy=self.strategy())
        except Exception as err:  # training goes on; the stuck check still warns
            log.warning("tfamp: no float32 fallback on model %r: finding the op that "
                        "overflows failed (%s: %s); tfamp will not retry. Please report it; "
                        "meanwhile keep the layer float32 yourself (keep_fp32=[...]).",
                        model.name, type(err).__name__, err)
            decision = fallback.FallbackDecision(fallback.FAILED)
        return decision, repaired, undo, batch

    def _probe_after_fallback(self, owner, batch) -> None:
        """The start scale again, now that layers moved to float32 (``auto`` only).

        The skipped steps that led to the fallback left the scale at or near its
        floor, since the moved layers' values overflowed float16 at any scale;
        dynamic scaling would take thousands of steps to grow it back, and
        meanwhile small gradients of the layers still 16-bit underflow. The
        probe runs on the batch the fallback read, rewritten with the moved
        layers float32, so only what stays 16-bit sets the scale. Every worker
        probes (the probe agrees across them); failing, the scale stays."""
        if not self.settings.auto_start or not owner.is_dynamic:
            return
        before = self._scale_or_none(owner)
        found = self._probe(batch, again=True)
        if found is None or before is not None and found.scale <= before:
            return
        self.built_scale_owner().set_scale(found.scale)
        if before is not None:
            log.warning("tfamp: model %r: loss scale %g -> %g now that those layers are "
                        "float32 (the start-scale probe again, on the rewritten step: "
                        "max |g| %.3g in %s).", self.model.name, before, found.scale,
                        found.max_abs, found.where)

    def _forward_overflowed(self) -> bool:
        """Did a skipped step's logs hold inf/nan since the last look, on any replica of
        any worker? (Collective: every worker asks at the same step.)"""
        counter = self.nonfinite_skips
        if counter is None:
            return True  # no count kept: look
        local = sum(int(c.numpy()) for c in replicas.local_components(counter))
        counts = replicas.agree_rows(self.strategy(), [local])[:, 0]
        seen, self._seen_nonfinite = self._seen_nonfinite, counts
        return seen is None and counts.any() or seen is not None and (counts > seen).any()

    def apply_fallback(self, patterns: tuple[str, ...]) -> None:
        """Keeps `patterns` float32 from the next step on: the config, the step
        functions (rebuilt) and the checkpointed record."""
        state = self.fallback
        state.moved = (*state.moved, *(p for p in patterns if p not in state.moved))
        new = tuple(p for p in patterns if p not in self.config.keep_fp32)
        if new:
            self.config = self.config.replace(keep_fp32=(*self.config.keep_fp32, *new))
            had_train = getattr(self.model, "train_function", None) is not None
            self._reset_functions()
            if had_train:  # fit holds no copy: it reads model.train_function each step
                self.model.make_train_function(force=True)
        variable = self.record_variable()
        if variable is None:
            return
        try:
            variable.assign(fallback.record_with(variable.numpy(), self.model.name,
                                                 state.moved))
        except ValueError as err:
            log.warning("tfamp: %s A resumed run will not keep the fallback: make it "
                        "permanent with keep_fp32.", err)

    def record_variable(self):
        """The checkpointed record of moved layers (the owner's ``fallback_fp32``), or None."""
        for candidate in (self.step_owner, getattr(self.model, "optimizer", None)):
            variable = getattr(candidate, "fallback_fp32", None)
            if variable is not None:
                return variable
        return None

    # -- the epoch's end -----------------------------------------------------------------

    def epoch_results(self, base, logs):
        """Keras's epoch-end metrics re-read, with tfamp's log keys set aside.

        Keras re-reads its metrics at an epoch's end (right under tf.distribute)
        only when the log keys are exactly its metric names: tfamp's keys are set
        aside, Keras reads, then tfamp's values are read from the scale owner.
        An epoch whose steps were all skipped with inf/nan ends in NaN.
        """
        model = self.model
        if not (isinstance(logs, dict) and any(k in logs for k in LOG_KEYS)):
            return base(model, logs)
        result = base(model, {k: v for k, v in logs.items() if k not in LOG_KEYS})
        scale = self.read_scale()
        if not isinstance(result, dict) or scale is None:
            return result
        result = dict(result)
        result["loss_scale"], result["skipped_steps"] = scale
        mark, self.epoch_skipped_at = self.epoch_skipped_at, None  # training's read only
        # Every step of the epoch skipped (at least its calls' fewest steps: a last
        # call may take fewer than steps_per_execution): a metric left empty then was
        # put back at every step. With a step applied, an empty metric is one the
        # step never updates (Keras 3's loss tracker beside a train_step of its
        # own that returns its loss as a tensor): Keras's value stands.
        fewest = (max(self.epoch_calls, 1) - 1) * self.flavour.steps_per_execution(model) + 1
        if mark is not None and scale[1] - mark >= fewest:
            result = step_metrics.epoch_results(model, result)
        return result

    # -- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The model's mixed-precision state as plain values: the scale, the skipped
        steps and the layers moved to float32 (checkpoints carry the same in the
        optimizer's variables)."""
        owner = self.scale_owner()
        state = {"keep_fp32": list(self.fallback.moved)}
        if owner is not None and getattr(owner, "skipped_steps", None) is not None:
            scale, skipped = scale_values(owner)
            state.update(loss_scale=float(scale.numpy()), skipped_steps=int(skipped.numpy()))
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restores what ``state_dict`` returned (moved layers, then the scale)."""
        moved = tuple(state.get("keep_fp32", ()))
        if moved:
            self.apply_fallback(moved)
        owner = self.built_scale_owner()
        if owner is not None and "loss_scale" in state:
            owner.set_scale(float(state["loss_scale"]))
            owner.skipped_steps.assign(int(state.get("skipped_steps", 0)))


class FirstTrainCall:
    """A train function whose next call first runs the model's
    ``before_first_train_call`` (the start-scale probe on the batches that call
    takes from fit's iterator), then puts the function back on the model."""

    def __init__(self, precision: ModelPrecision, function):
        self.function = function
        self._precision = precision

    def __getattr__(self, name):  # reports, rewritten, ...: the function's
        if "function" not in self.__dict__:  # (copy / pickle ask before __init__ ran)
            raise AttributeError(name)
        return getattr(self.__dict__["function"], name)

    def __call__(self, iterator, *args, **kwargs):
        precision = self._precision
        object.__setattr__(precision.model, "train_function", self.function)
        if precision.probe_first_step:
            iterator = precision.before_first_train_call(iterator)
        return self.function(iterator, *args, **kwargs)


_recorders_lock = threading.Lock()


@contextlib.contextmanager
def _batch_of_this_call(model, args, kwargs):
    """``model._tfamp_fit_batch`` is `train_on_batch`'s own batch while the call runs
    (x, y, sample_weight: the first three parameters in both Kerases; no copy, the
    caller's arrays are only read during the call); fit's, if any, afterwards."""
    x, y, sample_weight = (args[i] if len(args) > i else kwargs.get(name)
                           for i, name in enumerate(("x", "y", "sample_weight")))
    batch = (x if y is None and sample_weight is None
             else (x, y) if sample_weight is None else (x, y, sample_weight))
    had = "_tfamp_fit_batch" in model.__dict__
    previous = model.__dict__.get("_tfamp_fit_batch")
    object.__setattr__(model, "_tfamp_fit_batch", lambda: batch)
    try:
        yield
    finally:
        if had:
            object.__setattr__(model, "_tfamp_fit_batch", previous)
        else:
            model.__dict__.pop("_tfamp_fit_batch", None)


def _read_once(read):
    """`read()` once for all replicas, so Keras's per-replica sum does not multiply it."""
    if not tf.distribute.has_strategy() or tf.distribute.in_cross_replica_context():
        return read()
    return tf.distribute.get_replica_context().merge_call(lambda _: read())


def _with_callback(args, kwargs, callback) -> tuple[tuple, dict]:
    """fit's (args, kwargs) with `callback` appended to its callbacks (None: as they are)."""
    from tfamp.keras.range_monitor import fit_callbacks

    if callback is None:
        return tuple(args), kwargs
    callbacks = [*fit_callbacks(args, kwargs), callback]
    if len(args) > 5:  # callbacks given positionally
        return (*args[:5], callbacks, *args[6:]), kwargs
    return tuple(args), {**kwargs, "callbacks": callbacks}


@functools.cache
def _fit_callback_class(base: type) -> type:
    class FitCallback(base):
        """tfamp's points inside fit: a restored fallback record, each epoch's start."""

        def __init__(self, precision: ModelPrecision):
            super().__init__()
            self._precision = precision

        def on_train_begin(self, logs=None):
            self._precision.on_train_begin()

        def on_epoch_begin(self, epoch, logs=None):
            self._precision.on_epoch_begin()

    return FitCallback


@functools.lru_cache(maxsize=64)
def _signature(function) -> inspect.Signature:
    """`function`'s signature, read once (``train_on_batch`` is called every step)."""
    return inspect.signature(function)


def _passes_keywords_on(signature: inspect.Signature) -> bool:
    """``(*args, **kwargs)`` and no ``return_dict`` of its own: a plain wrapper."""
    parameters = signature.parameters
    return ("return_dict" not in parameters
            and any(p.kind is p.VAR_KEYWORD for p in parameters.values())
            and any(p.kind is p.VAR_POSITIONAL for p in parameters.values()))


def _trainable_variables_so_far(model) -> list:
    """`model`'s trainable variables; none yet for a tf_keras Sequential without an
    input shape, which raises until its first call (inside fit's first trace) builds it."""
    try:
        return list(model.trainable_variables)
    except ValueError:
        return []


def _fully_built(model) -> bool:
    """Is `model` built, and every layer in it (Keras 3)?"""
    if not model.built:
        return False
    return all(layer.built for layer in layers_of(model))


def _nested_models(model, model_class) -> list:
    """The Keras models inside `model` (not itself), at any depth."""
    return [layer for layer in layers_of(model, include_self=False)
            if isinstance(layer, model_class)]


def _traced_here(step):
    """`step` (a model class's ``train_step``), traced in the trace that calls it.

    A ``train_step`` the user decorated with ``tf.function`` (keras.io's
    forwardforward.py) is traced once, by the first trace of the model's step,
    and every later trace calls that same concrete function: its tapes and
    updates never ran again in Python, so the start-scale probe found no loss
    (``NoLossDifferentiated``) and the trace that trains reported no scale (no
    ``loss_scale`` / ``skipped_steps`` in its logs). Inside a trace its Python
    function runs in that trace instead, converted by AutoGraph as its
    ``tf.function`` would (the tapes then sit in the step's own graph, where
    the probe reads them). One compiled with XLA (``jit_compile=True``) keeps
    its own function."""
    python_function = getattr(step, "python_function", None)
    if (python_function is None or tf.executing_eagerly()
            or not isinstance(step, tf.types.experimental.GenericFunction)
            or getattr(step, "_jit_compile", None)):
        return step
    if getattr(step, "_autograph", True):
        return tf.autograph.to_graph(python_function)
    return python_function
