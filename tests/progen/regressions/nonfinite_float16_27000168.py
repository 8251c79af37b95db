"""Shrunk by tests/progen from generated program 27000168 (9 statements -> 2).

Failed: [nonfinite] float16/shapes/CPU: t4: 32 of 128 values not finite (float32 and the noisy runs: finite; max |c| 0.439)

Run: python <this file>   (checks the invariants; exit status 1 on a failure)
"""
# ruff: noqa
import pathlib
import sys

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import list_ops

import keras as K

SEED = 27000168
D = 32
BATCH = 4
ID_LENGTH = 8
VOCAB = 8
DYNAMIC_BATCH = False
DTYPES = ("float16",)  # where it failed (tests/test_generated.py reads this)
SPEC = '{"aux": "", "d": 32, "dynamic_batch": false, "flavour": "keras3", "int_output": false, "loss": "mse", "optimizer": "none", "outputs": [], "seed": 27000168, "stmts": [{"args": ["x1"], "body": [{"args": ["@in"], "kind": "attention", "out": "t3", "params": {"layout": 1, "variant": "bias"}}], "kind": "tensorlist", "out": "t4", "params": {"trips": 1, "variant": "tensor_array"}}], "tape": false}'


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

    Wq_t3 = var(1, (4, 4), den=8)
    Wk_t3 = var(2, (4, 4), den=8)
    Wv_t3 = var(3, (4, 4), den=8)
    B_t3 = tf.constant((1.0 - np.concatenate([np.zeros((1, 8)), ints(4, (BATCH - 1, 8), 3) != 0], 0)[:, None, :]) * -1e9, tf.float32)

    @tf.function
    def step(x0, x1, ids, labels):
        def body_t4(i, h_t4, acc):
            x3_t3 = tf.reshape(h_t4, [-1, 8, 4])
            q_t3 = tf.matmul(x3_t3, Wq_t3)
            k_t3 = tf.matmul(x3_t3, Wk_t3)
            v_t3 = tf.matmul(x3_t3, Wv_t3)
            s_t3 = tf.matmul(q_t3, k_t3, transpose_b=True) * 0.5
            s_t3 = s_t3 + B_t3
            t3 = tf.reshape(tf.matmul(tf.nn.softmax(s_t3), v_t3), [-1, 32])
            return i + 1, t3, acc.write(i, t3)
        _, _, acc_t4 = tf.while_loop(lambda i, *_: i < 1, body_t4, (tf.constant(0), x1, tf.TensorArray(tf.float32, size=1)), maximum_iterations=1)
        t4 = tf.reduce_mean(acc_t4.stack(), axis=0)
        return {"t4": t4}
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
