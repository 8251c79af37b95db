"""tfamp.enable on the model zoo, in tf_keras and Keras 3: fit / evaluate / predict
converge like float32.

Same data as test_zoo_training (there via tfamp.function on a custom step; here
through Keras fit with tfamp's loss scaling), the models built in each Keras.
A few fast float16 cases per default run; every model in both dtypes and both
Kerases with ``-m slow``.
"""

import functools

import keras as keras3
import numpy as np
import pytest
import tf_keras

import tfamp
from tests.test_zoo_training import _build, _expect_converted, _make_data
from tfamp.keras.optimizer_keras3 import LossScaleOptimizer as Keras3LossScaleOptimizer

EPOCHS = 6
REL_TOL = 0.05
KINDS = ("mlp", "cnn", "lstm", "gru", "transformer")


def expect_converted_keras3(kind: str, report) -> None:
    """As for tf_keras, except Keras 3's BatchNormalization: it computes moments
    with ordinary ops (no FusedBatchNormV3)."""
    if kind != "cnn":
        _expect_converted(kind, report)
        return
    converted = report.converted
    assert converted.get("Conv2D", 0) == 2, converted
    for op in ("Conv2DBackpropFilter", "MatMul"):
        assert converted.get(op, 0) >= 1, (op, converted)


# flavour -> (Keras module, model builder, expected conversions, tfamp's loss-scale optimizer)
FLAVOURS = {
    "tf_keras": (tf_keras, _build, _expect_converted, tfamp.LossScaleOptimizer),
    "keras3": (keras3, functools.partial(_build, keras=keras3), expect_converted_keras3,
               Keras3LossScaleOptimizer),
}


def fit(flavour: str, kind: str, dtype: str | None):
    keras, build, _, _ = FLAVOURS[flavour]
    x, y = _make_data(kind, 1024, seed=1)
    x_val, y_val = _make_data(kind, 256, seed=2)
    model, loss = build(kind)
    model.compile(optimizer=keras.optimizers.Adam(3e-3), loss=loss)
    if dtype is not None:
        tfamp.enable(model, dtype=dtype)
    history = model.fit(x, y, epochs=EPOCHS, batch_size=64, shuffle=False, verbose=0,
                        validation_data=(x_val, y_val))
    return (model, history.history, model.evaluate(x_val, y_val, verbose=0),
            model.predict(x_val[:64], verbose=0))


# (Keras 3's CNN+BatchNorm float16 takes ~18 s: slow set)
FAST = (("tf_keras", "mlp", "float16"), ("tf_keras", "cnn", "float16"),
        ("keras3", "mlp", "float16"))
CASES = [pytest.param(*case) for case in FAST] + [
    pytest.param(flavour, kind, dtype, marks=pytest.mark.slow)
    for flavour in FLAVOURS for kind in KINDS for dtype in ("float16", "bfloat16")
    if (flavour, kind, dtype) not in FAST
]


@pytest.mark.parametrize("flavour, kind, dtype", CASES)
def test_enable_fit_evaluate_predict_match_float32(flavour, kind, dtype):
    _, _, expect_converted, loss_scale_optimizer = FLAVOURS[flavour]
    _, reference, want_eval, want_pred = fit(flavour, kind, None)
    model, history, got_eval, got_pred = fit(flavour, kind, dtype)
    print(f"[enable zoo] {flavour} {kind} {dtype}: val loss fp32 {want_eval:.5f} vs "
          f"{got_eval:.5f} ({100 * (got_eval - want_eval) / want_eval:+.2f}%); "
          f"first/last train loss {history['loss'][0]:.4f}/{history['loss'][-1]:.4f}")
    assert history["loss"][-1] < 0.6 * history["loss"][0], "training should converge"
    assert got_eval == pytest.approx(want_eval, rel=REL_TOL)
    assert history["val_loss"][-1] == pytest.approx(reference["val_loss"][-1], rel=REL_TOL)
    assert got_pred.dtype == np.float32 and got_pred.shape == want_pred.shape
    assert not np.array_equal(got_pred, want_pred)  # 16-bit math ran
    expect_converted(kind, model.train_function.reports[0])
    assert model.predict_function.reports[0].converted
    assert all(w.dtype == "float32" for w in model.weights)
    if dtype == "float16":
        assert isinstance(model.optimizer, loss_scale_optimizer)
        assert history["loss_scale"][-1] >= 1.0
    else:
        assert "loss_scale" not in history
