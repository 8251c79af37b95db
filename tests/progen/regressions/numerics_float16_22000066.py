"""Shrunk by tests/progen from generated program 22000066 (9 statements -> 5).

Failed: [numerics] float16/shapes/CPU: t9: |r - c| = 0.00158, bound 0.00151 (|c| = 0.0233, noisy run's |n - c| = 0.000178); max elementwise error 0.00043

Run: python <this file>   (checks the invariants; exit status 1 on a failure)
"""
# ruff: noqa
import pathlib
import sys

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import list_ops

import keras as K

SEED = 22000066
D = 16
BATCH = 4
ID_LENGTH = 8
VOCAB = 8
DYNAMIC_BATCH = False
SPEC = '{"aux": "", "d": 16, "dynamic_batch": false, "flavour": "keras3", "int_output": false, "loss": "mse", "optimizer": "none", "outputs": [], "seed": 22000066, "stmts": [{"args": ["x0"], "kind": "keras_rnn", "out": "t5", "params": {"layout": 1, "variant": "gru"}}, {"args": ["t5"], "kind": "keras_rnn", "out": "t6", "params": {"layout": 0, "variant": "lstm"}}, {"args": ["t6"], "kind": "conv", "out": "t7", "params": {"k": 1, "layout": 1, "variant": "depthwise"}}, {"args": ["t7", "t5"], "kind": "binary", "out": "t8", "params": {"variant": "mul"}}, {"args": ["t8"], "kind": "unary", "out": "t9", "params": {"variant": "selu"}}], "tape": false}'


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

    L_t5 = layer(1, K.layers.GRU(8, return_sequences=True), (None, 2, 8))
    L_t6 = layer(2, K.layers.LSTM(4, return_sequences=True), (None, 4, 4))
    F_t7 = var(3, (1, 1, 1, 1), den=8)

    @tf.function
    def step(x0, x1, ids, labels):
        t5 = tf.reshape(L_t5(tf.reshape(x0, [-1, 2, 8])), [-1, 16])
        t6 = tf.reshape(L_t6(tf.reshape(t5, [-1, 4, 4])), [-1, 16])
        t7 = tf.reshape(tf.nn.depthwise_conv2d(tf.reshape(t6, [-1, 4, 4, 1]), F_t7, [1, 1, 1, 1], "SAME"), [-1, 16])
        t8 = t7 * t5
        t9 = tf.nn.selu(t8)
        return {"t9": t9}
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
