"""Automatic float32 fallback (issue 21.2): a layer whose float16 output overflows moves to
float32 by itself, once, with one line naming it; a float32 overflow is said and never
retried; a resumed run keeps the fallback from its first step (both Kerases)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import keras
import numpy as np
import pytest
import tf_keras

import tfamp
from tfamp.keras import fallback, lifecycle
from tfamp.numerics import nonfinite

KERASES = {"tf_keras": tf_keras, "keras3": keras}
REPO = Path(__file__).resolve().parent.parent
EPOCHS, BATCH = 10, 32


def pipeline_data(scale: float = 1000.0, n: int = 512):
    """Features up to `scale`; the target depends on them only through x / scale, plus
    noise (std 0.1), so a trained model's loss settles near 0.01 whatever its path."""
    rng = np.random.default_rng(0)
    x = rng.uniform(0, scale, size=(n, 16)).astype("float32")
    w = rng.normal(size=(16, 1)).astype("float32")
    y = np.tanh(x / scale @ w / 4) + rng.normal(scale=0.1, size=(n, 1))
    return x, y.astype("float32")


def pipeline_model(k, frozen_std: float = 30.0, batch_norm: bool = False,
                   legacy: bool = False, name: str = "pipe"):
    """A frozen projection (outputs ~2e5: inf in float16) -> x1e-5 (or a BatchNorm) ->
    a small trainable head.

    With ``frozen_std=1e10`` and inputs ~1e30 the projection overflows float32 too.
    ``legacy``: compiled with tf_keras's legacy Adam (``keras.optimizers.legacy``).
    """
    k.utils.set_random_seed(0)
    inputs = k.Input((16,))
    frozen = k.layers.Dense(32, name="frozen",
                            kernel_initializer=k.initializers.RandomNormal(stddev=frozen_std))
    frozen.trainable = False
    scale = (k.layers.BatchNormalization(name="bn") if batch_norm
             else k.layers.Rescaling(1e-5, name="rescale"))
    h = scale(frozen(inputs))
    h = k.layers.Dense(16, activation="relu", name="hidden")(h)
    model = k.Model(inputs, k.layers.Dense(1, name="head")(h), name=name)
    adam = k.optimizers.legacy.Adam if legacy else k.optimizers.Adam
    model.compile(optimizer=adam(3e-3), loss="mse")
    return model


def _fit(model, x, y, epochs=EPOCHS, **kwargs):
    return model.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, **kwargs)


def _messages(caplog, text):
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


# -- the record -------------------------------------------------------------------

def test_record_round_trips_and_refuses_what_does_not_fit():
    patterns = ("pipe/frozen/", "pipe_1/héad_1/")
    values = fallback.encode(patterns)
    assert len(values) == fallback.RECORD_LENGTH
    assert fallback.decode(values) == patterns and fallback.decode([0] * 8) == ()
    with pytest.raises(ValueError, match=r"holds 512 bytes.*need 600"):
        fallback.encode(("x" * 600,))


def test_each_model_sharing_a_record_keeps_and_reads_its_own_lines():
    # An older record's lines have no model name: every model's.
    old = fallback.encode(("pipe/frozen/",))
    assert fallback.recorded_for(old, "gan") == ("pipe/frozen/",)
    shared = fallback.record_with(old, "pipe", ("pipe/frozen/", "pipe/hidden/"))
    shared = fallback.record_with(shared, "gan", ("gan/frozen/",))
    assert fallback.decode(shared) == ("pipe\tpipe/frozen/", "pipe\tpipe/hidden/",
                                       "gan\tgan/frozen/")
    assert fallback.recorded_for(shared, "pipe") == ("pipe/frozen/", "pipe/hidden/")
    assert fallback.recorded_for(shared, "gan") == ("gan/frozen/",)
    assert fallback.recorded_for(shared, "other") == ()


# -- deciding (nothing changes) -------------------------------------------------------

@pytest.mark.parametrize("flavour", sorted(KERASES))
def test_decide_moves_the_overflowing_layer_after_checking_it_is_finite_in_float32(flavour):
    model = pipeline_model(KERASES[flavour])
    x, y = pipeline_data()
    tfamp.enable(model, verbose=False)
    before = [w.copy() for w in model.get_weights()]
    decision = fallback.decide(model, model._tfamp_state.config, (x[:BATCH], y[:BATCH], None))
    assert decision.kind == fallback.MOVED
    [pattern] = decision.patterns
    assert pattern.endswith("/") and "frozen" in pattern
    [found] = decision.findings
    assert (found.op, found.phase, found.ran_16bit) == ("MatMul", "forward", True)
    assert all(i.nonfinite == 0 for i in found.inputs)
    assert all((a == b).all() for a, b in zip(before, model.get_weights(), strict=True))


