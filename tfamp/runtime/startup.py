"""``TFAMP_ENABLE=1``: mixed precision for scripts that never import tfamp.

Imported by the interpreter start-up hook (``tfamp_startup.pth``) only when
TFAMP_ENABLE is set, and by ``tfamp run``. ``activate()`` validates every
setting first (a bad one stops the script with one line and exit status 2),
then patches, once:

* ``tf.function``: every function the script traces is rewritten by tfamp
  (Keras fit/evaluate/predict and the user's own; tf.data builds its functions
  without the public ``tf.function``, so pipelines are left alone, and a
  tf.function a pipeline calls runs as traced), except while
  a model is saved (``model.save``, ``tf.saved_model.save``, TFLite's converter):
  the script's float32 model is what it saves;
* ``Model.compile`` of tf_keras and of Keras 3 calls ``tfamp.enable`` (tfamp's
  loss-scale optimizer for each); a Keras 3 model compiled with Keras's own
  ``LossScaleOptimizer`` keeps it (its graphs are rewritten, its loss scaling
  stays Keras's);
* ``tf.GradientTape.gradient`` and the optimizers' ``apply_gradients`` (tf_keras)
  / ``apply`` (Keras 3), for custom training loops: backprop of a float loss
  (a scalar or a per-example vector) is seeded with the loss scale, the
  gradients are unscaled in float32, and a step whose gradients are not
  finite on some replica is skipped on every replica (weights and slots
  untouched) while the scale adapts once. A custom loop's step gets ``fit``'s
  float32 fallback too: before its first run where the start scale's check
  finds its float16 step inf at every scale, and later from a watch on its
  skipped steps (``_custom_loop_watch``); what moves joins the process's
  config (``_Activation.config``), which every rewritten function reads.

Loss scaling happens exactly once: a loss a loss-scale optimizer's
``scale_loss`` returned is marked and the tape leaves it alone; the inner
optimizer of a loss-scale optimizer is marked and the apply patch leaves it
alone (see ``tfamp.keras.step_scope``).

A model that runs a Keras mixed policy (``mixed_float16`` / ``mixed_bfloat16``,
tf_keras or Keras 3) is left to Keras: tfamp neither rewrites its functions nor
scales its loss, and says so in one line. An eager training step (gradients
applied outside any tf.function) runs float32, since tfamp rewrites traced
graphs: one line says so the first time, whatever the script traces later. The
exit notice (nothing was rewritten) stays silent after an uncaught exception,
such a step-aside, or that line.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import re
import sys
import threading
import weakref
from pathlib import Path

from tfamp.env import EnvError, EnvSettings, settings_from_env
from tfamp.runtime import log_lines

log = logging.getLogger("tfamp")
_LEVELS = {0: logging.WARNING, 1: logging.INFO, 2: logging.DEBUG}


class _Activation:
    """What activate() installed, and what it saw (for the exit notice)."""

    def __init__(self, settings: EnvSettings):
        self.settings = settings
        # The AmpConfig functions are rewritten with now: the environment's, plus the
        # layers a custom loop's float32 fallback moved (_custom_loop_fallback).
        self.config = settings.config
        self.reports = []
        self.quiet = False  # no exit notice (quiet_exit_notice)
        self.report_files = 0
        self.no_tape_scaling = threading.local()
        self.scale_state = None  # created on first use, outside any trace
        # Set while a model that runs a Keras mixed policy builds its functions:
        # tf.function is then Keras's own (see _patch_keras_mixed_policies).
        self.stepping_aside = threading.local()
        # Does tfamp step aside for the object a traced method belongs to (a model
        # under a Keras mixed policy)? Set by _patch_keras_mixed_policies.
        self.steps_aside_for = lambda owner: False
        self.stepped_aside: list[str] = []  # model names, for the exit notice
        self.told_eager = False  # the eager-step line was given (once per process)
        # The last loss a tape differentiated was in a traced function (so rewritten
        # and scaled there), even if its gradients are then applied eagerly.
        self.loss_tape_traced = False
        # A traced custom-loop step scaled a tape with the process-wide scale, and
        # whether its start scale was looked for (_custom_loop_start_scale).
        self.custom_loop_scaled = False
        self.start_scale_sought = False
        # The outermost graphs of the traces that scaled a tape (a custom loop's steps),
        # and the custom loop's fallback watch.
        self.scaled_graphs = weakref.WeakSet()
        self.loop_watch = _LoopWatch()


_active: _Activation | None = None


def activate(environ=None, *, from_startup_hook: bool = False) -> bool:
    """Turns mixed precision on for this process if TFAMP_ENABLE says so.

    Args:
      environ: the environment to read (``os.environ`` if None).
      from_startup_hook: called from ``tfamp_startup.pth``, where an exception
        would abort the interpreter with a fatal-error traceback; exit directly.

    Returns:
      True if tfamp is now active. Exits with status 2 and a one-line message
      when a TFAMP_* setting is invalid, before the script runs.
    """
    global _active
    if _active is not None:
        return True
    try:
        settings = settings_from_env(environ)
    except EnvError as err:
        print(f"tfamp: error: {err}", file=sys.stderr)
        sys.stderr.flush()
        if from_startup_hook:
            os._exit(2)
        raise SystemExit(2) from None
    if not settings.enabled:
        return False
    _configure_logging(settings.verbosity)
    _active = _Activation(settings)
    _patch_tf_function(_active)
    _patch_tf_keras(_active)
    _patch_keras3(_active)
    _patch_keras_mixed_policies(_active)
    _patch_custom_loops(_active)
    _note_hardware()
    atexit.register(_exit_notice, _active)
    log.debug("tfamp: active (%s, loss scale %s)", settings.config.dtype, settings.loss_scale)
    return True


def _configure_logging(verbosity: int) -> None:
    log.setLevel(_LEVELS[verbosity])
    log_lines.show()


# -- tf.function ----------------------------------------------------------------

def _patch_tf_function(active: _Activation) -> None:
    import tensorflow as tf

    from tfamp.runtime.runner import RewrittenFunction

    original = tf.function
    on_report = functools.partial(_record_report, active)
    settings = active.settings
    before_run = (functools.partial(_custom_loop_start_scale, active)
                  if settings.loss_scale == "dynamic" and settings.initial_scale == "auto"
                  else None)
    watch = (functools.partial(_custom_loop_watch, active)
             if settings.loss_scale is not None else None)  # (dynamic or fixed)

    @functools.wraps(original)
    def function(func=None, **kwargs):
        if func is None:
            return lambda f: function(f, **kwargs)
        if isinstance(func, RewrittenFunction):
            return func
        if (getattr(active.stepping_aside, "on", False)
                or active.steps_aside_for(getattr(func, "__self__", None))):
            return original(func, **kwargs)
        return RewrittenFunction(original(func, **kwargs), active.config,
                                 on_report=on_report, before_new_trace_runs=before_run,
                                 float32_when_saving=True, config_of=lambda: active.config,
                                 after_eager_call=watch)

    function._tfamp_original = original
    function._tfamp_on_report = on_report  # for functions tfamp.enable builds itself
    # tf_keras calls tensorflow.compat.v2.function: patch every public alias.
    import tensorflow.compat.v2 as tf_v2

    for module in (tf, tf_v2):
        if getattr(module, "function", None) is original:
            module.function = function


def _record_report(active: _Activation, report) -> None:
    active.reports.append(report)
    folder = active.settings.report_dir
    if folder is None:
        return
    Path(folder).mkdir(parents=True, exist_ok=True)
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", report.function or "graph")
    active.report_files += 1
    path = Path(folder) / f"{active.report_files:03d}_{safe}.json"
    path.write_text(report.to_json())
    log.debug("tfamp: wrote %s", path)


# -- Keras --------------------------------------------------------------------

def _patch_tf_keras(active: _Activation) -> None:
    try:
        import tf_keras
    except ImportError:
        return
    from tfamp.keras.scale_update import loss_scale_ops, mark_scaled

    _patch_compile(active, tf_keras.Model)
    # The loss Keras's own tf_keras LossScaleOptimizer scales is marked, so the
    # custom-loop tape patch does not scale it again (tfamp's subclass marks too).
    # `LossScaleOptimizer(opt)` builds a LossScaleOptimizerV3 for a new-style
    # optimizer and a LossScaleOptimizer of that module for a legacy one, neither
    # a subclass of the public class (their base): patch all three. (The legacy
    # one unpatched, its scaled loss was scaled again, 2^30: every step skipped.)
    from tf_keras.src.mixed_precision import loss_scale_optimizer as keras_lso_module

    for lso_class in (tf_keras.mixed_precision.LossScaleOptimizer,
                      keras_lso_module.LossScaleOptimizer,
                      keras_lso_module.LossScaleOptimizerV3):
        _mark_scaled_losses(lso_class, loss_scale_ops, mark_scaled)


def _patch_compile(active: _Activation, model_class) -> None:
    """``compile`` of `model_class` then enables the model (``activation.enable_for_compile``:
    a Keras mixed policy or Keras's own LossScaleOptimizer is left to Keras)."""
    from tfamp.keras import activation

    original = model_class.compile
    settings = active.settings

    @functools.wraps(original)
    def compile(self, *args, **kwargs):  # noqa: A001
        result = original(self, *args, **kwargs)
        if isinstance(self, _keras_model_classes()):
            activation.enable_for_compile(
                self, config=active.config, loss_scale=settings.loss_scale,
                initial_scale=settings.initial_scale, ranges=settings.ranges_dir)
        return result

    model_class.compile = compile


def _keras_model_classes() -> tuple[type, ...]:
    from tfamp.keras.flavour import all_flavours

    return tuple(f.model_class for f in all_flavours())


def _mark_scaled_losses(lso_class, loss_scale_ops, mark_scaled) -> None:
    original = lso_class.__dict__.get("get_scaled_loss")
    if original is None:
        return

    @functools.wraps(original)
    def get_scaled_loss(self, loss):
        with loss_scale_ops():
            scaled = original(self, loss)
        mark_scaled(scaled)
        return scaled

    lso_class.get_scaled_loss = get_scaled_loss


def _patch_keras3(active: _Activation) -> None:
    """Keras 3's compile calls ``tfamp.enable`` (tfamp's Keras 3 loss-scale optimizer).

    ``Trainer.compile`` itself is patched, not ``keras.Model.compile``: Keras's
    loader only compiles a model from its saved config when ``compile`` is the
    base class's (a patched subclass attribute made it skip compiling, and so
    drop the optimizer state). A model compiled with Keras's own
    ``LossScaleOptimizer`` keeps it: its graphs are rewritten, its loss scaling
    stays Keras's. A model under a Keras mixed policy is left to Keras entirely.
    """
    try:
        import keras
        from keras.src.trainers import trainer as base_trainer
    except ImportError:
        return
    if not getattr(keras, "__version__", "0").startswith("3"):
        return
    if keras.backend.backend() != "tensorflow":
        log.warning("tfamp: Keras 3 runs on the %r backend, not TensorFlow: tfamp rewrites "
                    "TensorFlow graphs only, so Keras models here stay as they are.",
                    keras.backend.backend())
        return
    # (Importing tfamp's Keras 3 optimizer registers it: a .keras file saved with it loads.)
    from tfamp.keras import optimizer_keras3  # noqa: F401
    from tfamp.keras.scale_update import loss_scale_ops, mark_scaled
    from tfamp.keras.step_scope import INNER_MARK

    _patch_compile(active, base_trainer.Trainer)

    # Keras's own LossScaleOptimizer (a user's, or a mixed policy's): the loss it
    # scales is marked so tfamp's tape patch does not scale it again, and its
    # inner optimizer is marked so tfamp's apply patch stands aside.
    lso_class = keras.optimizers.LossScaleOptimizer
    original_init, original_scale_loss = lso_class.__init__, lso_class.scale_loss

    @functools.wraps(original_init)
    def lso_init(self, inner_optimizer, *args, **kwargs):
        original_init(self, inner_optimizer, *args, **kwargs)
        setattr(inner_optimizer, INNER_MARK, True)

    @functools.wraps(original_scale_loss)
    def scale_loss(self, loss):
        with loss_scale_ops():
            scaled = original_scale_loss(self, loss)
        mark_scaled(scaled)
        return scaled

    lso_class.__init__ = lso_init
    lso_class.scale_loss = scale_loss


@contextlib.contextmanager
def _keras_scales_itself(active: _Activation):
    """Marks a Keras train step: its optimizer scales the loss, the tape must not."""
    previous = getattr(active.no_tape_scaling, "on", False)
    active.no_tape_scaling.on = True
    try:
        yield
    finally:
        active.no_tape_scaling.on = previous


def _patch_keras_mixed_policies(active: _Activation) -> None:
    """tfamp steps aside for a model that runs a Keras mixed policy.

    Such a model already computes in 16-bit with Keras's own loss scaling
    (``mixed_float16`` wraps its optimizer in Keras's LossScaleOptimizer), so
    its train / test / predict functions are built with the plain tf.function
    (not rewritten) and its train step is marked as scaling itself (the tape
    does not scale again); so is any other method of the model that a script or
    library traces (keras-hub's generate step). One log line per model says so.
    """
    from tfamp.keras.activation import mixed_policy_name

    classes = []
    try:
        import tf_keras

        classes.append(tf_keras.Model)
    except ImportError:
        pass
    try:
        import keras
        from keras.src.backend.tensorflow import trainer as tf_trainer

        if getattr(keras, "__version__", "0").startswith("3"):
            classes.append(tf_trainer.TensorFlowTrainer)
    except ImportError:
        pass

    def step_aside(model) -> bool:
        policy = mixed_policy_name(model)
        if policy is None:
            return False
        if not getattr(model, "_tfamp_stepped_aside", False):
            object.__setattr__(model, "_tfamp_stepped_aside", True)
            active.stepped_aside.append(model.name)
            log.warning("tfamp: model %r runs Keras's %r policy, so tfamp steps aside for "
                        "it: Keras's own mixed precision and loss scaling train it, tfamp "
                        "neither rewrites nor scales it (for tfamp instead, set the policy "
                        "to 'float32').", model.name, policy)
        return True

    model_classes = tuple(classes)

    def steps_aside_for(owner) -> bool:
        """A model's own method traced outside Keras's makers (keras-hub's
        generate function is ``tf.function(self.generate_step)``) is the model's
        computation too: left to Keras with the rest of it."""
        return owner is not None and isinstance(owner, model_classes) and step_aside(owner)

    active.steps_aside_for = steps_aside_for

    def patch_maker(model_class, maker_name: str) -> None:
        original = getattr(model_class, maker_name)

        @functools.wraps(original)
        def make(self, *args, **kwargs):
            if not step_aside(self):
                return original(self, *args, **kwargs)
            previous = getattr(active.stepping_aside, "on", False)
            active.stepping_aside.on = True
            try:
                return original(self, *args, **kwargs)
            finally:
                active.stepping_aside.on = previous

        setattr(model_class, maker_name, make)

    for model_class in classes:
        for maker_name in ("make_train_function", "make_test_function",
                           "make_predict_function"):
            patch_maker(model_class, maker_name)
        if model_class.__module__.startswith("tf_keras"):
            original_step = model_class.train_step

            @functools.wraps(original_step)
            def train_step(self, data, _original=original_step):
                if getattr(self, "_tfamp_stepped_aside", False):
                    with _keras_scales_itself(active):
                        return _original(self, data)
                return _original(self, data)

            model_class.train_step = train_step


# -- custom training loops --------------------------------------------------------

def _patch_custom_loops(active: _Activation) -> None:
    if active.settings.loss_scale is None:
        _patch_eager_notice(active)
        return
    import tensorflow as tf

    from tfamp.keras import optimizer_tf_keras, step_scope
    from tfamp.keras.scale_update import is_loss_target, is_scaled, seed, unscale

    step_scope.set_process_owner(process_scale_state, lambda: active.config)

    original_gradient = tf.GradientTape.gradient

    @functools.wraps(original_gradient)
    def gradient(self, target, sources, output_gradients=None, **kwargs):
        loss_target = is_loss_target(target, sources)
        if loss_target:
            active.loss_tape_traced = not tf.executing_eagerly()
        if (_scaled_elsewhere(active) or output_gradients is not None
                or not loss_target or is_scaled(target)):
            return original_gradient(self, target, sources, output_gradients, **kwargs)
        scale = _scale_state(active).current_loss_scale
        if not tf.executing_eagerly():
            active.custom_loop_scaled = True
            active.scaled_graphs.add(_outermost_graph())
        grads = original_gradient(self, target, sources, seed(target, scale), **kwargs)
        step_scope.push_process_scaled()
        return tf.nest.map_structure(lambda g: unscale(g, scale), grads)

    tf.GradientTape.gradient = gradient

    for optimizer_class in _optimizer_classes():
        _patch_apply_gradients(active, optimizer_class)
    _patch_keras3_apply(active)

    # tfamp's own loss-scale optimizer scales through the tape by itself.
    original_compute = optimizer_tf_keras.LossScaleOptimizer.compute_gradients

    @functools.wraps(original_compute)
    def compute_gradients(self, *args, **kwargs):
        with _keras_scales_itself(active):
            return original_compute(self, *args, **kwargs)

    optimizer_tf_keras.LossScaleOptimizer.compute_gradients = compute_gradients


def _patch_eager_notice(active: _Activation) -> None:
    """Without loss scaling (bfloat16, ``TFAMP_LOSS_SCALE=none``) there is nothing to
    scale or skip, but an eager loop still runs float32 and is told so, once, as
    with float16's scaling patches (``_tell_if_eager``)."""
    import tensorflow as tf

    from tfamp.keras.scale_update import is_loss_target

    original_gradient = tf.GradientTape.gradient

    @functools.wraps(original_gradient)
    def gradient(self, target, sources, output_gradients=None, **kwargs):
        if is_loss_target(target, sources):
            active.loss_tape_traced = not tf.executing_eagerly()
        return original_gradient(self, target, sources, output_gradients, **kwargs)

    tf.GradientTape.gradient = gradient

    def telling(original):
        @functools.wraps(original)
        def apply(self, *args, **kwargs):
            if not _scaled_elsewhere(active):
                _tell_if_eager(active)
            return original(self, *args, **kwargs)
        return apply

    for optimizer_class in _optimizer_classes():
        optimizer_class.apply_gradients = telling(optimizer_class.apply_gradients)
    keras3_optimizer = _keras3_optimizer_class()
    if keras3_optimizer is not None:  # (its apply_gradients calls apply)
        keras3_optimizer.apply = telling(keras3_optimizer.apply)


def _custom_loop_start_scale(active: _Activation, tf_function, concrete, args,
                             kwargs) -> None:
    """The start loss scale of a custom loop from its step's own gradients.

    Called before a newly traced tf.function first runs. Once per process, for
    the first step whose trace scaled a tape with the process-wide scale (and
    before that scale has taken a step or was set by ``calibrate_loss_scale``):
    the probe ``fit`` runs (``tfamp.keras.start_scale``), on this call's batch,
    so the loop does not lose its first steps to halving a 2**15 start. Where a
    probe could change what the loop does, it is not run and one line says so.
    """
    if not active.custom_loop_scaled or active.start_scale_sought:
        return
    from tfamp.keras import calibrate, scale_state, start_scale

    active.start_scale_sought = True
    state = _scale_state(active)
    # Kept: a scale set by calibrate_loss_scale, grown, or restored, and one that
    # has skipped a step. (Eager steps before, in float32, count good steps only:
    # not asked.)
    if scale_state.scale_has_run(state.current_loss_scale, scale_state.DEFAULT_INITIAL_SCALE,
                                 state.skipped_steps):
        return
    name = getattr(tf_function, "__name__", "step")
    try:  # the loop must run whatever the probe meets
        why_not = _no_probe_reason(concrete, args, kwargs)
        if not why_not:
            found = calibrate.calibrate_step(tf_function, args, kwargs)
            if found.forward_overflow and _custom_loop_fallback(active, tf_function, args,
                                                                kwargs):
                # The start scale of the step that will run, with those layers float32.
                calibrate.calibrate_step(tf_function, args, kwargs)
            return
    except start_scale.NoLossDifferentiated:
        # Not the step (its tape was traced inside another function, first run
        # from a trace): the next new function's first run is asked again.
        active.start_scale_sought = False
        return
    except Exception as err:  # noqa: BLE001 (said in the line below)
        why_not = f"the probe failed ({type(err).__name__}: {err})"
    log.info("tfamp: custom loop step %s: no start loss scale from its gradients: %s; "
             "dynamic scaling starts at 2^15 and may skip its first steps. Fix: call "
             "tfamp.calibrate_loss_scale(step, batch) before the loop, with the function "
             "that trains on one batch, or set TFAMP_INITIAL_SCALE=<number>.", name, why_not)


def _custom_loop_fallback(active: _Activation, tf_function, args, kwargs) -> bool:
    """The float32 fallback for a custom loop's step (as ``fit``'s,
    ``tfamp.keras.fallback``): the first inf/nan op of the step, on this call's
    batch, at loss scale 1 is found, its layer is kept float32 and the search
    repeats, up to ``fallback.MAX_MOVED`` layers. Where every value is then finite,
    the layers join the process's ``keep_fp32``: every function is rewritten
    again before it next runs. Returns whether layers moved; one line says what
    moved, or why nothing can (then the watch stops: ``_custom_loop_watch``).

    Asked before the loop's first step where the start scale's check found the
    float16 step inf at every scale it tried, and later by the watch on skipped
    steps in a row: such an overflow skips every step (the scale halving to its
    floor) and the loop prints NaN losses where float32 trains.
    """
    import dataclasses

    from tfamp.keras import fallback, overflow_locator

    who = f"custom loop step {getattr(tf_function, '__name__', 'step')!r}"
    watch = active.loop_watch
    if not _locatable(args, kwargs):
        watch.stop("its arguments are not all arrays or tensors, which the search for the "
                   "op needs (an iterator, a Python value)", who)
        return False
    try:
        concrete = tf_function.get_concrete_function(*args, **kwargs)  # (traced: cached)
        elsewhere = _talks_to_other_workers(concrete)
    except Exception:  # noqa: BLE001 (not known: as if it did)
        elsewhere = True
    if elsewhere:  # (every worker must move alike, at one step: left to the user)
        watch.stop("it runs under a multi-worker tf.distribute strategy, whose workers "
                   "would have to decide together", who)
        return False
    step = getattr(tf_function, "python_function", tf_function)
    config = active.config
    try:
        with overflow_locator.step_locator(step, args, kwargs) as locate:
            decision = fallback.decide_with(locate, config,
                                            room=fallback.MAX_MOVED - len(watch.moved))
        if decision.kind == fallback.MOVED:
            decision = dataclasses.replace(decision, repaired=(
                fallback.reset_moving_statistics(locate.written)))
    except Exception as err:  # noqa: BLE001 (the loop runs as it would have; said here)
        watch.stop(f"looking for the op that overflows failed ({type(err).__name__}: "
                   f"{err})", who)
        return False
    watch.record(decision)
    if decision.kind == fallback.NOT_FOUND:
        log.info("tfamp: %s skips steps, but its float16 step is finite at loss scale 1 on "
                 "this batch: loss scaling's to fix.", who)
        return False
    if decision.kind != fallback.MOVED:
        log.warning("%s", fallback.stopped_message(who, decision))
        return False
    active.config = config.replace(keep_fp32=(*config.keep_fp32, *decision.patterns))
    log.warning("%s", fallback.moved_message(who, active.config, decision))
    return True


def _locatable(args, kwargs) -> bool:
    import numpy as np
    import tensorflow as tf

    # The trace's inputs must be exactly these leaves (a distributed batch's are its
    # replicas' tensors; a Python value would be a constant of the trace).
    # (A variable argument is bound to its handle where the locator runs the step.)
    return all(isinstance(leaf, (np.ndarray, tf.Tensor, tf.Variable))
               for leaf in tf.nest.flatten((args, kwargs), expand_composites=True))


# A custom loop's watch reads the skipped-step counter after the 2nd call of its
# step, then after twice as many calls each time up to one read every CHECK_EVERY
# calls (a host read waits for the device: not every step; the first reads see an
# overflow from the first step early); once a read finds skipped steps it reads
# after every call until one is applied, and it looks for an op to move once
# LOOK_AFTER steps in a row were skipped (doubled after each look that found
# nothing at loss scale 1: dynamic scaling's own skips are 1-2 in a row).
FIRST_READ = 2
CHECK_EVERY = 16
LOOK_AFTER = 4


class _LoopWatch:
    """A custom loop's float32 fallback after its start (``_custom_loop_watch``)."""

    def __init__(self):
        self.steps: set[int] = set()  # ids of the tf.functions whose traces scaled a tape
        self.others: set[int] = set()  # ids of those whose traces did not
        self.since_read = 0  # calls of a step since the last read
        self.every = FIRST_READ  # calls between reads now
        self.skipped = 0  # the counter at the last read
        self.in_a_row = 0  # steps known skipped in a row, up to the last read
        self.look_after = LOOK_AFTER
        self.moved: tuple[str, ...] = ()
        self.stopped = ""

    def due(self) -> bool:
        """After a call of a step: is it time to read the counter?"""
        self.since_read += 1
        return self.since_read >= self.every

    def observe(self, skipped: int) -> bool:
        """The counter read now: is it time to look for an op to move?

        Every call since the last read skipped: they extend the run of skipped
        steps. Some did: they are counted as if they ended the window (an overflow
        that began in it; a look costs one probe, and one that finds nothing
        doubles the wait), and the next reads come after every call, each telling
        one more step. None did: the run is over, and twice as many calls to the
        next read, up to CHECK_EVERY.
        """
        calls, self.since_read = self.since_read, 0
        rise, self.skipped = skipped - self.skipped, skipped
        if rise >= calls:
            self.in_a_row += rise
        else:
            self.in_a_row = rise
        self.every = 1 if rise > 0 else min(CHECK_EVERY, max(FIRST_READ, 2 * self.every))
        return self.in_a_row >= self.look_after

    def record(self, decision) -> None:
        from tfamp.keras import fallback

        if decision.kind == fallback.MOVED:
            self.moved = (*self.moved, *decision.patterns)
            self.look_after = LOOK_AFTER
        elif decision.kind == fallback.NOT_FOUND:
            self.look_after *= 2
        else:
            self.stopped = decision.kind
        self.in_a_row = 0

    def stop(self, why: str, who: str) -> None:
        self.stopped = why
        log.warning("tfamp: no float32 fallback on %s: %s; the loop runs as rewritten. "
                    "The start-scale line names the fix where it found an overflow; "
                    "TFAMP_KEEP_FP32=<layer scope> keeps a layer float32.", who, why)


def _outermost_graph():
    import tensorflow as tf

    graph = tf.compat.v1.get_default_graph()
    while getattr(getattr(graph, "outer_graph", None), "building_function", False):
        graph = graph.outer_graph
    return graph


def _is_step(active: _Activation, tf_function, args, kwargs) -> bool:
    """Is `tf_function` a custom loop's step (its trace for these arguments scaled a
    tape with the process scale)? Asked once per function, after a tape was scaled."""
    if not active.scaled_graphs:
        return False  # (asked again after the first scaled trace)
    watch = active.loop_watch
    try:
        graph = tf_function.get_concrete_function(*args, **kwargs).graph  # (cached)
    except Exception:  # noqa: BLE001 (not known: not watched)
        graph = None
    step = graph is not None and graph in active.scaled_graphs
    (watch.steps if step else watch.others).add(id(tf_function))
    return step


def _forward_overflowed(state, outputs) -> bool:
    """After skipped steps in a row: is this a forward pass's overflow, which no loss
    scale fixes, rather than dynamic scaling halving from too high a start (a step
    that reads an iterator starts at 2^15 and may skip several)? Yes where a float
    value the step returned (its loss, usually) is inf/nan, or where the scale is at
    its floor, as ``fit``'s fallback asks (its logs' inf/nan, or the floor)."""
    import numpy as np
    import tensorflow as tf

    for value in tf.nest.flatten(outputs, expand_composites=True):
        if (isinstance(value, tf.Tensor) and value.dtype.is_floating
                and not np.all(np.isfinite(value.numpy()))):
            return True
    return float(state.current_loss_scale.numpy()) <= state.min_scale


def _custom_loop_watch(active: _Activation, tf_function, args, kwargs, outputs) -> None:
    """After each eager call of a function ``TFAMP_ENABLE`` rewrote: where it is a
    custom loop's step (``_is_step``), read the skipped-step counter when
    ``_LoopWatch`` says so; after LOOK_AFTER or more skipped steps in a row, where
    a forward pass overflowed (``_forward_overflowed``), ``_custom_loop_fallback``
    looks on this call's batch. Where layers moved and the scale is dynamic from an
    automatic start, the start scale is found again for the step as it now runs
    (the skips halved it towards its floor; a fixed scale, or a start the user set,
    keeps its value)."""
    watch = active.loop_watch
    key = id(tf_function)
    if key not in watch.steps and (key in watch.others or not _is_step(active, tf_function,
                                                                       args, kwargs)):
        return
    if watch.stopped or not watch.due():
        return
    state = _scale_state(active)
    if not watch.observe(int(state.skipped_steps.numpy())):
        return
    if not _forward_overflowed(state, outputs):
        watch.in_a_row = 0  # (gradients that overflow at this scale: the scale's to fix)
        return
    settings = active.settings
    if (_custom_loop_fallback(active, tf_function, args, kwargs)
            and settings.loss_scale == "dynamic" and settings.initial_scale == "auto"):
        from tfamp.keras import calibrate

        try:
            calibrate.calibrate_step(tf_function, args, kwargs)
        except Exception as err:  # noqa: BLE001 (dynamic scaling grows it back; said)
            log.info("tfamp: after the float32 fallback, no start loss scale from the "
                     "step's gradients (%s: %s); dynamic scaling grows it back from its "
                     "floor.", type(err).__name__, err)


def _no_probe_reason(concrete, args, kwargs) -> str:
    """Why the start-scale probe must not run this step now, or ""."""
    import collections.abc

    import tensorflow as tf

    for leaf in tf.nest.flatten((args, kwargs)):
        if isinstance(leaf, (tf.data.Iterator, tf.data.Dataset, tf.distribute.DistributedDataset,
                             tf.distribute.DistributedIterator, collections.abc.Iterator)):
            return ("it reads its batches from an iterator or a dataset, which a probe "
                    "would advance")
    # One machine's strategy (MirroredStrategy: a distributed batch, the step
    # calling strategy.run) is probed as calibrate_loss_scale probes it. Workers
    # must all probe, at one time, to agree on one scale: a step whose graph
    # talks to other workers is left to the user.
    if _talks_to_other_workers(concrete):
        return ("it runs under a multi-worker tf.distribute strategy; call "
                "calibrate_loss_scale on every worker")
    return ""


def _talks_to_other_workers(concrete) -> bool:
    """A collective op of the step placed on a job other than this process's
    ("localhost"): a multi-worker strategy (MirroredStrategy's on one machine are
    /job:localhost)."""
    from tensorflow.python.framework import device_spec

    graph_def = concrete.graph.as_graph_def()
    nodes = [*graph_def.node, *(n for f in graph_def.library.function for n in f.node_def)]
    for node in nodes:
        if node.op.startswith("Collective") and node.device:
            job = device_spec.DeviceSpecV2.from_string(node.device).job
            if job not in (None, "localhost"):
                return True
    return False


def _scaled_elsewhere(active: _Activation) -> bool:
    """True where the process-wide custom-loop scale must stand aside: a Keras train
    step whose optimizer scales the loss itself, or an enabled model's train step
    (its own scale owns every tape and update there: ``step_scope.train_step_scope``)."""
    if getattr(active.no_tape_scaling, "on", False):
        return True
    from tfamp.keras import step_scope

    if step_scope.current_probe() is not None:  # the start-scale probe: tape.py records
        return True
    return step_scope.current_step() is not None


def _optimizer_classes():
    """tf_keras's optimizer base (Keras 3's is patched at ``apply``, below)."""
    try:
        import tf_keras
    except ImportError:
        return []
    return [tf_keras.optimizers.Optimizer]


def _keras3_optimizer_class():
    """Keras 3's optimizer base on the TensorFlow backend, or None."""
    try:
        import keras
    except ImportError:
        return None
    if (not getattr(keras, "__version__", "0").startswith("3")
            or keras.backend.backend() != "tensorflow"):
        return None
    return keras.optimizers.Optimizer


def _patch_keras3_apply(active: _Activation) -> None:
    """Custom loops on Keras 3 optimizers: ``apply`` (``apply_gradients`` calls it).

    A step whose gradients are not finite on some replica is skipped on every
    replica (the flags are all-reduced), weights and slots untouched and
    ``iterations`` not advanced (Keras 3's own loss-scale optimizer's rule);
    the process-wide scale adapts once per step.
    """
    optimizer_class = _keras3_optimizer_class()
    if optimizer_class is None:
        return
    import keras

    from tfamp.keras import scale_update, step_scope

    original = optimizer_class.apply

    @functools.wraps(original)
    def apply(self, grads, trainable_variables=None):
        if (_scaled_elsewhere(active)
                or isinstance(self, keras.optimizers.LossScaleOptimizer)
                or getattr(self, step_scope.INNER_MARK, False)):
            return original(self, grads, trainable_variables)
        _tell_if_eager(active)
        step_scope.take_process_scaled()  # checked here
        scale_update.apply_keras3_if_finite(self, original, grads, trainable_variables,
                                            functools.partial(_update_process_scale, active),
                                            skipped_steps=_scale_state(active).skipped_steps)
        return None

    optimizer_class.apply = apply


def _patch_apply_gradients(active: _Activation, optimizer_class) -> None:
    original = optimizer_class.apply_gradients

    @functools.wraps(original)
    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        if (_scaled_elsewhere(active) or _is_loss_scale_optimizer(self)
                or getattr(self, "_is_wrapped_by_loss_scale_optimizer", False)):
            return original(self, grads_and_vars, *args, **kwargs)
        _tell_if_eager(active)
        from tfamp.keras import scale_update, step_scope

        step_scope.take_process_scaled()  # checked here
        return scale_update.apply_gradients_if_finite(
            self, original, grads_and_vars, args, kwargs,
            functools.partial(_update_process_scale, active),
            skipped_steps=_scale_state(active).skipped_steps)

    optimizer_class.apply_gradients = apply_gradients


def _tell_if_eager(active: _Activation) -> None:
    """One line, the first time a custom loop applies gradients eagerly that an
    eager tape computed (float32). Gradients of a traced function applied eagerly
    (the tensorflow/docs walkthrough with its ``grad`` decorated) were computed in
    mixed precision and scaled there; their eager update still skips a non-finite
    step and adapts the scale: nothing to say."""
    if active.told_eager or active.loss_tape_traced:
        return
    import tensorflow as tf

    if not tf.executing_eagerly():
        return
    active.told_eager = True
    log.warning("tfamp: a training step applies gradients eagerly (outside any tf.function), "
                "so it runs in float32: tfamp rewrites traced graphs, and eager code runs as "
                "written. Decorate the training step with @tf.function to train it in mixed "
                "precision%s.", "" if active.settings.loss_scale is None
                else " (its loss is then scaled too)")


def _update_process_scale(active: _Activation, flags, *, count_skipped: bool = True) -> None:
    """The custom-loop (process-wide) scale after a step with gradient `flags`."""
    _scale_state(active).update_from_flags(flags, count_skipped=count_skipped)


def _is_loss_scale_optimizer(optimizer) -> bool:
    return "LossScaleOptimizer" in type(optimizer).__name__


_state_lock = threading.Lock()


def _scale_state(active: _Activation):
    with _state_lock:
        return _make_scale_state(active)


def _make_scale_state(active: _Activation):
    if active.scale_state is None:
        from tfamp.keras.scale_state import DEFAULT_INITIAL_SCALE, ScaleState

        initial = active.settings.initial_scale
        # "auto": a custom loop calls tfamp.calibrate_loss_scale (it has no first fit)
        active.scale_state = ScaleState.for_setting(
            active.settings.loss_scale,
            DEFAULT_INITIAL_SCALE if initial == "auto" else initial)
    return active.scale_state


def process_scale_state():
    """TFAMP_ENABLE's custom-loop scale state (None when tfamp is not active or does
    not scale)."""
    if _active is None or _active.settings.loss_scale is None:
        return None
    return _scale_state(_active)


# -- telling the user -------------------------------------------------------------

def _note_hardware() -> None:
    import tensorflow as tf

    fast = []
    for gpu in tf.config.list_physical_devices("GPU"):
        capability = tf.config.experimental.get_device_details(gpu).get("compute_capability")
        if capability and tuple(capability) >= (7, 0):
            fast.append(gpu.name)
    if not fast:
        # Once per user and machine (a marker file): the fact does not change between
        # runs, and a line on every run buries the lines that do. Later runs: DEBUG.
        first = _first_time("no_fast_gpu")
        (log.warning if first else log.debug)(
            "tfamp: no GPU with fast 16-bit math (CUDA compute capability 7.0+) is visible, "
            "so 16-bit ops will run slower here than float32 (CPUs emulate them); tfamp "
            "goes on, which is useful for checking correctness.%s",
            " (Shown once on this machine; TFAMP_VERBOSITY=2 shows it every run.)"
            if first else "")


def _first_time(notice: str) -> bool:
    """True the first time `notice` is asked about for this user (a marker file under
    ``env.user_cache_dir()``); True every time if the marker cannot be written."""
    from tfamp.env import user_cache_dir

    marker = Path(user_cache_dir()) / f"{notice}.shown"
    if marker.exists():
        return False
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    except OSError:
        pass
    return True


def quiet_exit_notice() -> None:
    """For tfamp's own commands (inspect, rewrite, diff, export, demo) run where the
    shell set TFAMP_ENABLE: the exit notice speaks of a script's training steps,
    not of them (an export saves float32 traces, which are not rewritten)."""
    if _active is not None:
        _active.quiet = True


def _exit_notice(active: _Activation) -> None:
    if active.quiet:
        return
    if getattr(sys, "last_value", None) is not None:
        return  # the script died of an uncaught exception: its traceback is the news
    _tell_custom_loop_skips(active)
    converted = sum(sum(r.converted.values()) for r in active.reports)
    if converted or active.stepped_aside or active.told_eager:
        return  # a model that stepped aside, or an eager step, was announced when it did
    from tfamp.runtime.runner import left_in_pipelines

    if not active.reports and left_in_pipelines:
        log.warning("tfamp: TFAMP_ENABLE is on but the script's only tf.functions (%s) ran "
                    "inside its tf.data pipeline, which stays float32, so nothing was "
                    "rewritten. Wrap the training step in @tf.function (Keras fit does "
                    "this unless run_eagerly=True).", ", ".join(sorted(left_in_pipelines)))
        return
    if not active.reports:
        log.warning("tfamp: TFAMP_ENABLE is on but the script traced no tf.function, so "
                    "nothing was rewritten: eager code runs as written. Wrap the training "
                    "step in @tf.function (Keras fit does this unless run_eagerly=True).")
        return
    kinds: dict[str, int] = {}
    for report in active.reports:
        for kind, count in report.kept_fp32.items():
            kinds[kind] = kinds.get(kind, 0) + count
    reasons = ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1]))
    log.warning("tfamp: TFAMP_ENABLE is on but none of the %d rewritten functions had an op "
                "that could run in %s (no allow-list op such as MatMul or Conv2D was "
                "converted%s).", len(active.reports), active.settings.config.dtype,
                f"; kept float32: {reasons}" if reasons else "")


