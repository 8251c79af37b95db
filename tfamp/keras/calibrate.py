"""``calibrate_loss_scale``: a custom loop's start scale, and its layers that overflow.

A custom loop has no ``fit`` to probe its gradients before the first step, so
the user calls ``calibrate_loss_scale(step, *batch, model=...)`` once before the
loop (under ``TFAMP_ENABLE`` the start-up hook calls ``calibrate_step`` itself).
The step runs once in probe mode (``start_scale.probe_step``: float32, nothing
applied, what it writes restored) and its scale owner takes the scale found.

**An enabled model's layers that overflow float16.** The start scale is then
checked on the step as it runs 16-bit: under ``TFAMP_ENABLE`` the whole step's
rewrite; for a model ``tfamp.enable`` rewrote (only its call is 16-bit in a
custom loop) the probe's trace rewritten with the model's config, everything
outside the model kept float32 (``call_scopes.outside_pattern``). Where that
check overflows at every scale (a forward pass past 65504, which skips every
step and makes the loop print NaN), the enabled model's layers are moved as
``fit``'s float32 fallback moves them (``fallback.decide_with`` on the step at
loss scale 1, ``lifecycle.apply_fallback``), before the user's step is traced:
a step already traced keeps the call it traced (tfamp cannot retrace a plain
``tf.function``). Only the model's own layers move (``call_scopes.in_model``: a scope pattern
for "sequential" also matches another model's "sequential_1"); a step of several
enabled models is calibrated once per model. Under ``TFAMP_ENABLE`` the start-up hook
does the moving
(``runtime.startup``). Not under a tf.distribute strategy: the check runs on
one device's batch.
"""

from __future__ import annotations

import logging

import tensorflow as tf

from tfamp.keras import call_scopes, fallback, step_scope
from tfamp.keras.start_scale import StartScale, probe_step

log = logging.getLogger("tfamp")


def calibrate_loss_scale(step, *args, model=None, strategy=None, **kwargs) -> StartScale:
    """Sets the start loss scale of a custom loop from its step's own gradients.

    Call it once before the loop, with the step and its first batch. The step
    runs once in float32 in probe mode (nothing is applied, variables it
    writes are restored) and the scale its tapes use is set: `model`'s
    (an enabled model: its loss-scale optimizer or custom-loop scale) or,
    under ``TFAMP_ENABLE``, the process-wide custom-loop scale.

    With an enabled float16 `model`, the scale is checked on the step with the
    model's call 16-bit; where that overflows at every scale (a layer whose
    float16 values pass 65504, which would skip every step), that layer is kept
    float32, as ``fit``'s fallback does, and said in one line. Call it before
    the step's first run: a step already traced keeps the call it traced.

    Under a tf.distribute strategy, call it on every worker with the batch it
    read: the step (which calls ``strategy.run`` itself) runs once, and every
    worker sets the one scale the largest value of all of them gives.

    Args:
      step: the training step, a Python function or a tf.function.
      *args, **kwargs: its arguments for one batch.
      model: the enabled model whose scale the step uses (None: TFAMP_ENABLE's).
      strategy: the strategy the step distributes with (default: the model's,
        else the one in scope).

    Returns:
      the StartScale (also logged).

    Example:
      >>> tfamp.enable(model)
      >>> tfamp.calibrate_loss_scale(train_step, x[:32], y[:32], model=model)
      >>> for x_batch, y_batch in data: train_step(x_batch, y_batch)
    """
    return calibrate_step(step, args, kwargs, model=model, strategy=strategy)


def calibrate_step(step, args: tuple, kwargs: dict, *, model=None,
                   strategy=None) -> StartScale:
    """``calibrate_loss_scale`` with the step's arguments as they were passed (a step
    may take keyword arguments named ``model`` or ``strategy``)."""
    from tfamp.keras.range_probe import state_variables

    lifecycle = getattr(model, "_tfamp_state", None) if model is not None else None
    owner = _custom_loop_owner(model, lifecycle)
    if strategy is None:
        strategy = (lifecycle.strategy() if lifecycle is not None
                    else tf.distribute.get_strategy())
    python_step = getattr(step, "python_function", step)
    # Under TFAMP_ENABLE the step runs rewritten whole, as the probe's trace of it
    # can be: the scale is checked on that trace's rewrite. Without it only an
    # enabled model's call is rewritten (a nested function, whose backward is
    # 16-bit wherever its forward is): checked on the trace rewritten with the
    # model's config, the rest kept float32.
    process = step_scope.process_config()

    def probe() -> StartScale:
        check = process if process is not None else enabled_call_config(model, lifecycle)
        return probe_step(python_step, args, kwargs,
                          extra_state=state_variables(model) if model is not None else [],
                          min_scale=owner.min_scale,
                          op_lists=lifecycle.float16_lists() if lifecycle is not None else None,
                          strategy=strategy, per_replica=False, check_config=check)

    found = probe()
    if (found.forward_overflow and process is None and lifecycle is not None
            and keep_overflowing_layers_fp32(python_step, args, kwargs, model, lifecycle)):
        found = probe()  # (what stays 16-bit sets the scale)
    owner.set_scale(found.scale)
    if lifecycle is not None:
        lifecycle.start_scale = found
    log.info("%s", found.message())
    return found


