"""Shrunk by tests/progen from generated program 65000198 (10 statements -> 3).

Failed: [sixteen_without_allow] bfloat16/shapes/CPU: 31 ops converted with no allow-list op converted (first: StatefulPartitionedCall 'StatefulPartitionedCall': boundary: a value crossing a call or loop boundary, bfloat16 on every side (every producer and consumer agrees) (Tout[0])

Run: python <this file>   (checks the invariants; exit status 1 on a failure)
"""
# ruff: noqa
import pathlib
import sys

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import list_ops

import keras as K

SEED = 65000198
D = 32
BATCH = 4
ID_LENGTH = 8
VOCAB = 8
DYNAMIC_BATCH = False
SPEC = '{"aux": "", "d": 32, "dynamic_batch": false, "flavour": "keras3", "int_output": false, "loss": "mse", "optimizer": "none", "outputs": [], "seed": 65000198, "stmts": [{"args": ["x1"], "body": [{"args": ["@in"], "body": [], "kind": "tape", "out": "t8", "params": {"variant": ""}}, {"args": ["t8"], "kind": "bn_fused", "out": "t9", "params": {"layout": 1, "variant": "inference"}}], "kind": "nested_fn", "out": "t10", "params": {"variant": "autograph"}}], "tape": true}'


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

    g_t9 = var(1, (2,), value=1.0 + grid(1, (2,), 2, 8))
    beta_t9 = var(101, (2,), lim=2, den=8)
    mm_t9 = var(2, (2,), trainable=False)
    mv_t9 = var(102, (2,), trainable=False, value=1.0 + np.abs(grid(102, (2,), 4, 8)))

    @tf.function
    def f_t10(h_t10):
        with tf.GradientTape() as tape_t8:
            tape_t8.watch(h_t10)
            s_t8 = tf.reduce_sum(tf.square(h_t10)) * 0.5
        t8 = h_t10 + 0.5 * tape_t8.gradient(s_t8, h_t10, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        t9 = tf.reshape(tf.compat.v1.nn.fused_batch_norm(tf.reshape(t8, [-1, 4, 4, 2]), g_t9, beta_t9, mean=mm_t9, variance=mv_t9, epsilon=1e-3, is_training=False)[0], [-1, 32])
        return t9


    @tf.function
    def step(x0, x1, ids, labels):
        with tf.GradientTape() as tape:
            tape.watch([x0, x1])
            t10 = f_t10(x1)
            loss = tf.reduce_mean(tf.square(t10))
        grads = tape.gradient(loss, train + [x0, x1],
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        weight_grads, input_grads = grads[:len(train)], grads[len(train):]
        return {"loss": loss, "grads": [tf.convert_to_tensor(g) for g in weight_grads], "input_grads": input_grads, "t10": t10}
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
