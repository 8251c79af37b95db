"""Which ops TensorFlow's gradient machinery wrote, read from their names."""

from __future__ import annotations

import pytest
import tensorflow as tf

from tfamp.rewrite import scopes


@pytest.mark.parametrize("name, gradient, scope", [
    ("gradient_tape/model/dense/BiasAdd/BiasAddGrad", True, "model/dense/BiasAdd"),
    ("gradients/dense/MatMul_grad/MatMul", True, "dense/MatMul_grad"),
    ("gradients_1/dense/MatMul_grad/MatMul", True, "dense/MatMul_grad"),
    ("train/gradients/dense/MatMul_grad/MatMul", True, "train/gradients/dense/MatMul_grad/MatMul"),
    ("gradient_tape/Sum", True, "Sum"),
    ("model/dense/MatMul", False, "model/dense/MatMul"),
    ("model/gradients_layer/MatMul", False, "model/gradients_layer/MatMul"),
    ("my_gradient_tape/x", False, "my_gradient_tape/x"),
])
def test_gradient_names(name, gradient, scope):
    assert scopes.is_gradient(name) is gradient
    assert scopes.forward_scope(name)[0] == scope


def test_the_tape_and_tf_gradients_name_their_ops_so():
    """The names the rules rely on are what TensorFlow 2 writes."""
    w = tf.Variable(tf.ones([3, 3]))

    @tf.function
    def taped(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.matmul(x, w))
        return tape.gradient(loss, w)

    graph = taped.get_concrete_function(tf.TensorSpec([2, 3])).graph
    forward = {op.name for op in graph.get_operations() if op.type == "MatMul"
               and not scopes.is_gradient(op.name)}
    backward = {op.name for op in graph.get_operations() if op.type == "MatMul"
                and scopes.is_gradient(op.name)}
    assert len(forward) == 1 and backward, (forward, backward)

    with tf.Graph().as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 3])
        v = tf.constant(1.0, shape=[3, 3])
        grads = tf.gradients(tf.reduce_sum(tf.matmul(x, v)), [v])
        grads2 = tf.gradients(tf.reduce_sum(tf.matmul(x, v)), [v])
        assert scopes.is_gradient(grads[0].op.name) and scopes.is_gradient(grads2[0].op.name)
