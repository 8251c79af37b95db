"""Shrunk by tests/progen from generated program 29000855 (5 statements -> 5).

Failed: [nonfinite] float16/shapes/CPU: t5: 2 of 64 values not finite (float32 and the noisy runs: finite; max |c| 1.38e+26)

Run: python <this file>   (checks the invariants; exit status 1 on a failure)
"""
# ruff: noqa
import pathlib
import sys

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import list_ops

import keras as K

SEED = 29000855
D = 16
BATCH = 4
ID_LENGTH = 8
VOCAB = 8
DYNAMIC_BATCH = False
DTYPES = ("float16",)  # where it failed (tests/test_generated.py reads this)
SPEC = '{"aux": "", "d": 16, "dynamic_batch": false, "flavour": "keras3", "int_output": false, "loss": "mse", "optimizer": "none", "outputs": [], "seed": 29000855, "stmts": [{"args": ["x1", "x0"], "kind": "bmm", "out": "t1", "params": {"variant": ""}}, {"args": ["t1"], "body": [{"args": ["@in"], "body": [{"args": ["@in"], "kind": "dense", "out": "t2", "params": {"variant": "gelu"}}, {"args": ["t2"], "kind": "unary", "out": "t3", "params": {"variant": "pow"}}], "kind": "while", "out": "t4", "params": {"trips": 3, "variant": ""}}], "kind": "scan", "out": "t5", "params": {"variant": ""}}], "tape": false}'


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
        if input_shape is not None:
            obj.build(input_shape)
        for index, weight in enumerate(obj.weights):
            if "kernel" in weight.name or "embeddings" in weight.name:
                weight.assign(grid(key * 10 + index, tuple(weight.shape)))
        # (Keras 3's variables wrap a tf.Variable: the tape's zeros for an
        # unconnected gradient need the tf.Variable itself)
        state.extend(tf_variable(w) for w in obj.weights)
        train.extend(tf_variable(w) for w in obj.trainable_weights)
        return obj

    def called(key, obj, *example):
        """A layer built by a first call (Keras's MultiHeadAttention builds from its
        inputs), its kernels set as `layer`'s."""
        obj(*example)
        return layer(key, obj, None)

    def tf_variable(weight):
        return weight if isinstance(weight, tf.Variable) else weight.value

    W_t2 = var(1, (16, 16), den=8)
    b_t2 = var(101, (16,), lim=2)

    @tf.function
    def step(x0, x1, ids, labels):
        s_t1 = tf.matmul(x1, x0, transpose_b=True) / 16.0
        t1 = tf.matmul(tf.nn.softmax(s_t1), x0)
        def scan_t5(acc, r):
            h_t5 = (acc * 0.5 + r)[None, :]
            def body_t4(i, h_t4):
                t2 = tf.nn.gelu(tf.matmul(h_t4, W_t2) + b_t2)
                t3 = tf.pow(tf.abs(t2) + 0.5, 1.5)
                return i + 1, t3
            _, t4 = tf.while_loop(lambda i, h: i < 3, body_t4, (tf.constant(0), h_t5), maximum_iterations=3)
            return t4[0]
        t5 = tf.scan(scan_t5, t1, initializer=tf.zeros([16]))
        return {"t5": t5}
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
