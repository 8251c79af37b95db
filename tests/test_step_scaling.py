"""The loss-scale machinery of an enabled model's step, structurally.

* Every op the loss-scale code creates carries ``_tfamp_loss_scale`` and stays
  float32 whatever the op lists say (the finiteness check read a float32
  gradient above 65504 as inf once it was converted).
* The step has no more top-level conditionals than Keras's own loss-scaled
  step: the scale update is selects, the only conditional is apply-or-skip.
* A train step whose gradients tfamp cannot scale (``output_gradients``
  given) says so once and reports no loss scale; a gradient penalty's inner
  (non-scalar, differentiated for an input) tape is not scaled.
* A per-example loss vector differentiated for the weights (SimCLR's
  contrastive step, applied by an optimizer that is not the model's) is
  scaled: the gradient of a vector is the gradient of its sum, so seeding it
  with the scale is exact (issue 28.7: it was left unscaled, and at loss
  x1e-9 float16 left the weights exactly as they were).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tfamp
from tests import patterns
from tfamp.config import AmpConfig
from tfamp.rewrite import reasons

# Ops of the finiteness check and the scale update, moved onto the allow list:
# the mark must win over the lists.
GREEDY_LISTS = dict(allow_add=("IsFinite", "Maximum", "Mul", "RealDiv"),
                    infer_remove=("Maximum", "Mul", "RealDiv"),
                    clear_remove=("IsFinite",))
KERASES = {"tf_keras": tf_keras, "keras3": keras}


def _mlp_model(keras_module):
    keras_module.utils.set_random_seed(0)
    inputs = keras_module.Input((8,))
    hidden = keras_module.layers.Dense(16, activation="relu")(inputs)
    model = keras_module.Model(inputs, keras_module.layers.Dense(1)(hidden))
    model.compile(optimizer=keras_module.optimizers.SGD(0.01), loss="mse")
    return model


def _data(n=32):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 8)).astype("float32")
    return x, x[:, :1].copy()


def _train_reports(model):
    function = model.train_function
    found = list(getattr(function, "reports", []))
    assert found, "the train function was not rewritten"
    return found


def _step_graph_defs(model):
    """The rewritten train step's GraphDef(s) (the graph that runs)."""
    function = model.train_function
    rewritten = getattr(function, "rewritten", None) or [function]
    graph_defs = []
    for fn in rewritten:
        for _, new, _, _ in fn._rewritten.values():
            graph_defs.append(new.graph.as_graph_def())
    return graph_defs


@pytest.mark.parametrize("flavour", sorted(KERASES))
def test_loss_scale_ops_stay_float32_whatever_the_lists_say(flavour):
    keras_module = KERASES[flavour]
    model = _mlp_model(keras_module)
    tfamp.enable(model, config=AmpConfig(**GREEDY_LISTS), verbose=False)
    x, y = _data()
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    nodes = [n for report in _train_reports(model) for n in report.nodes]
    marked = [n for n in nodes if n.kind == reasons.KIND_LOSS_SCALE]
    assert marked, "no node was recognised as loss-scale machinery"
    assert not any(n.converted for n in marked)
    finiteness = [n for n in nodes if n.op == "IsFinite"]
    assert finiteness and all(n.kind == reasons.KIND_LOSS_SCALE for n in finiteness), [
        (n.name, n.kind) for n in finiteness]
    # ... and the lists did take effect elsewhere: the dense MatMuls are 16-bit.
    assert any(n.converted and n.op == "MatMul" for n in nodes)
    for graph_def in _step_graph_defs(model):
        for node in graph_def.node:
            if node.op == "IsFinite":
                assert node.attr["T"].type == tf.float32.as_datatype_enum, node.name


def test_a_float32_gradient_above_float16_max_is_not_read_as_inf():
    """65504 < |g|: the marked finiteness check says finite; the same ops unmarked,
    with IsFinite on the allow list, are converted and read it as inf."""
    from tfamp.keras.scale_update import finite_flags

    config = AmpConfig(**GREEDY_LISTS)

    def plain(g):
        return tf.reduce_all(tf.math.is_finite(g))

    def machinery(g):
        return tf.reduce_all(finite_flags([g]))

    g = tf.constant([1e5, -3e5, 1.0])
    unmarked = tfamp.function(plain, config=config)
    marked = tfamp.function(machinery, config=config)
    assert not bool(unmarked(g))  # the defect, reproduced: 1e5 -> inf in float16
    assert bool(marked(g))
    kinds = {n.op: n.kind for r in marked.reports for n in r.nodes if n.op == "IsFinite"}
    assert kinds == {"IsFinite": reasons.KIND_LOSS_SCALE}


def _top_level_conditionals(graph_def) -> int:
    return sum(1 for node in graph_def.node if node.op in ("If", "StatelessIf"))


def _keras_policy_step_conditionals() -> int:
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = _mlp_model(keras)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    x, y = _data()
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    counts = []
    for fn in _keras3_step_functions(model):
        for cf in fn._list_all_concrete_functions():
            counts.append(_top_level_conditionals(cf.graph.as_graph_def()))
    assert counts, "could not find Keras's step function"
    return max(counts)