@pytest.mark.parametrize("flavour", sorted(KERASES))
def test_decide_runs_a_train_step_of_its_own(flavour):
    """A model class with its own train_step is located in that step (probe mode),
    compiled loss or not; here it wraps Keras's, so the answer is Keras's step's."""
    k = KERASES[flavour]
    plain = pipeline_model(k)

    class Wrapped(k.Model):
        steps = 0

        def train_step(self, data):
            type(self).steps += 1
            return super().train_step(data)

    model = Wrapped(plain.inputs, plain.outputs, name="pipe")
    model.compile(optimizer=k.optimizers.Adam(3e-3), loss="mse")
    x, y = pipeline_data()
    tfamp.enable(model, verbose=False)
    before = [w.copy() for w in model.get_weights()]
    decision = fallback.decide(model, model._tfamp_state.config, (x[:BATCH], y[:BATCH], None))
    assert Wrapped.steps >= 1  # traced through the model's own step
    assert decision.kind == fallback.MOVED and "frozen" in decision.patterns[0], decision
    assert all((a == b).all() for a, b in zip(before, model.get_weights(), strict=True))


def test_decide_says_a_float32_overflow_is_not_fixed_by_moving():
    model = pipeline_model(tf_keras, frozen_std=1e10)
    x, y = pipeline_data(scale=1e30)
    tfamp.enable(model, verbose=False)
    decision = fallback.decide(model, model._tfamp_state.config, (x[:BATCH], y[:BATCH], None))
    assert decision.kind == fallback.OVERFLOWS_IN_FP32 and decision.patterns == ()
    # First the Cast of the 1e30 inputs to float16; with that layer float32, its
    # MatMul still gives inf: float32's own overflow.
    first, last = decision.findings
    assert first.inserted_cast and first.keep_fp32 == "pipe/frozen/"
    assert (last.node, last.dtype, last.ran_16bit) == ("pipe/frozen/MatMul", "float32", False)
    message = fallback.stopped_message("model 'pipe'", decision)
    assert "computing in float32 too after keeping 'pipe/frozen/' float32" in message
    assert "will not retry" in message and "Expected finite values in float32" in message


def test_no_batch_here_is_not_blamed_on_another_worker():
    """A single process whose fit data cannot be re-read once said "on another replica or
    worker's batch" (a helper's Keras 3 run, session 23)."""
    here = fallback.stopped_message("model 'pipe'", fallback.FallbackDecision(fallback.NO_BATCH))
    assert "cannot be re-read" in here and "another" not in here, here
    there = fallback.stopped_message(
        "model 'pipe'", fallback.FallbackDecision(fallback.NO_BATCH, elsewhere=True))
    assert "on another replica or worker's batch" in there, there


def test_region_grows_to_the_next_layer_when_its_input_cast_overflows_and_is_capped(
        monkeypatch, caplog):
    # Exp forced to float16 overflows; with it float32, exp(12) overflows the Cast in
    # front of the head: both layers move, in one decision.
    from tests.test_nonfinite import EXP_16BIT, X, Y, overflow_model

    model = tfamp.enable(overflow_model(), config=EXP_16BIT, verbose=False)
    decision = fallback.decide(model, EXP_16BIT, (X, Y, None))
    assert decision.kind == fallback.MOVED
    assert decision.patterns == ("planted/expo/", "planted/head/")
    assert decision.findings[1].inserted_cast

    monkeypatch.setattr(fallback, "MAX_MOVED", 1)
    decision = fallback.decide(model, EXP_16BIT, (X, Y, None), room=1)
    assert decision.kind == fallback.CAP_REACHED and decision.patterns == ()
    caplog.set_level(logging.INFO, logger="tfamp")
    capped = tfamp.enable(overflow_model(), config=EXP_16BIT, verbose=False)
    capped.fit(X, Y, batch_size=4, epochs=2, verbose=0)
    [line] = _messages(caplog, "no more float32 fallback")
    assert "the most layers it moves (1)" in line and "planted/head" in line
    assert capped._tfamp_state.config.keep_fp32 == ()


