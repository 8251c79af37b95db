"""tfamp.enable on the model zoo: fit / evaluate / predict converge like float32.

Same models and data as test_zoo_training (there via tfamp.function on a custom
step; here through Keras fit with tfamp's loss scaling). One fast float16 case
per default run; every model in both dtypes with ``-m slow``.
"""

import numpy as np
import pytest
import tf_keras as keras

import tfamp
from tests.test_zoo_training import _build, _expect_converted, _make_data

EPOCHS = {"mlp": 6, "cnn": 6, "lstm": 6, "gru": 6, "transformer": 6}
REL_TOL = 0.05


def _fit(kind: str, dtype: str | None):
    x, y = _make_data(kind, 1024, seed=1)
    x_val, y_val = _make_data(kind, 256, seed=2)
    model, loss = _build(kind)
    model.compile(optimizer=keras.optimizers.Adam(3e-3), loss=loss)
    if dtype is not None:
        tfamp.enable(model, dtype=dtype)
    history = model.fit(x, y, epochs=EPOCHS[kind], batch_size=64, shuffle=False, verbose=0,
                        validation_data=(x_val, y_val))
    return model, history.history, model.evaluate(x_val, y_val, verbose=0), \
        model.predict(x_val[:64], verbose=0)


CASES = [pytest.param("mlp", "float16"), pytest.param("cnn", "float16")] + [
    pytest.param(kind, dtype, marks=pytest.mark.slow)
    for kind in ("mlp", "cnn", "lstm", "gru", "transformer")
    for dtype in ("float16", "bfloat16")
    if (kind, dtype) not in (("mlp", "float16"), ("cnn", "float16"))
]


@pytest.mark.parametrize("kind, dtype", CASES)
def test_enable_fit_evaluate_predict_match_float32(kind, dtype):
    _, reference, want_eval, want_pred = _fit(kind, None)
    model, history, got_eval, got_pred = _fit(kind, dtype)
    print(f"[enable zoo] {kind} {dtype}: val loss fp32 {want_eval:.5f} vs {got_eval:.5f} "
          f"({100 * (got_eval - want_eval) / want_eval:+.2f}%); "
          f"first/last train loss {history['loss'][0]:.4f}/{history['loss'][-1]:.4f}")
    assert history["loss"][-1] < 0.6 * history["loss"][0], "training should converge"
    assert got_eval == pytest.approx(want_eval, rel=REL_TOL)
    assert history["val_loss"][-1] == pytest.approx(reference["val_loss"][-1], rel=REL_TOL)
    assert got_pred.dtype == np.float32 and got_pred.shape == want_pred.shape
    _expect_converted(kind, model.train_function.reports[0])
    assert model.predict_function.reports[0].converted
    assert all(w.dtype == "float32" for w in model.weights)
    if dtype == "float16":
        assert isinstance(model.optimizer, tfamp.LossScaleOptimizer)
        assert history["loss_scale"][-1] >= 1.0
    else:
        assert "loss_scale" not in history
