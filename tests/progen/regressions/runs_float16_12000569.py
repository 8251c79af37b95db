"""Shrunk by tests/progen from generated program 12000569 (21 statements -> 3).
Fixed (session 20). Inside a function compiled with
jit_compile=True, a tape over conv -> relu -> max_pool2d is differentiated twice, so the
outer gradient holds a MaxPoolGradGrad. The rewrite makes it float16 (bfloat16) because the
CPU and GPU kernels accept it, but XLA's kernel (XLA_CPU_JIT / XLA_GPU_JIT) takes float32
only, and tf2xla refused the function: "No registered 'MaxPoolGradGrad' OpKernel for
XLA_CPU_JIT devices ... T=DT_HALF". The kernel check (tfamp.rewrite.kernels.missing_kernel)
now asks XLA's kernel registry too for the bodies XLA compiles (tfamp.rewrite.compiled).

Failed: [runs] float16/shapes/CPU: InvalidArgumentError: Graph execution error:
(and float16/no-shapes, bfloat16/shapes, bfloat16/no-shapes)

Run: python <this file>   (checks the invariants; exit status 1 on a failure)
"""
# ruff: noqa
import pathlib
import sys

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import list_ops

import tf_keras as K

SEED = 12000569
DTYPES = ("float16",)  # it failed in bfloat16 too, by the same missing XLA kernel: one dtype guards it
D = 32
BATCH = 4
ID_LENGTH = 8
VOCAB = 8
DYNAMIC_BATCH = False
SPEC = '{"aux": "", "d": 32, "dynamic_batch": false, "flavour": "tf_keras", "int_output": false, "loss": "mse", "optimizer": "none", "outputs": [], "seed": 12000569, "stmts": [{"args": ["x1"], "body": [{"args": ["@in"], "body": [{"args": ["@in"], "kind": "conv", "out": "t18", "params": {"k": 1, "layout": 1, "variant": "conv2d_relu_pool"}}], "kind": "tape", "out": "t19", "params": {"variant": ""}}], "kind": "xla_fn", "out": "t20", "params": {"variant": ""}}], "tape": true}'


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

    F_t18 = var(1, (1, 1, 2, 2), den=8)

    @tf.function(jit_compile=True)
    def f_t20(h_t20):
        with tf.GradientTape() as tape_t19:
            tape_t19.watch(h_t20)
            t18 = tf.reshape(tf.nn.max_pool2d(tf.nn.relu(tf.nn.conv2d(tf.reshape(h_t20, [-1, 4, 4, 2]), F_t18, 1, "SAME")), 2, 1, "SAME"), [-1, 32])
            s_t19 = tf.reduce_sum(tf.square(t18)) * 0.5
        t19 = h_t20 + 0.5 * tape_t19.gradient(s_t19, h_t20, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        return t19


    @tf.function
    def step(x0, x1, ids, labels):
        with tf.GradientTape() as tape:
            tape.watch([x0, x1])
            t20 = f_t20(x1)
            loss = tf.reduce_mean(tf.square(t20))
        grads = tape.gradient(loss, train + [x0, x1],
                              unconnected_gradients=tf.UnconnectedGradients.ZERO)
        weight_grads, input_grads = grads[:len(train)], grads[len(train):]
        return {"loss": loss, "grads": [tf.convert_to_tensor(g) for g in weight_grads], "input_grads": input_grads, "t20": t20}
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