# -- training -------------------------------------------------------------------------

@pytest.mark.parametrize("flavour", [*sorted(KERASES), "tf_keras_legacy"])
def test_overflowing_layer_falls_back_and_trains_like_float32(flavour, caplog, monkeypatch):
    legacy = flavour == "tf_keras_legacy"  # keras.optimizers.legacy.Adam
    k = KERASES["tf_keras" if legacy else flavour]
    x, y = pipeline_data()
    reference = pipeline_model(k, legacy=legacy)
    _fit(reference, x, y)
    want = reference.evaluate(x, y, verbose=0)

    # Without the fallback every step is skipped and the epoch's loss is NaN.
    stalled = tfamp.enable(pipeline_model(k, legacy=legacy), verbose=False)
    with monkeypatch.context() as patch:
        patch.setattr(lifecycle.ModelPrecision, "_fallback_after_call", lambda *args: False)
        history = _fit(stalled, x, y, epochs=1)
    assert np.isnan(history.history["loss"][-1])
    assert history.history["skipped_steps"][-1] == len(x) // BATCH

    caplog.set_level(logging.INFO, logger="tfamp")
    model = tfamp.enable(pipeline_model(k, legacy=legacy), verbose=False)
    history = _fit(model, x, y)
    got = model.evaluate(x, y, verbose=0)
    assert np.isfinite(got) and abs(got - want) <= 0.1 * want, (got, want)
    assert history.history["skipped_steps"][-1] <= 3
    # The start scale's check on the 16-bit step saw the overflow at every scale it
    # tried and left the scale to the fallback.
    assert "no loss scale helps" in model._tfamp_state.start_scale.checked
    [line] = _messages(caplog, "float32 fallback")
    pattern = model._tfamp_state.fallback.moved[0]
    assert "frozen" in pattern and f"now keeping '{pattern}' float32" in line
    assert f"TFAMP_KEEP_FP32='{pattern}'" in line and "AmpConfig(keep_fp32=" in line
    assert model._tfamp_state.config.keep_fp32 == (pattern,)
    record = model._tfamp_state.record_variable().numpy()
    assert fallback.decode(record) == (f"pipe\t{pattern}",)
    assert fallback.recorded_for(record, "pipe") == (pattern,)


@pytest.mark.parametrize("flavour", [*sorted(KERASES), "tf_keras_legacy"])
def test_a_train_on_batch_loop_falls_back_on_the_calls_own_batch(flavour, caplog):
    """A GAN's loop of ``train_on_batch`` calls has no fit data to re-read: the
    fallback looks at the call's own batch (it used to say "no batch" and every
    step after was skipped at the floor, nothing trained)."""
    legacy = flavour == "tf_keras_legacy"
    k = KERASES["tf_keras" if legacy else flavour]
    x, y = pipeline_data()

    def loop(model, passes=EPOCHS):
        for _ in range(passes):
            for start in range(0, len(x), BATCH):
                logs = model.train_on_batch(x[start:start + BATCH], y[start:start + BATCH],
                                            return_dict=True)
        return logs

    reference = pipeline_model(k, legacy=legacy)
    loop(reference)
    want = reference.evaluate(x, y, verbose=0)

    caplog.set_level(logging.INFO, logger="tfamp")
    model = tfamp.enable(pipeline_model(k, legacy=legacy), verbose=False)
    logs = loop(model)
    got = model.evaluate(x, y, verbose=0)
    assert np.isfinite(got) and abs(got - want) <= 0.1 * want, (got, want)
    assert float(logs["skipped_steps"]) <= 3
    [line] = _messages(caplog, "float32 fallback")
    [pattern] = model._tfamp_state.fallback.moved
    assert "frozen" in pattern and f"now keeping '{pattern}' float32" in line
    # The call's batch is not kept after the call.
    assert "_tfamp_fit_batch" not in model.__dict__


