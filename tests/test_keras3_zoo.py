"""tfamp.enable on the Keras 3 model zoo: fit / evaluate / predict converge like float32.

The same data as tests/test_zoo_training.py and tests/test_enable_zoo.py (there
tf_keras), with the models built in Keras 3 (``import keras``). One fast float16
case per default run (the MLP); every model in both dtypes with ``-m slow``.
"""

import keras
import numpy as np
import pytest
from keras import layers as L

import tfamp
from tests.test_zoo_training import SEED, _expect_converted, _make_data
from tfamp.keras.loss_scale3 import LossScaleOptimizer

EPOCHS = 6
REL_TOL = 0.05


def build(kind: str):
    """(Keras 3 model, loss) with deterministic initial weights."""
    keras.utils.set_random_seed(SEED)
    mse = keras.losses.MeanSquaredError()
    if kind == "mlp":
        return keras.Sequential([keras.Input((16,)), L.Dense(64, activation="relu"),
                                 L.Dense(64, activation="relu"), L.Dense(1)]), mse
    if kind == "cnn":
        return keras.Sequential([
            keras.Input((12, 12, 1)),
            L.Conv2D(16, 3, padding="same"), L.BatchNormalization(momentum=0.9), L.ReLU(),
            L.MaxPooling2D(2),
            L.Conv2D(16, 3, padding="same"), L.BatchNormalization(momentum=0.9), L.ReLU(),
            L.Flatten(), L.Dropout(0.1), L.Dense(4),
        ]), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    if kind == "lstm":
        return keras.Sequential([keras.Input((10, 4)), L.LSTM(32), L.Dense(1)]), mse
    if kind == "gru":
        return keras.Sequential([keras.Input((10, 4)), L.GRU(32), L.Dense(1)]), mse
    if kind == "transformer":
        inputs = keras.Input((8, 16))
        attention = L.MultiHeadAttention(num_heads=2, key_dim=8)(inputs, inputs)
        h = L.LayerNormalization()(inputs + attention)
        ff = L.Dense(16)(L.Dense(32, activation="relu")(h))
        h = L.LayerNormalization()(h + ff)
        outputs = L.Dense(1)(L.GlobalAveragePooling1D()(h))
        return keras.Model(inputs, outputs), mse
    raise ValueError(kind)


def expect_converted(kind: str, report) -> None:
    """As for tf_keras, except Keras 3's BatchNormalization: it computes moments
    with ordinary ops (no FusedBatchNormV3)."""
    if kind != "cnn":
        _expect_converted(kind, report)
        return
    converted = report.converted
    assert converted.get("Conv2D", 0) == 2, converted
    for op in ("Conv2DBackpropFilter", "MatMul"):
        assert converted.get(op, 0) >= 1, (op, converted)


def fit(kind: str, dtype: str | None):
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


FAST = (("mlp", "float16"),)  # CNN+BatchNorm float16 takes ~18 s: slow set
CASES = [pytest.param(*case) for case in FAST] + [
    pytest.param(kind, dtype, marks=pytest.mark.slow)
    for kind in ("mlp", "cnn", "lstm", "gru", "transformer")
    for dtype in ("float16", "bfloat16")
    if (kind, dtype) not in FAST
]


@pytest.mark.parametrize("kind, dtype", CASES)
def test_keras3_enable_fit_evaluate_predict_match_float32(kind, dtype):
    _, reference, want_eval, want_pred = fit(kind, None)
    model, history, got_eval, got_pred = fit(kind, dtype)
    print(f"[keras3 zoo] {kind} {dtype}: val loss fp32 {want_eval:.5f} vs {got_eval:.5f} "
          f"({100 * (got_eval - want_eval) / want_eval:+.2f}%); "
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
        assert isinstance(model.optimizer, LossScaleOptimizer)
        assert history["loss_scale"][-1] >= 1.0
    else:
        assert "loss_scale" not in history
