"""The XLA program of an enabled Keras 3 step: apply-or-skip compiles to selects.

XLA's conditional simplifier turns a two-branch conditional into selects when
both branches hold only element-wise or cheap instructions and neither is
empty. Under XLA:GPU a conditional left in the step copies its predicate to the
host and waits for it once per step. The CPU compiler runs the same pass, so
the optimized CPU program shows what tfamp's step leaves there (the H100
program, compiled without a GPU, agrees: BUILD_NOTES.md, session 12).
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfamp


def _entry_conditionals(hlo_text: str) -> int:
    """Conditionals in the ENTRY computation of an HLO module's text."""
    lines = hlo_text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("ENTRY "))
    count = 0
    for line in lines[start + 1:]:
        if line.startswith("}"):
            break
        count += " conditional(" in line
    return count


def _model(optimizer: str):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((8, 8, 3)),
        keras.layers.Conv2D(8, 3, padding="same"),
        keras.layers.BatchNormalization(),
        keras.layers.ReLU(),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(4),
    ])
    opt = {"momentum": keras.optimizers.SGD(0.01, momentum=0.9),
           "adam": keras.optimizers.Adam(1e-3)}[optimizer]
    model.compile(optimizer=opt,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=True)
    return model


def _data():
    rng = np.random.default_rng(0)
    return (rng.normal(size=(8, 8, 8, 3)).astype("float32"),
            rng.integers(0, 4, size=(8,)).astype("int32"))


def _optimized_step_hlo(step, *args) -> str:
    return step.experimental_get_compiler_ir(*args)(stage="optimized_hlo")


def _fit_step_hlo(model) -> str:
    x, y = _data()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    function = model.train_function
    step = (getattr(function, "rewritten", None) or [None])[0]
    assert step is not None, "the train function was not rewritten"
    data = (tf.constant(x), tf.constant(y))
    return _optimized_step_hlo(step, data)


@pytest.mark.parametrize("optimizer", ["momentum", "adam"])
def test_enabled_fit_step_compiles_without_a_conditional(optimizer):
    model = _model(optimizer)
    tfamp.enable(model, verbose=False, initial_scale=2.0**8)
    hlo = _fit_step_hlo(model)
    assert " f16[" in hlo  # the step was rewritten
    assert _entry_conditionals(hlo) == 0


def test_custom_xla_step_of_an_enabled_model_compiles_without_a_conditional():
    model = _model("momentum")
    tfamp.enable(model, verbose=False, initial_scale=2.0**8)
    optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function(jit_compile=True)
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    x, y = (tf.constant(a) for a in _data())
    before = [w.numpy().copy() for w in model.trainable_weights]
    step(x, y)
    assert any(not np.array_equal(b, w.numpy())
               for b, w in zip(before, model.trainable_weights, strict=True))
    assert _entry_conditionals(_optimized_step_hlo(step, x, y)) == 0


def test_a_skipped_step_is_counted_once_and_changes_nothing():
    """The skip branch counts the step: one count per skipped step, not two."""
    model = _model("momentum")
    tfamp.enable(model, verbose=False, initial_scale=2.0**8)
    x, y = _data()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    weights = [w.numpy().copy() for w in model.weights]
    slots = [v.numpy().copy() for v in model.optimizer.inner_optimizer.variables]
    bad = x.copy()
    bad[0, 0, 0, 0] = np.inf
    history = model.fit(bad, y, batch_size=8, epochs=1, verbose=0)
    assert int(model.optimizer.skipped_steps.numpy()) == 1
    assert history.history["skipped_steps"][-1] == 1
    for before, w in zip(weights, model.weights, strict=True):
        if "moving" not in w.path:  # BatchNorm's moving statistics see the forward pass
            np.testing.assert_array_equal(before, w.numpy(), err_msg=w.path)
    for before, v in zip(slots, model.optimizer.inner_optimizer.variables, strict=True):
        np.testing.assert_array_equal(before, v.numpy(), err_msg=v.path)