@pytest.mark.parametrize("flavour", sorted(KERASES))
def test_gradients_overflowing_at_the_start_scale_cost_no_probe(flavour, monkeypatch):
    # Targets ~1e3: the loss is finite, its float16 gradients at 2^15 are not. That
    # is the scale's to fix (it halves a few times); the fallback does not even look.
    k = KERASES[flavour]
    calls = []
    real = nonfinite.locate_nonfinite
    monkeypatch.setattr(nonfinite, "locate_nonfinite",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    k.utils.set_random_seed(0)
    x = np.random.default_rng(0).normal(size=(256, 8)).astype("float32")
    y = 1000.0 * x[:, :1]
    model = k.Sequential([k.Input((8,)), k.layers.Dense(16), k.layers.Dense(1)])
    model.compile(optimizer=k.optimizers.SGD(1e-4), loss="mse")
    # Started at 2^15 on purpose (the probed start scale would avoid the overflow).
    tfamp.enable(model, verbose=False, initial_scale=2**15)
    history = model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert history.history["skipped_steps"][-1] >= 2 and np.isfinite(history.history["loss"][-1])
    assert calls == [] and model._tfamp_state.fallback.decisions == []


@pytest.mark.parametrize("flavour", sorted(KERASES))
def test_batch_norm_statistics_the_skipped_steps_poisoned_are_reset(flavour, caplog):
    # The skipped steps' forward passes wrote inf/nan into the BatchNorm's moving
    # statistics; left so, evaluate (inference mode) would give NaN for good.
    k = KERASES[flavour]
    x, y = pipeline_data()
    reference = pipeline_model(k, batch_norm=True)
    _fit(reference, x, y)
    want = reference.evaluate(x, y, verbose=0)
    caplog.set_level(logging.INFO, logger="tfamp")
    model = tfamp.enable(pipeline_model(k, batch_norm=True), verbose=False)
    history = _fit(model, x, y)
    got = model.evaluate(x, y, verbose=0)
    assert abs(got - want) <= 0.1 * want and history.history["skipped_steps"][-1] <= 3
    bn = model.get_layer("bn")
    assert all(np.isfinite(np.asarray(v)).all() for v in bn.non_trainable_weights)
    # Only the layer that overflowed moves. (Before session 28 the locator judged a
    # rewrite of the graph without its shapes, which converts Keras 3's unfused
    # x * rsqrt(var) where the running step does not, and moved the BatchNorm too.)
    [moved] = model._tfamp_state.fallback.moved
    assert "frozen" in moved
    [line] = _messages(caplog, "float32 fallback")
    assert "non-trainable variables" in line and "moving_mean" in line


@pytest.mark.parametrize("flavour", sorted(KERASES))
def test_float32_overflow_is_said_once_and_never_rewritten_again(flavour, caplog, monkeypatch):
    calls = []
    real = nonfinite.locate_nonfinite
    monkeypatch.setattr(nonfinite, "locate_nonfinite",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    caplog.set_level(logging.INFO, logger="tfamp")
    model = tfamp.enable(pipeline_model(KERASES[flavour], frozen_std=1e10), verbose=False)
    x, y = pipeline_data(scale=1e30)
    history = _fit(model, x, y, epochs=4)  # 64 steps, all skipped
    assert history.history["skipped_steps"][-1] == 64
    [line] = _messages(caplog, "no float32 fallback")
    assert "float32 too" in line
    state = model._tfamp_state
    assert [d.kind for d in state.fallback.decisions] == [fallback.OVERFLOWS_IN_FP32]
    assert state.config.keep_fp32 == () and state.fallback.moved == ()
    assert len(model.train_function.reports) == 1  # rewritten once, never again
    # Two probes for the decision, none after; the stuck-at-floor warning (once)
    # gives the fallback's finding instead of a keep_fp32 fix that cannot help.
    assert len(calls) == 2
    [stuck] = _messages(caplog, "stuck at its floor")
    assert "float32 too" in stuck and "TFAMP_KEEP_FP32" not in stuck


def test_models_sharing_one_optimizer_keep_their_own_fallback_across_a_resume(tmp_path, caplog):
    """A Keras 2 GAN's models share one tf_keras optimizer, so one tfamp wrapper and one
    record: each model's moved layers are kept in it (the second model's used to
    overwrite the first's), and a resumed run's first train_on_batch call re-applies
    each model's own, with no step lost to the overflow again."""
    import tensorflow as tf

    x, y = pipeline_data()

    def pair():
        first = pipeline_model(tf_keras, legacy=True, name="pipe")
        second = pipeline_model(tf_keras, legacy=True, name="pipe2")
        second.compile(optimizer=first.optimizer, loss="mse")
        tfamp.enable(first, verbose=False)
        tfamp.enable(second, verbose=False)
        assert first.optimizer is second.optimizer
        return first, second

    def train(models, calls=4):
        for start in range(0, calls * BATCH, BATCH):
            for model in models:
                model.train_on_batch(x[start:start + BATCH], y[start:start + BATCH])

    first, second = pair()
    train((first, second))
    assert first._tfamp_state.fallback.moved == ("pipe/frozen/",)
    assert second._tfamp_state.fallback.moved == ("pipe2/frozen/",)
    record = first._tfamp_state.record_variable().numpy()
    assert fallback.decode(record) == ("pipe\tpipe/frozen/", "pipe2\tpipe2/frozen/")
    skipped = int(first.optimizer.skipped_steps.numpy())
    path = tf.train.Checkpoint(optimizer=first.optimizer).save(str(tmp_path / "ckpt"))

    caplog.clear()
    caplog.set_level(logging.INFO, logger="tfamp")
    first, second = pair()
    tf.train.Checkpoint(optimizer=first.optimizer).restore(path)
    train((first, second), calls=2)
    assert first._tfamp_state.config.keep_fp32 == ("pipe/frozen/",)
    assert second._tfamp_state.config.keep_fp32 == ("pipe2/frozen/",)
    assert first._tfamp_state.fallback.decisions == []  # restored, not decided again
    assert int(first.optimizer.skipped_steps.numpy()) == skipped
    lines = _messages(caplog, "float32 fallback")
    assert len(lines) == 2 and all("restored from the checkpoint" in line for line in lines)


@pytest.mark.parametrize("flavour", sorted(KERASES))
def test_resumed_run_keeps_the_fallback_from_its_first_step(flavour, tmp_path, caplog):
    k = KERASES[flavour]
    x, y = pipeline_data()

    class Interrupt(k.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 2:
                raise RuntimeError("interrupted")

    backup = str(tmp_path / "backup")
    first = tfamp.enable(pipeline_model(k), verbose=False)
    with pytest.raises(RuntimeError, match="interrupted"):
        _fit(first, x, y, callbacks=[k.callbacks.BackupAndRestore(backup), Interrupt()])
    [pattern] = first._tfamp_state.fallback.moved
    skipped_before = first._tfamp_state.read_scale()[1]

    caplog.clear()
    caplog.set_level(logging.INFO, logger="tfamp")
    resumed = tfamp.enable(pipeline_model(k), verbose=False)
    _fit(resumed, x, y, callbacks=[k.callbacks.BackupAndRestore(backup)])
    state = resumed._tfamp_state
    assert state.config.keep_fp32 == (pattern,)
    assert state.fallback.decisions == []  # re-applied from the record, not decided again
    [line] = _messages(caplog, "float32 fallback")
    assert "restored from the checkpoint" in line
    # No step of the resumed run overflowed: the first one ran the fallback graph.
    assert state.read_scale()[1] == skipped_before
    assert all(r.kept_fp32.get("user override") for r in resumed.train_function.reports)


def test_tf_train_checkpoint_carries_the_record(tmp_path):
    import tensorflow as tf

    x, y = pipeline_data()
    model = tfamp.enable(pipeline_model(tf_keras), verbose=False)
    _fit(model, x, y, epochs=1)
    [pattern] = model._tfamp_state.fallback.moved
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(
        str(tmp_path / "ckpt"))

    again = tfamp.enable(pipeline_model(tf_keras), verbose=False)
    tf.train.Checkpoint(model=again, optimizer=again.optimizer).restore(path)
    history = _fit(again, x, y, epochs=1)
    assert again._tfamp_state.config.keep_fp32 == (pattern,)
    assert history.history["skipped_steps"][-1] == model.optimizer.skipped_steps.numpy()


# -- TFAMP_ENABLE, as a user runs it ------------------------------------------------------

SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    import numpy as np
    from test_fallback import pipeline_data, BATCH, EPOCHS
    if sys.argv[1] == "tf_keras":
        import tf_keras as k
    else:
        import keras as k
    from test_fallback import pipeline_model
    x, y = pipeline_data()
    model = pipeline_model(k)
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    print(json.dumps({{"loss": float(model.evaluate(x, y, verbose=0)),
                       "skipped": float(history.history["skipped_steps"][-1])}}))
""")


@pytest.mark.parametrize("flavour", ["tf_keras", pytest.param("keras3", marks=pytest.mark.slow)])
def test_tfamp_enable_variable_falls_back_too(flavour, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT.format(tests=str(REPO / "tests")))
    environment = {k: v for k, v in os.environ.items() if not k.startswith("TFAMP_")}
    environment.update(TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(REPO), TFAMP_ENABLE="1")
    result = subprocess.run([sys.executable, str(script), flavour], capture_output=True,
                            text=True, timeout=600, env=environment, cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    import json

    got = json.loads(result.stdout.strip().splitlines()[-1])
    x, y = pipeline_data()
    reference = pipeline_model(KERASES[flavour])
    _fit(reference, x, y)
    want = reference.evaluate(x, y, verbose=0)
    assert abs(got["loss"] - want) <= 0.1 * want and got["skipped"] <= 3, (got, want)
    lines = [line for line in result.stderr.splitlines() if "float32 fallback" in line]
    assert len(lines) == 1 and "frozen" in lines[0] and "TFAMP_KEEP_FP32=" in lines[0]


# -- what a rescued run reports (issue 28.4) -------------------------------------------

def _rescued_fit(k, model, x, y):
    """3 epochs with TerminateOnNaN; (history, epochs run)."""
    history = model.fit(x, y, batch_size=BATCH, epochs=3, shuffle=False, verbose=0,
                        callbacks=[k.callbacks.TerminateOnNaN()])
    return history.history


def _check_rescued(history, want_last_loss):
    # The fallback moved the frozen layer after the first skipped steps; those steps'
    # inf/nan losses are left out of the epoch's mean, so the run is neither reported
    # as NaN nor stopped by TerminateOnNaN.
    assert len(history["loss"]) == 3, history
    assert all(np.isfinite(history["loss"])), history["loss"]
    assert 0 < history["skipped_steps"][-1] <= 3
    assert history["loss"][-1] <= 2 * want_last_loss, (history["loss"], want_last_loss)


@pytest.mark.parametrize("flavour", sorted(KERASES))
def test_rescued_run_is_not_reported_or_stopped_as_nan(flavour):
    k = KERASES[flavour]
    x, y = pipeline_data()
    reference = _rescued_fit(k, pipeline_model(k), x, y)
    model = tfamp.enable(pipeline_model(k), verbose=False)
    history = _rescued_fit(k, model, x, y)
    assert model._tfamp_state.fallback.moved
    _check_rescued(history, reference["loss"][-1])


def test_an_epoch_with_every_step_skipped_still_ends_in_nan():
    # Nothing trained in it: its metrics received nothing, and an empty mean (0) would
    # claim a perfect loss. (The per-batch logs show the empty mean, so TerminateOnNaN
    # does not see a NaN per batch; the epoch's History does.)
    model = tfamp.enable(pipeline_model(keras), verbose=False)
    x, y = pipeline_data()
    state = model._tfamp_state
    state.fallback.stopped = "planted"  # no fallback: every step skipped
    history = _fit(model, x, y, epochs=1)
    assert history.history["skipped_steps"][-1] == len(x) // BATCH
    assert np.isnan(history.history["loss"][-1])


RESCUED_SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    from test_fallback import pipeline_data, pipeline_model, _rescued_fit
    if sys.argv[1] == "tf_keras":
        import tf_keras as k
    else:
        import keras as k
    x, y = pipeline_data()
    print(json.dumps(_rescued_fit(k, pipeline_model(k), x, y)))
""")


@pytest.mark.parametrize("flavour", ["keras3", pytest.param("tf_keras", marks=pytest.mark.slow)])
def test_rescued_run_under_tfamp_enable_is_not_reported_or_stopped_as_nan(flavour, tmp_path):
    import json

    script = tmp_path / "rescued.py"
    script.write_text(RESCUED_SCRIPT.format(tests=str(REPO / "tests")))
    environment = {k: v for k, v in os.environ.items() if not k.startswith("TFAMP_")}
    environment.update(TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(REPO), TFAMP_ENABLE="1")
    result = subprocess.run([sys.executable, str(script), flavour], capture_output=True,
                            text=True, timeout=600, env=environment, cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    history = json.loads(result.stdout.strip().splitlines()[-1])
    k = KERASES[flavour]
    x, y = pipeline_data()
    reference = _rescued_fit(k, pipeline_model(k), x, y)
    _check_rescued(history, reference["loss"][-1])
