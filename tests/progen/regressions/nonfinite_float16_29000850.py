"""Shrunk by tests/progen from generated program 29000850 (8 statements -> 3).

Failed: [nonfinite] float16/shapes/CPU: variable 0 (16, 16) update: 169 of 256 values not finite (float32 and the noisy runs: finite; max |c| 0.0156)

Run: python <this file>   (checks the invariants; exit status 1 on a failure)
"""
# ruff: noqa
import pathlib
import sys

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import list_ops

import keras as K

SEED = 29000850
D = 16
BATCH = 4
ID_LENGTH = 8
VOCAB = 8
DYNAMIC_BATCH = False
DTYPES = ("float16",)  # where it failed (tests/test_generated.py reads this)
SPEC = '{"aux": "", "d": 16, "dynamic_batch": false, "flavour": "keras3", "int_output": false, "loss": "mse", "optimizer": "adam", "outputs": [], "seed": 29000850, "stmts": [{"args": ["x1"], "body": [{"args": ["@in"], "body": [{"args": ["@in"], "kind": "dense", "out": "t5", "params": {"variant": "l2_head"}}], "kind": "cond", "out": "t6", "params": {"pred": "data", "variant": ""}}], "kind": "cond", "out": "t8", "params": {"pred": "data", "variant": ""}}], "tape": true}'


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

    W_t5 = var(1, (16, 16), den=8)
    b_t5 = var(101, (16,), lim=2)
    V_t5 = var(201, (16, 16), den=8)
    opt = K.optimizers.Adam(learning_rate=2.0 ** -6)
    if train:
        opt.build(train)
        state.extend(opt.variables)

    @tf.function
    def step(x0, x1, ids, labels):
        with tf.GradientTape() as tape:
            tape.watch([x0, x1])
            def then_t8():
                def then_t6():
                    h_t5 = tf.nn.relu(tf.matmul(x1, W_t5) + b_t5) * tf.cast(tf.range(tf.shape(x1)[0]) > 0, tf.float32)[:, None]
                    t5 = tf.matmul(tf.math.l2_normalize(h_t5, axis=-1), V_t5)
                    return t5
                t6 = tf.cond(tf.reduce_max(tf.abs(x1)) >= 0.0, then_t6, lambda: x1 * 0.5)
                return t6
            t8 = tf.cond(tf.reduce_max(tf.abs(x1)) >= 0.0, then_t8, lambda: x1 * 0.5)
            loss = tf.reduce_mean(tf.square(t8))
        grads = tape.gradient(loss, train + [x0, x1],
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        weight_grads, input_grads = grads[:len(train)], grads[len(train):]
        if train:
            opt.apply_gradients(zip(weight_grads, train))
        return {"loss": loss, "grads": [tf.convert_to_tensor(g) for g in weight_grads], "input_grads": input_grads, "t8": t8}
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
