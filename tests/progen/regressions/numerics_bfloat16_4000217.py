"""Shrunk by tests/progen from generated program 4000217 (11 statements -> 3). OPEN (session 15):
without shapes the loop's tf.nn.moments BatchNorm goes bfloat16 whole under the executor.
Session 16: the shrunk program fails with shapes too (on session 15's rewrite as well), and
with the Casts placed for XLA (|r - c| = 0.0307): the first BatchNorm's gamma update (Adam,
so the sign of a gradient that nearly cancels over 16 elements per channel) is off.

Failed: [numerics] bfloat16/no-shapes/CPU: variable 0 (8,) update: |r - c| = 0.0429, bound 0.0192 (|c| = 0.043, noisy run's |n - c| = 0.00223); max elementwise error 0.0304

Passes since the harness confirms a numerics failure against more noise samples: the
gamma gradient is ill-conditioned (the noise moves it by 11 to 53 times its norm; the
rewrite by 1.2 to 2.4), and the first sample happened to flip none of its 8 signs, other
samples 5 to 8 (Adam: each flip a whole step).

Run: python <this file>   (checks the invariants; exit status 1 on a failure)
"""
# ruff: noqa
import pathlib
import sys

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import list_ops

import tf_keras as K

SEED = 4000217
DTYPES = ("bfloat16",)  # where it failed (tests/test_generated.py reads this)
HARNESS_CASE = True  # guards the judge: tests/test_generated.py runs it with the slow tests
D = 32
BATCH = 4
ID_LENGTH = 8
VOCAB = 8
DYNAMIC_BATCH = False
SPEC = '{"aux": "", "d": 32, "dynamic_batch": false, "flavour": "tf_keras", "int_output": false, "loss": "mse", "optimizer": "adam", "outputs": [], "seed": 4000217, "stmts": [{"args": ["x1"], "kind": "bn_moments", "out": "t7", "params": {"layout": 0, "variant": "moving_average"}}, {"args": ["t7"], "body": [{"args": ["@in"], "kind": "bn_moments", "out": "t10", "params": {"layout": 1, "variant": "moving_average"}}], "kind": "tensorlist", "out": "t11", "params": {"trips": 2, "variant": "list_ops"}}], "tape": true}'


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

    g_t7 = var(1, (8,), value=1.0 + grid(1, (8,), 2, 8))
    beta_t7 = var(101, (8,), lim=2, den=8)
    mm_t7 = var(2, (8,), trainable=False)
    g_t10 = var(3, (2,), value=1.0 + grid(3, (2,), 2, 8))
    beta_t10 = var(103, (2,), lim=2, den=8)
    mm_t10 = var(4, (2,), trainable=False)
    opt = K.optimizers.Adam(learning_rate=2.0 ** -6)
    if train:
        opt.build(train)
        state.extend(opt.variables)

    @tf.function
    def step(x0, x1, ids, labels):
        with tf.GradientTape() as tape:
            tape.watch([x0, x1])
            x4_t7 = tf.reshape(x1, [-1, 2, 2, 8])
            mean_t7, var_t7 = tf.nn.moments(x4_t7, axes=[0, 1, 2])
            t7 = tf.reshape(tf.nn.batch_normalization(x4_t7, mean_t7, var_t7, beta_t7, g_t7, 1e-3), [-1, 32])
            mm_t7.assign(mm_t7 * 0.875 + mean_t7 * 0.125)
            def body_t11(i, h_t11, acc):
                x4_t10 = tf.reshape(h_t11, [-1, 4, 4, 2])
                mean_t10, var_t10 = tf.nn.moments(x4_t10, axes=[0, 1, 2])
                t10 = tf.reshape(tf.nn.batch_normalization(x4_t10, mean_t10, var_t10, beta_t10, g_t10, 1e-3), [-1, 32])
                mm_t10.assign(mm_t10 * 0.875 + mean_t10 * 0.125)
                return i + 1, t10, list_ops.tensor_list_push_back(acc, t10)
            _, _, acc_t11 = tf.while_loop(lambda i, *_: i < 2, body_t11, (tf.constant(0), t7, list_ops.empty_tensor_list(element_shape=tf.shape(t7), element_dtype=tf.float32, max_num_elements=2)), maximum_iterations=2)
            t11 = tf.reduce_mean(list_ops.tensor_list_stack(acc_t11, tf.float32), axis=0)
            loss = tf.reduce_mean(tf.square(t11))
        grads = tape.gradient(loss, train + [x0, x1],
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        weight_grads, input_grads = grads[:len(train)], grads[len(train):]
        if train:
            opt.apply_gradients(zip(weight_grads, train))
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
