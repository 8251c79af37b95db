"""An Exp of minus something never negative lies in (0, 1]: not a deny op.

TensorFlow's gradients of erf and erfc are exp(-square(x)): every GELU
(approximate=False) backward pass has one per layer. Exp is on the float16
deny list because exp(x) overflows float16 past x = 11.1; exp(-square(x))
cannot. It is an infer op there: it no longer holds what reads it in float32.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

import tfamp
from tests.graphs import run_graph_def

RNG = np.random.default_rng(11)
VALUES = {"x": RNG.standard_normal((16, 32)).astype(np.float32) * 2,
          "w1": RNG.standard_normal((32, 64)).astype(np.float32) / 6,
          "w2": RNG.standard_normal((64, 8)).astype(np.float32) / 8}


def _step(x, w1, w2):
    with tf.GradientTape() as tape:
        tape.watch([w1, w2])
        h = tf.nn.gelu(tf.matmul(x, w1, name="dense1"), approximate=False)
        y = tf.matmul(h, w2, name="dense2")
        # Two Exps that may overflow: of a plain value, of minus a signed one.
        grows = tf.matmul(tf.exp(y, name="plain_exp"), tf.transpose(w2), name="after_plain")
        signed = tf.matmul(tf.exp(-y, name="neg_exp"), tf.transpose(w2), name="after_neg")
        loss = tf.reduce_mean(tf.square(y)) + 1e-3 * tf.reduce_mean(grows + signed)
    return [loss] + tape.gradient(loss, [w1, w2])


def test_gelu_gradient_exp_is_16bit_and_unbounded_exps_stay_float32():
    concrete = tf.function(_step, autograph=False).get_concrete_function(
        *[tf.TensorSpec(v.shape) for v in VALUES.values()])
    graph_def = concrete.graph.as_graph_def(add_shapes=True)
    outputs = [t.name for t in concrete.graph.outputs]
    new_graph_def, report = tfamp.rewrite_graph_def(
        graph_def, tfamp.AmpConfig(dtype="float16", device_type="GPU"), outputs=outputs)
    assert tfamp.check_graph_def(new_graph_def) == []
    nodes = {n.name: n for n in graph_def.node}
    exps = {n.name: n for n in report.nodes if n.op == "Exp"}
    gelu = [name for name in exps if name.startswith("gradient_tape/")
            and nodes[nodes[name].input[0]].op == "Neg"
            and nodes[nodes[nodes[name].input[0]].input[0]].op == "Square"]
    assert gelu, sorted(exps)
    readers = {}
    for node in graph_def.node:
        for text in node.input:
            readers.setdefault(text.split(":")[0], []).append(node.name)
    by_name = {n.name: n for n in report.nodes}
    for name in gelu:
        assert exps[name].list == "infer" and exps[name].kind != "deny list", exps[name].reason
        # Nothing is held float32 by it: what reads it computes in 16-bit.
        assert not [n for n in report.nodes if n.cause == name]
        for reader in readers[name]:
            assert by_name[reader].converted, (reader, by_name[reader].reason)
    for name in ("plain_exp", "neg_exp"):
        assert exps[name].list == "deny" and not exps[name].converted, exps[name].reason
    want = run_graph_def(graph_def, VALUES, outputs)
    got = run_graph_def(new_graph_def, VALUES, outputs)
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, rtol=2e-2, atol=2e-2 * np.abs(w).max())
