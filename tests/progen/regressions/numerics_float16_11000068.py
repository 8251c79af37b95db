"""Shrunk by tests/progen from generated program 11000068 (11 statements -> 11: the aux loss
and the optimizer dropped; 1-minimal, every statement is needed).
A harness case, not a rewrite defect: the first while_1 trip's Dense pre-activation [1, 0] is
-3.8e-4 in float32, a 16-term sum whose terms' magnitudes add to 1.72 (0.11 of one float16
rounding of it, u sqrt(16) 1.72 = 3.4e-3); upstream 16-bit rounding (the one-hot einsum and
FusedBatchNorm loop) turns it positive, the float32 ReLU lets its gradient through, and the
bias gradient's element 0 moves by 0.029 (every gradient upstream with it). Keeping the Dense
MatMul float32 still crosses it; moving every op of the graph to the allow list gives the same
error. 2 of 8 random noise samples cross it (errors 0.0137, 0.0139 on grads/0, against the
rewrite's 0.0151); the three that judged it did not. The harness now also judges against a
sample in which each sum within its rounding of zero changes sign (noise.rounding_noise's
`crossed`, invariants.CROSSED): it gives 0.0150.

Failed: [numerics] float16/shapes/CPU: grads/1: |r - c| = 0.0197, bound 0.0125; grads/0:
|r - c| = 0.0151, bound 0.0149 (and input_grads/1, grads/3; float16/no-shapes/CPU,
float16/shapes/CPU/xla)

Run: python <this file>   (checks the invariants; exit status 1 on a failure)
"""
# ruff: noqa
import pathlib
import sys

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import list_ops

import tf_keras as K

SEED = 11000068
DTYPES = ("float16",)  # where it failed (tests/test_generated.py reads this)
HARNESS_CASE = True  # guards the judge: tests/test_generated.py runs it with the slow tests
D = 16
BATCH = 4
ID_LENGTH = 8
VOCAB = 8
DYNAMIC_BATCH = False
SPEC = '{"aux": "", "d": 16, "dynamic_batch": false, "flavour": "tf_keras", "int_output": false, "loss": "mse", "optimizer": "none", "outputs": [], "seed": 11000068, "stmts": [{"args": ["x1"], "kind": "cast", "out": "t1", "params": {"variant": "bool_mask"}}, {"args": ["t1"], "kind": "bn_fused", "out": "t2", "params": {"layout": 0, "variant": "training"}}, {"args": ["t2"], "body": [{"args": ["@in"], "body": [{"args": ["@in"], "kind": "embedding", "out": "t3", "params": {"layout": 0, "variant": "one_hot"}}], "kind": "tape", "out": "t4", "params": {"variant": ""}}, {"args": ["t4"], "kind": "bn_fused", "out": "t5", "params": {"layout": 1, "variant": "inference"}}], "kind": "while", "out": "t6", "params": {"trips": 3, "variant": ""}}, {"args": ["t6"], "body": [{"args": ["@in"], "body": [{"args": ["@in"], "kind": "layernorm", "out": "t7", "params": {"variant": "keras"}}, {"args": ["t7"], "kind": "bn_moments", "out": "t8", "params": {"layout": 1, "variant": "plain"}}], "kind": "scan", "out": "t9", "params": {"variant": ""}}, {"args": ["t9"], "kind": "keras_dense", "out": "t10", "params": {"variant": "relu"}}], "kind": "while", "out": "t11", "params": {"trips": 2, "variant": ""}}], "tape": true}'


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

    g_t2 = var(1, (4,), value=1.0 + grid(1, (4,), 2, 8))
    beta_t2 = var(101, (4,), lim=2, den=8)
    E_t3 = var(2, (8, 4), den=8)
    g_t5 = var(3, (1,), value=1.0 + grid(3, (1,), 2, 8))
    beta_t5 = var(103, (1,), lim=2, den=8)
    mm_t5 = var(4, (1,), trainable=False)
    mv_t5 = var(104, (1,), trainable=False, value=1.0 + np.abs(grid(104, (1,), 4, 8)))
    L_t7 = layer(5, K.layers.LayerNormalization(), (None, 16))
    g_t8 = var(6, (1,), value=1.0 + grid(6, (1,), 2, 8))
    beta_t8 = var(106, (1,), lim=2, den=8)
    L_t10 = layer(7, K.layers.Dense(16, activation='relu'), (None, 16))

    @tf.function
    def step(x0, x1, ids, labels):
        with tf.GradientTape() as tape:
            tape.watch([x0, x1])
            t1 = x1 * tf.cast(x1 > 0, tf.float32) + 0.5 * x1
            t2 = tf.reshape(tf.compat.v1.nn.fused_batch_norm(tf.reshape(t1, [-1, 2, 2, 4]), g_t2, beta_t2, epsilon=1e-3, is_training=True)[0], [-1, 16])
            def body_t6(i, h_t6):
                with tf.GradientTape() as tape_t4:
                    tape_t4.watch(h_t6)
                    t3 = h_t6 + tf.reshape(tf.einsum("btv,ve->bte", tf.one_hot(ids[:, :4], 8), E_t3), [-1, 16])
                    s_t4 = tf.reduce_sum(tf.square(t3)) * 0.5
                t4 = h_t6 + 0.5 * tape_t4.gradient(s_t4, h_t6, unconnected_gradients=tf.UnconnectedGradients.ZERO)
                t5 = tf.reshape(tf.compat.v1.nn.fused_batch_norm(tf.reshape(t4, [-1, 4, 4, 1]), g_t5, beta_t5, mean=mm_t5, variance=mv_t5, epsilon=1e-3, is_training=False)[0], [-1, 16])
                return i + 1, t5
            _, t6 = tf.while_loop(lambda i, h: i < 3, body_t6, (tf.constant(0), t2), maximum_iterations=3)
            def body_t11(i, h_t11):
                def scan_t9(acc, r):
                    h_t9 = (acc * 0.5 + r)[None, :]
                    t7 = L_t7(h_t9)
                    x4_t8 = tf.reshape(t7, [-1, 4, 4, 1])
                    mean_t8, var_t8 = tf.nn.moments(x4_t8, axes=[0, 1, 2])
                    t8 = tf.reshape(tf.nn.batch_normalization(x4_t8, mean_t8, var_t8, beta_t8, g_t8, 1e-3), [-1, 16])
                    return t8[0]
                t9 = tf.scan(scan_t9, h_t11, initializer=tf.zeros([16]))
                t10 = L_t10(t9)
                return i + 1, t10
            _, t11 = tf.while_loop(lambda i, h: i < 2, body_t11, (tf.constant(0), t6), maximum_iterations=2)
            loss = tf.reduce_mean(tf.square(t11))
        grads = tape.gradient(loss, train + [x0, x1],
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        weight_grads, input_grads = grads[:len(train)], grads[len(train):]
        return {"loss": loss, "grads": [tf.convert_to_tensor(g) for g in weight_grads], "input_grads": input_grads, "t11": t11}
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