def enabled_call_config(model, lifecycle):
    """The AmpConfig that rewrites a trace of the user's step (the model's call
    inline) as the enabled step runs it: the model's config, with everything
    outside the model's calls kept float32. None where no check applies (no
    enabled model, bfloat16)."""
    if lifecycle is None or lifecycle.config.dtype != "float16":
        return None
    config = lifecycle.config
    return config.replace(keep_fp32=(*config.keep_fp32, call_scopes.outside_pattern(model)))


def keep_overflowing_layers_fp32(step, args, kwargs, model, lifecycle) -> bool:
    """``fit``'s float32 fallback for an enabled model in the user's own step,
    before the step runs: the first inf/nan op of the step (the model's call
    16-bit) at loss scale 1 is found, its layer kept float32, and again, up to
    ``fallback.MAX_MOVED`` layers. Returns whether layers moved (the model's
    config now keeps them float32; one line says so, or why nothing moved)."""
    from tfamp.keras.overflow_locator import step_locator

    who = f"model {model.name!r}"
    room = fallback.MAX_MOVED - len(lifecycle.fallback.moved)
    try:
        with step_locator(step, args, kwargs,
                          scope_pattern=call_scopes.pattern_for(model)) as locate:
            decision = fallback.decide_with(locate, enabled_call_config(model, lifecycle),
                                            room=room)
    except Exception as err:  # noqa: BLE001 (the loop runs as it would have; said here)
        log.warning("tfamp: %s: its float16 step overflows at every loss scale, but "
                    "looking for the layer failed (%s: %s). Keep that layer float32 "
                    "yourself (tfamp.enable(model, config=tfamp.AmpConfig(keep_fp32=[...])))"
                    " or use dtype='bfloat16'.", who, type(err).__name__, err)
        return False
    if decision.kind == fallback.MOVED:
        others = [f.layer for f in decision.findings if not call_scopes.in_model(f.layer, model)]
        if others:  # (a scope pattern can match another model: "sequential_1")
            log.warning("tfamp: %s: its float16 step overflows at every loss scale in "
                        "layer %r, which is not one of this model's: nothing moved. Call "
                        "calibrate_loss_scale with the model that layer belongs to.",
                        who, others[0])
            return False
        lifecycle.apply_fallback(decision.patterns)
        log.warning("%s", fallback.moved_message(who, lifecycle.config, decision))
        return True
    if decision.kind == fallback.NOT_FOUND:
        log.info("tfamp: %s: the start-scale check on its float16 step overflowed, but "
                 "the step is finite at loss scale 1: loss scaling's to fix.", who)
    else:
        log.warning("%s", fallback.stopped_message(who, decision))
    return False


def _custom_loop_owner(model, lifecycle):
    if model is not None:
        owner = lifecycle.scale_owner() if lifecycle is not None else None
        if owner is None:
            raise ValueError(
                f"calibrate_loss_scale needs a model tfamp.enable was called on with "
                f"loss scaling; model {getattr(model, 'name', model)!r} has none. Call "
                f"tfamp.enable(model) first (loss_scale='dynamic'), or pass model=None "
                f"under TFAMP_ENABLE=1.")
        return owner
    owner = step_scope.process_owner()
    if owner is None:
        raise ValueError(
            "calibrate_loss_scale(model=None) sets TFAMP_ENABLE's custom-loop scale, but "
            "TFAMP_ENABLE is not on (or its loss scaling is off). Pass the enabled model "
            "(model=...), or run the script with TFAMP_ENABLE=1.")
    return owner