def _tell_custom_loop_skips(active: _Activation) -> None:
    """One line at exit where the custom-loop scale skipped steps: a custom loop has
    no History to show it (fit's has ``skipped_steps``), and a skipped step is an
    update not applied (tensorflow/docs' advanced quickstart, 16 steps: one skipped
    cost the run's update a cosine of 0.88 against float32's)."""
    state = active.scale_state
    if state is None:
        return
    try:
        skipped = int(state.skipped_steps.numpy())
        scale = float(state.current_loss_scale.numpy())
    except Exception:  # noqa: BLE001 (interpreter shutdown: nothing to say)
        return
    if not skipped:
        return
    kind = "dynamic" if active.settings.loss_scale == "dynamic" else "fixed"
    moved = active.loop_watch.moved
    if moved:  # (most of those skips were the overflow the fallback then moved)
        from tfamp.numerics.nonfinite import shell_quoted

        keep = shell_quoted(",".join(active.config.keep_fp32))
        log.info("tfamp: your training loop's %s loss scale skipped %d step%s (float16 "
                 "values overflowed: those updates were not applied, most of them before "
                 "the float32 fallback kept %s float32) and ends at %g; "
                 "TFAMP_KEEP_FP32=%s keeps them float32 from the start.",
                 kind, skipped, "" if skipped == 1 else "s", ", ".join(moved), scale, keep)
        return
    if kind == "dynamic" and scale <= state.min_scale:
        # (the fallback did not move it: its own line said why)
        log.warning("tfamp: your training loop's dynamic loss scale skipped %d step%s "
                    "(those updates were not applied) and ends at its floor, %g, where a "
                    "step overflows whatever the scale: most likely an op computing in "
                    "float16 overflows (values past 65504; a NaN loss says so). "
                    "TFAMP_KEEP_FP32=<layer scope or op name> keeps it float32 (the "
                    "float32 fallback's line, or the start-scale line, names it where "
                    "found), or run with TFAMP_DTYPE=bfloat16.",
                    skipped, "" if skipped == 1 else "s", scale)
        return
    log.info("tfamp: your training loop's %s loss scale skipped %d step%s "
             "(float16 gradients overflowed: those updates were not applied) and ends "
             "at %g; %s.", kind, skipped, "" if skipped == 1 else "s", scale,
             "TFAMP_INITIAL_SCALE=<number> sets where it starts" if kind == "dynamic"
             else "TFAMP_LOSS_SCALE=dynamic adapts it")
