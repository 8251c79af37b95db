"""Shrunk by tests/progen from generated program 13000886 (6 statements -> 4).
A harness case, not a rewrite defect: in a scan, a FusedBatchNorm over four values per
channel; its offset's gradient (a sum of the output gradient, which cancels) is 5e-5 in
float32 and -2.7e-4 with the BatchNorm in bfloat16, as any AMP that runs it in bfloat16 gives.
Adam's first step is lr * sign(g), so the update moves by 2 lr. Of eight random samples of the
noise one flips that sign; the three the harness drew kept it (invariants.EXTRA_SALTS).

Failed: [numerics] bfloat16/shapes/CPU: variable 7 (8,) update: |r - c| = 0.0301, bound 0.0109 (|c| = 0.0439, noisy run's |n - c| = 0.0012); max elementwise error 0.0301

Run: python <this file>   (checks the invariants; exit status 1 on a failure)
"""
# ruff: noqa
import pathlib
import sys

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import list_ops

import tf_keras as K

SEED = 13000886
DTYPES = ("bfloat16",)  # where it failed (tests/test_generated.py reads this)
HARNESS_CASE = True  # guards the judge: tests/test_generated.py runs it with the slow tests
D = 32
BATCH = 4
ID_LENGTH = 8
VOCAB = 8
DYNAMIC_BATCH = False
SPEC = '{"aux": "t1", "d": 32, "dynamic_batch": false, "flavour": "tf_keras", "int_output": false, "loss": "mse_aux", "optimizer": "adam", "outputs": [], "seed": 13000886, "stmts": [{"args": ["x1"], "kind": "bn_fused", "out": "t1", "params": {"layout": 1, "variant": "training"}}, {"args": ["t1"], "body": [{"args": ["@in"], "kind": "keras_bn", "out": "t3", "params": {"layout": 1, "variant": "4d"}}, {"args": ["t3"], "kind": "bn_fused", "out": "t5", "params": {"layout": 0, "variant": "training"}}], "kind": "scan", "out": "t6", "params": {"variant": ""}}], "tape": true}'


def grid(key, shape, lim=4, den=16):
    """Values k / den, |k| <= lim: exact in float16 and bfloat16."""
    rng = np.random.default_rng([SEED, key])
    return (rng.integers(-lim, lim + 1, size=shape) / den).astype(np.float32)


def ints(key, shape, high):
    return np.random.default_rng([SEED, key]).integers(0, high, size=shape).astype(np.int32)


def build():
    """(step, state): a fresh training step and every variable it may touch."""
    state, train = [], []

    def var(key, shape, lim=4, den=16, trainable=True, value=None):
        v = tf.Variable(grid(key, shape, lim, den) if value is None else value,
                        trainable=trainable)
        state.append(v)
        if trainable:
            train.append(v)
        return v

    def layer(key, obj, input_shape):
        obj.build(input_shape)
        for index, weight in enumerate(obj.weights):
            if "kernel" in weight.name or "embeddings" in weight.name:
                weight.assign(grid(key * 10 + index, tuple(weight.shape)))
        # (Keras 3's variables wrap a tf.Variable: the tape's zeros for an
        # unconnected gradient need the tf.Variable itself)
        state.extend(tf_variable(w) for w in obj.weights)
        train.extend(tf_variable(w) for w in obj.trainable_weights)
        return obj

    def tf_variable(weight):
        return weight if isinstance(weight, tf.Variable) else weight.value

    g_t1 = var(1, (2,), value=1.0 + grid(1, (2,), 2, 8))
    beta_t1 = var(101, (2,), lim=2, den=8)
    L_t3 = layer(2, K.layers.BatchNormalization(), (None, 4, 4, 2))
    g_t5 = var(3, (8,), value=1.0 + grid(3, (8,), 2, 8))
    beta_t5 = var(103, (8,), lim=2, den=8)
    opt = K.optimizers.Adam(learning_rate=2.0 ** -6)
    if train:
        opt.build(train)
        state.extend(opt.variables)

    @tf.function
    def step(x0, x1, ids, labels):
        with tf.GradientTape() as tape:
            tape.watch([x0, x1])
            t1 = tf.reshape(tf.compat.v1.nn.fused_batch_norm(tf.reshape(x1, [-1, 4, 4, 2]), g_t1, beta_t1, epsilon=1e-3, is_training=True)[0], [-1, 32])
            def scan_t6(acc, r):
                h_t6 = (acc * 0.5 + r)[None, :]
                t3 = tf.reshape(L_t3(tf.reshape(h_t6, [-1, 4, 4, 2]), training=True), [-1, 32])
                t5 = tf.reshape(tf.compat.v1.nn.fused_batch_norm(tf.reshape(t3, [-1, 2, 2, 8]), g_t5, beta_t5, epsilon=1e-3, is_training=True)[0], [-1, 32])
                return t5[0]
            t6 = tf.scan(scan_t6, t1, initializer=tf.zeros([32]))
            loss = tf.reduce_mean(tf.square(t6))
            loss = loss + 0.5 * tf.reduce_mean(tf.square(t1))
        grads = tape.gradient(loss, train + [x0, x1],
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        weight_grads, input_grads = grads[:len(train)], grads[len(train):]
        if train:
            opt.apply_gradients(zip(weight_grads, train))
        return {"loss": loss, "grads": [tf.convert_to_tensor(g) for g in weight_grads], "input_grads": input_grads, "t6": t6}
    return step, state


def make_inputs():
    return [tf.constant(grid(101, (BATCH, D), 8, 8)), tf.constant(grid(102, (BATCH, D), 8, 8)),
            tf.constant(ints(103, (BATCH, ID_LENGTH), VOCAB)),
            tf.constant(ints(104, (BATCH,), D))]


def input_specs():
    """What the step is traced with."""
    if not DYNAMIC_BATCH:
        return make_inputs()
    return [tf.TensorSpec([None, D], tf.float32), tf.TensorSpec([None, D], tf.float32),
            tf.TensorSpec([None, ID_LENGTH], tf.int32), tf.TensorSpec([None], tf.int32)]


if __name__ == "__main__":
    _here = pathlib.Path(__file__).resolve()
    sys.path[:0] = [str(p) for p in _here.parents if (p / "tests" / "progen").is_dir()][:1]
    from tests.progen.invariants import main
    sys.exit(main(sys.modules[__name__]))
