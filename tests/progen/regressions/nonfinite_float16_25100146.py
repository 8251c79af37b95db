"""Shrunk by tests/progen from generated program 25100146 (4 statements -> 1).

Failed: [nonfinite] float16/shapes/CPU: t1: 32 of 128 values not finite (float32 and the noisy runs: finite; max |c| 0.193)

Run: python <this file>   (checks the invariants; exit status 1 on a failure)
"""
# ruff: noqa
import pathlib
import sys

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import list_ops

import keras as K

SEED = 25100146
D = 32
BATCH = 4
ID_LENGTH = 8
VOCAB = 8
DYNAMIC_BATCH = False
SPEC = '{"aux": "", "d": 32, "dynamic_batch": false, "flavour": "keras3", "int_output": false, "loss": "mse", "optimizer": "none", "outputs": [], "seed": 25100146, "stmts": [{"args": ["x1"], "kind": "keras_mha", "out": "t1", "params": {"layout": 0, "variant": "padded"}}], "tape": false}'


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

    L_t1 = called(1, K.layers.MultiHeadAttention(2, 4), tf.zeros([1, 4, 8]), tf.zeros([1, 4, 8]))

    @tf.function
    def step(x0, x1, ids, labels):
        x3_t1 = tf.reshape(x1, [-1, 4, 8])
        valid_t1 = ids[:, :4] % 3 != 0
        valid_t1 = tf.concat([tf.zeros_like(valid_t1[:1]), valid_t1[1:]], 0)
        mask_t1 = tf.tile(valid_t1[:, None, :], [1, 4, 1])
        t1 = tf.reshape(L_t1(x3_t1, x3_t1, attention_mask=mask_t1), [-1, 32])
        return {"t1": t1}
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