def _keras3_step_functions(model):
    """The tf.functions Keras 3 built for the train step (its closure holds them)."""
    found = []
    seen = set()
    pending = [model.train_function]
    while pending:
        fn = pending.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        if isinstance(fn, tf.types.experimental.PolymorphicFunction):
            if "one_step" in fn.__name__:
                found.append(fn)
            python = fn.python_function
            pending.extend(c.cell_contents for c in (python.__closure__ or ())
                           if callable(c.cell_contents))
        elif callable(fn):
            pending.extend(c.cell_contents for c in (getattr(fn, "__closure__", None) or ())
                           if callable(c.cell_contents))
    return found


def test_step_has_no_more_conditionals_than_keras_own_loss_scaled_step():
    keras_count = _keras_policy_step_conditionals()
    model = _mlp_model(keras)
    tfamp.enable(model, verbose=False)
    x, y = _data()
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    tfamp_counts = [_top_level_conditionals(g) for g in _step_graph_defs(model)]
    assert tfamp_counts and max(tfamp_counts) <= keras_count, (tfamp_counts, keras_count)
    assert max(tfamp_counts) == 1  # apply-or-skip only


@pytest.mark.parametrize("flavour", sorted(KERASES))
def test_unscaled_gradients_in_a_train_step_warn_once_and_claim_no_scale(flavour):
    keras_module = KERASES[flavour]

    class OwnSeed(keras_module.Model):
        def train_step(self, data):
            x, y = data
            with tf.GradientTape() as tape:
                per_sample = tf.square(self(x, training=True) - y)  # not a scalar
            grads = tape.gradient(per_sample, self.trainable_weights,
                                  output_gradients=tf.ones_like(per_sample) / 32.0)
            self.optimizer.apply_gradients(zip(grads, self.trainable_weights))
            return {"loss": tf.reduce_mean(per_sample)}

    keras_module.utils.set_random_seed(0)
    inputs = keras_module.Input((8,))
    model = OwnSeed(inputs, keras_module.layers.Dense(1)(
        keras_module.layers.Dense(16, activation="relu")(inputs)))
    model.compile(optimizer=keras_module.optimizers.SGD(0.01))
    tfamp.enable(model, verbose=False)
    x, y = _data()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(x, y, batch_size=8, epochs=2, verbose=0)
    messages = [str(w.message) for w in caught if "did not loss-scale" in str(w.message)]
    assert len(messages) == 1, messages
    assert "tape.gradient(loss, variables)" in messages[0]
    assert "loss_scale" not in history.history and "skipped_steps" not in history.history


@pytest.mark.parametrize("flavour", sorted(KERASES))
def test_gradient_penalty_inner_tape_is_not_scaled(flavour):
    """Two losses are scaled per WGAN-GP step (critic, generator), not the penalty's tape."""
    keras_module = KERASES[flavour]
    model, data, _ = patterns.build(keras_module, "wgan_gp")
    tfamp.enable(model, verbose=False)
    model.fit(data[0], batch_size=patterns.BATCH, epochs=1, verbose=0)
    seeds = 0
    for graph_def in _step_graph_defs(model):
        seeds += sum(1 for node in graph_def.node if node.op == "Fill"
                     and reasons.LOSS_SCALE_ATTR in node.attr)
    assert seeds == 2


# Issue 28.7's size: unscaled, every float16 gradient of this loss is below
# float16's smallest subnormal (6e-8).
VECTOR_LOSS_FACTOR = 1e-9


def _vector_loss_env_run(flavour: str, tmp_path) -> dict:
    out = tmp_path / f"{flavour}.npz"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TFAMP_")}
    env.update(TFAMP_ENABLE="1", TFAMP_VERBOSITY="0", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    done = subprocess.run(
        [sys.executable, str(Path(patterns.__file__)), flavour, "contrastive",
         "--tiny", str(VECTOR_LOSS_FACTOR), "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "did not loss-scale" not in done.stderr
    with np.load(out) as data:
        return {"delta": data["contrastive"], **json.loads(str(data["meta"]))["contrastive"]}


@pytest.mark.parametrize("mode", ["enable", "TFAMP_ENABLE"])
@pytest.mark.parametrize("flavour", sorted(KERASES))
def test_per_example_loss_vector_is_scaled(flavour, mode, tmp_path):
    keras_module = KERASES[flavour]
    reference = patterns.train(keras_module, "contrastive", tiny=VECTOR_LOSS_FACTOR)
    assert np.linalg.norm(reference["delta"]) > 0  # float32 moves the weights
    if mode == "enable":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run = patterns.train(keras_module, "contrastive", tiny=VECTOR_LOSS_FACTOR,
                                 before_fit=lambda m: tfamp.enable(m, verbose=False))
        assert not [w for w in caught if "did not loss-scale" in str(w.message)]
    else:
        run = _vector_loss_env_run(flavour, tmp_path)
    cosine, ratio = patterns.compare(reference["delta"], run["delta"])
    assert cosine > 0.95 and 0.8 < ratio < 1.25, (cosine, ratio)
    assert run["history"]["skipped_steps"] == 0
