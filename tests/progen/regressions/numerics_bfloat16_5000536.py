"""Shrunk by tests/progen from generated program 5000536 (10 statements -> 5).
A harness case, not a rewrite defect: Adam's first step is lr * sign(g), and one element of the
embedding's gradient (-2.9e-4 of a gradient of norm 0.14) changes sign in bfloat16 (executor
and XLA placements alike); one sample of the noise kept that sign, others flip it
(invariants.EXTRA_SALTS).

Failed: [numerics] bfloat16/shapes/CPU/xla: variable 0 (8, 8) update: |r - c| = 0.0304, bound 0.0119 (|c| = 0.108, noisy run's |n - c| = 0.00107); max elementwise error 0.0304

Run: python <this file>   (checks the invariants; exit status 1 on a failure)
"""
# ruff: noqa
import pathlib
import sys

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import list_ops

import tf_keras as K

SEED = 5000536
DTYPES = ("bfloat16",)  # where it failed (tests/test_generated.py reads this)
HARNESS_CASE = True  # guards the judge: tests/test_generated.py runs it with the slow tests
D = 16
BATCH = 4
ID_LENGTH = 8
VOCAB = 8
DYNAMIC_BATCH = False
SPEC = '{"aux": "", "d": 16, "dynamic_batch": false, "flavour": "tf_keras", "int_output": false, "loss": "mse", "optimizer": "adam", "outputs": [], "seed": 5000536, "stmts": [{"args": ["x1"], "kind": "embedding", "out": "t1", "params": {"layout": 1, "variant": "lookup"}}, {"args": ["t1"], "kind": "softmax", "out": "t2", "params": {"variant": "softmax"}}, {"args": ["t2"], "body": [{"args": ["@in"], "body": [{"args": ["@in"], "kind": "attention", "out": "t3", "params": {"layout": 0, "variant": "plain"}}], "kind": "tensorlist", "out": "t4", "params": {"trips": 3, "variant": "tensor_array"}}], "kind": "map_fn", "out": "t6", "params": {"variant": ""}}], "tape": true}'


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

    E_t1 = var(1, (8, 8), den=8)
    Wq_t3 = var(2, (4, 4), den=8)
    Wk_t3 = var(3, (4, 4), den=8)
    Wv_t3 = var(4, (4, 4), den=8)
    opt = K.optimizers.Adam(learning_rate=2.0 ** -6)
    if train:
        opt.build(train)
        state.extend(opt.variables)

    @tf.function
    def step(x0, x1, ids, labels):
        with tf.GradientTape() as tape:
            tape.watch([x0, x1])
            t1 = x1 + tf.reshape(tf.nn.embedding_lookup(E_t1, ids[:, :2]), [-1, 16])
            t2 = tf.nn.softmax(t1 * 2.0, axis=-1) * 16.0
            def row_t6(r):
                h_t6 = r[None, :]
                def body_t4(i, h_t4, acc):
                    x3_t3 = tf.reshape(h_t4, [-1, 4, 4])
                    q_t3 = tf.matmul(x3_t3, Wq_t3)
                    k_t3 = tf.matmul(x3_t3, Wk_t3)
                    v_t3 = tf.matmul(x3_t3, Wv_t3)
                    s_t3 = tf.matmul(q_t3, k_t3, transpose_b=True) * 0.5
                    t3 = tf.reshape(tf.matmul(tf.nn.softmax(s_t3), v_t3), [-1, 16])
                    return i + 1, t3, acc.write(i, t3)
                _, _, acc_t4 = tf.while_loop(lambda i, *_: i < 3, body_t4, (tf.constant(0), h_t6, tf.TensorArray(tf.float32, size=3)), maximum_iterations=3)
                t4 = tf.reduce_mean(acc_t4.stack(), axis=0)
                return t4[0]
            t6 = tf.map_fn(row_t6, t2)
            loss = tf.reduce_mean(tf.square(t6))
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
