"""A generated program as a standalone Python file, and loading one.

``render(program, doc)`` writes the source; ``load(source)`` runs it as a fresh
module. The file defines ``build() -> (step, state)`` (a tf.function training
step and every variable it may touch, in a fixed order), ``make_inputs()``,
``input_specs()`` (what the step is traced with: an unknown batch dimension for
``dynamic_batch`` programs) and ``SPEC`` (the program as JSON, for the
shrinker); run as a script it checks the invariants (``invariants.main``).

Values are exact in both 16-bit types: weights are k/16 or k/8 with |k| <= 4
(or 1 + k/8 for a scale), inputs k/8 with |k| <= 8, each variable drawn from
its own seed (``grid(key, ...)``: removing a statement leaves the others'
values as they were). Random values are stateless with fixed seeds, or from a
``tf.random.Generator`` whose state is a variable of ``state``.
"""

from __future__ import annotations

import itertools
import linecache
import textwrap
import types

from tests.progen.grammar import (
    BATCH,
    ID_LENGTH,
    KINDS,
    VOCAB,
    Program,
    Stmt,
    image_layout,
    sequence_layout,
)

_HEADER = '''\
import pathlib
import sys

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import list_ops

import {flavour} as K

SEED = {seed}
D = {d}
BATCH = {batch}
ID_LENGTH = {id_length}
VOCAB = {vocab}
DYNAMIC_BATCH = {dynamic}
SPEC = {spec!r}


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

'''

_FOOTER = '''

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
'''

_ACTIVATIONS = {
    "relu": "tf.nn.relu({})", "tanh": "tf.tanh({})", "sigmoid": "tf.sigmoid({})",
    "gelu": "tf.nn.gelu({})", "elu": "tf.nn.elu({})", "softplus": "tf.nn.softplus({})",
    "leaky_relu": "tf.nn.leaky_relu({}, alpha=0.25)", "silu": "tf.nn.silu({})",
    "linear": "{}",
}
_LEARNING_RATE = "2.0 ** -4"


def render(program: Program, doc: str) -> str:
    """The program as the source of a standalone Python file (`doc`: its docstring)."""
    writer = _Writer(program)
    step = writer.step()
    setup = "".join(f"    {line}\n" if line else "\n" for line in writer.setup)
    header = _HEADER.format(
        flavour="keras" if program.flavour == "keras3" else program.flavour,
        seed=program.seed, d=program.d, batch=BATCH, id_length=ID_LENGTH, vocab=VOCAB,
        dynamic=program.dynamic_batch, spec=program.to_json())
    # (a generated file: unused values and imports are the grammar's)
    return (f'"""{doc.strip()}\n"""\n# ruff: noqa\n' + header + setup + "\n"
            + textwrap.indent(step, "    ") + "\n    return step, state\n" + _FOOTER)


_loaded = itertools.count()


def load(source: str) -> types.ModuleType:
    """Runs `source` as a fresh module (its own namespace).

    Its lines are put in ``linecache`` under a made-up file name, as if read
    from a file: AutoGraph reads a function's source to convert it."""
    name = f"progen_program_{next(_loaded)}"
    module = types.ModuleType(name)
    module.__file__ = f"<{name}>"
    linecache.cache[module.__file__] = (len(source), None, source.splitlines(True),
                                        module.__file__)
    exec(compile(source, module.__file__, "exec"), module.__dict__)  # noqa: S102
    return module


class _Writer:
    """Renders statements: setup lines for build() and code lines for the bodies."""

    def __init__(self, program: Program):
        self.p = program
        self.d = program.d
        self.setup: list[str] = []  # variables, layers, then nested functions
        self.keys = 0

    def key(self) -> int:
        self.keys += 1
        return self.keys

    # -- the step -------------------------------------------------------------------

    def step(self) -> str:
        p = self.p
        body, last = self.block(p.stmts, "x0", top=True)
        lines = ["@tf.function", "def step(x0, x1, ids, labels):"]
        inner: list[str] = []
        returns: list[str] = []
        if p.tape:
            inner += ["with tf.GradientTape() as tape:", "    tape.watch([x0, x1])"]
            inner += ["    " + line for line in body]
            inner += ["    " + line for line in self.loss(last)]
            inner += ["grads = tape.gradient(loss, train + [x0, x1],",
                      "                      unconnected_gradients=tf.UnconnectedGradients.ZERO)",
                      "weight_grads, input_grads = grads[:len(train)], grads[len(train):]"]
            inner += self.update()
            returns += ['"loss": loss',
                        '"grads": [tf.convert_to_tensor(g) for g in weight_grads]',
                        '"input_grads": input_grads']
        else:
            inner += body
        returns += [f'"{name}": {name}' for name in dict.fromkeys([*p.outputs, last])
                    if name != "x0"]
        if last == "x0":
            returns.append('"last": x0 * 1.0')
        if p.int_output:  # (integers whose values no rounding can change)
            returns += ['"argmax": tf.argmax(x1, axis=-1)', f'"shape": tf.shape({last})']
        inner.append("return {" + ", ".join(returns) + "}")
        self.optimizer_setup()
        return "\n".join(lines + ["    " + line for line in inner])

    def loss(self, last: str) -> list[str]:
        p = self.p
        if p.loss == "xent":
            return ["loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits("
                    f"labels, {last}))"]
        lines = [f"loss = tf.reduce_mean(tf.square({last}))"]
        if p.loss == "mse_aux" and p.aux:
            lines.append(f"loss = loss + 0.5 * tf.reduce_mean(tf.square({p.aux}))")
        return lines

    def update(self) -> list[str]:
        opt = self.p.optimizer
        if opt == "none":
            return []
        if opt == "manual_sgd":
            return ["for v, g in zip(train, weight_grads):",
                    f"    v.assign_sub({_LEARNING_RATE} * tf.convert_to_tensor(g))"]
        return ["if train:", "    opt.apply_gradients(zip(weight_grads, train))"]

    def optimizer_setup(self) -> None:
        opt = self.p.optimizer
        if opt in ("none", "manual_sgd"):
            return
        made = {"sgd": f"K.optimizers.SGD(learning_rate={_LEARNING_RATE})",
                "momentum": f"K.optimizers.SGD(learning_rate={_LEARNING_RATE}, momentum=0.875)",
                "adam": "K.optimizers.Adam(learning_rate=2.0 ** -6)",
                "adamw_clip": "K.optimizers.AdamW(learning_rate=2.0 ** -6, "
                              "weight_decay=0.0625, global_clipnorm=1.0)"}[opt]
        self.setup += [f"opt = {made}", "if train:", "    opt.build(train)",
                       "    state.extend(opt.variables)"]

    # -- blocks of statements ----------------------------------------------------------

    def block(self, stmts: list[Stmt], first: str, top: bool = False) -> tuple[list[str], str]:
        """(lines, name of the last value) of `stmts`, whose input "@in" is `first`."""
        lines: list[str] = []
        last = first
        for stmt in stmts:
            args = [first if a == "@in" else a for a in stmt.args]
            lines += getattr(self, f"_{stmt.kind}")(stmt, *args)
            last = stmt.out
        return lines, last

    # -- leaf statements: each returns code lines assigning stmt.out -------------------

    def _den(self, fan_in: int) -> int:
        return 16 if fan_in > 16 else 8

    def _dense(self, s: Stmt, a: str) -> list[str]:
        k, d, o = self.key(), self.d, s.out
        self.setup += [f"W_{o} = var({k}, ({d}, {d}), den={self._den(d)})",
                       f"b_{o} = var({k + 100}, ({d},), lim=2)"]
        variant = s.params["variant"]
        if variant == "bias_add":
            return [f"{o} = tf.nn.bias_add(tf.matmul({a}, W_{o}), b_{o})"]
        if variant == "l2_head":  # a projection head: ReLU, l2-normalised, a matmul
            # (its first row zeroed, as a ReLU's or a padded step's can be:
            # l2_normalize's rsqrt is then 1 / sqrt(1e-12) = 1e6)
            self.setup.append(f"V_{o} = var({k + 200}, ({d}, {d}), den={self._den(d)})")
            keep = f"tf.cast(tf.range(tf.shape({a})[0]) > 0, tf.float32)[:, None]"
            return [f"h_{o} = tf.nn.relu(tf.matmul({a}, W_{o}) + b_{o}) * {keep}",
                    f"{o} = tf.matmul(tf.math.l2_normalize(h_{o}, axis=-1), V_{o})"]
        if variant == "unit_head":  # the same, normalised as Keras 3 does
            # (x * minimum(rsqrt(sum(x * x)), 1 / 1e-12): the rsqrt of the zero row
            # is inf in float32 too, clamped to 1e12)
            self.setup.append(f"V_{o} = var({k + 200}, ({d}, {d}), den={self._den(d)})")
            keep = f"tf.cast(tf.range(tf.shape({a})[0]) > 0, tf.float32)[:, None]"
            inv = (f"tf.minimum(tf.math.rsqrt(tf.reduce_sum(tf.square(h_{o}), -1, "
                   f"keepdims=True)), 1e12)")
            return [f"h_{o} = tf.nn.relu(tf.matmul({a}, W_{o}) + b_{o}) * {keep}",
                    f"{o} = tf.matmul(h_{o} * {inv}, V_{o})"]
        return [f"{o} = " + _ACTIVATIONS[variant].format(f"tf.matmul({a}, W_{o}) + b_{o}")]

    def _einsum(self, s: Stmt, a: str) -> list[str]:
        d, o = self.d, s.out
        if s.params["variant"] == "rowdot":
            return [f'{o} = {a} * tf.einsum("bi,bi->b", {a}, {a})[:, None] / {float(d)}']
        self.setup.append(f"W_{o} = var({self.key()}, ({d}, {d}), den={self._den(d)})")
        return [f'{o} = tf.einsum("bi,ij->bj", {a}, W_{o})']

    def _keras_dense(self, s: Stmt, a: str) -> list[str]:
        d, o = self.d, s.out
        activation = s.params["variant"]
        self.setup.append(f"L_{o} = layer({self.key()}, K.layers.Dense({d}, "
                          f"activation={activation!r}), (None, {d}))")
        return [f"{o} = L_{o}({a})"]

    def _keras_rnn(self, s: Stmt, a: str) -> list[str]:
        d, o = self.d, s.out
        t, e = sequence_layout(d, s.params["layout"])
        cell = {"lstm": "LSTM", "gru": "GRU", "simple_rnn": "SimpleRNN"}[s.params["variant"]]
        self.setup.append(f"L_{o} = layer({self.key()}, K.layers.{cell}({e}, "
                          f"return_sequences=True), (None, {t}, {e}))")
        return [f"{o} = tf.reshape(L_{o}(tf.reshape({a}, [-1, {t}, {e}])), [-1, {d}])"]

    def _keras_mha(self, s: Stmt, a: str) -> list[str]:
        d, o = self.d, s.out
        t, e = sequence_layout(d, s.params["layout"])
        self.setup.append(f"L_{o} = called({self.key()}, K.layers.MultiHeadAttention(2, "
                          f"{max(e // 2, 1)}), tf.zeros([1, {t}, {e}]), tf.zeros([1, {t}, {e}]))")
        lines = [f"x3_{o} = tf.reshape({a}, [-1, {t}, {e}])"]
        mask = ""
        if s.params["variant"] == "padded":
            # keys marked padding by the ids; the first sample's keys all padding
            lines += [f"valid_{o} = ids[:, :{t}] % 3 != 0",
                      f"valid_{o} = tf.concat([tf.zeros_like(valid_{o}[:1]), valid_{o}[1:]], 0)",
                      f"mask_{o} = tf.tile(valid_{o}[:, None, :], [1, {t}, 1])"]
            mask = f", attention_mask=mask_{o}"
        lines.append(f"{o} = tf.reshape(L_{o}(x3_{o}, x3_{o}{mask}), [-1, {d}])")
        return lines

    def _conv(self, s: Stmt, a: str) -> list[str]:
        d, o = self.d, s.out
        h, w, c = image_layout(d, s.params["layout"])
        ks, variant = s.params["k"], s.params["variant"]
        view = f"tf.reshape({a}, [-1, {h}, {w}, {c}])"
        if variant == "depthwise":
            self.setup.append(f"F_{o} = var({self.key()}, ({ks}, {ks}, {c}, 1), den=8)")
            y = f'tf.nn.depthwise_conv2d({view}, F_{o}, [1, 1, 1, 1], "SAME")'
        elif variant == "conv1d":
            self.setup.append(f"F_{o} = var({self.key()}, ({ks}, {c}, {c}), "
                              f"den={self._den(ks * c)})")
            y = f'tf.nn.conv1d(tf.reshape({a}, [-1, {h * w}, {c}]), F_{o}, 1, "SAME")'
        elif variant == "keras_conv2d":
            self.setup.append(f"L_{o} = layer({self.key()}, K.layers.Conv2D({c}, {ks}, "
                              f'padding="same"), (None, {h}, {w}, {c}))')
            y = f"L_{o}({view})"
        elif variant == "transpose":  # (a forward Conv2DBackpropInput)
            self.setup.append(f"F_{o} = var({self.key()}, ({ks}, {ks}, {c}, {c}), "
                              f"den={self._den(ks * ks * c)})")
            y = (f"tf.nn.conv2d_transpose({view}, F_{o}, [tf.shape({a})[0], {h}, {w}, {c}], "
                 f'1, "SAME")')
        elif variant == "separable":
            k = self.key()
            self.setup += [f"D_{o} = var({k}, ({ks}, {ks}, {c}, 1), den=8)",
                           f"P_{o} = var({k + 100}, (1, 1, {c}, {c}), den={self._den(c)})"]
            y = f'tf.nn.separable_conv2d({view}, D_{o}, P_{o}, [1, 1, 1, 1], "SAME")'
        elif variant == "resize":  # a 2x2 average down, bilinear back up
            y = (f'tf.image.resize(tf.nn.avg_pool2d({view}, 2, 2, "VALID"), [{h}, {w}], '
                 f'"bilinear")')
        else:
            self.setup.append(f"F_{o} = var({self.key()}, ({ks}, {ks}, {c}, {c}), "
                              f"den={self._den(ks * ks * c)})")
            y = f'tf.nn.conv2d({view}, F_{o}, 1, "SAME")'
            if variant == "conv2d_relu_pool":
                y = f'tf.nn.max_pool2d(tf.nn.relu({y}), 2, 1, "SAME")'
            elif variant == "avg_pool":
                y = f'tf.nn.avg_pool2d({y}, 2, 1, "SAME")'
        return [f"{o} = tf.reshape({y}, [-1, {d}])"]

    def _scale_and_offset(self, o: str, c: int) -> None:
        k = self.key()
        self.setup += [f"g_{o} = var({k}, ({c},), value=1.0 + grid({k}, ({c},), 2, 8))",
                       f"beta_{o} = var({k + 100}, ({c},), lim=2, den=8)"]

    def _bn_moments(self, s: Stmt, a: str) -> list[str]:
        d, o = self.d, s.out
        h, w, c = image_layout(d, s.params["layout"])
        self._scale_and_offset(o, c)
        lines = [f"x4_{o} = tf.reshape({a}, [-1, {h}, {w}, {c}])",
                 f"mean_{o}, var_{o} = tf.nn.moments(x4_{o}, axes=[0, 1, 2])",
                 f"{o} = tf.reshape(tf.nn.batch_normalization(x4_{o}, mean_{o}, var_{o}, "
                 f"beta_{o}, g_{o}, 1e-3), [-1, {d}])"]
        if s.params["variant"] == "moving_average":
            self.setup.append(f"mm_{o} = var({self.key()}, ({c},), trainable=False)")
            lines.append(f"mm_{o}.assign(mm_{o} * 0.875 + mean_{o} * 0.125)")
        return lines

    def _bn_fused(self, s: Stmt, a: str) -> list[str]:
        d, o = self.d, s.out
        h, w, c = image_layout(d, s.params["layout"])
        self._scale_and_offset(o, c)
        view = f"tf.reshape({a}, [-1, {h}, {w}, {c}])"
        if s.params["variant"] == "inference":
            k = self.key()
            self.setup += [f"mm_{o} = var({k}, ({c},), trainable=False)",
                           f"mv_{o} = var({k + 100}, ({c},), trainable=False, "
                           f"value=1.0 + np.abs(grid({k + 100}, ({c},), 4, 8)))"]
            call = (f"tf.compat.v1.nn.fused_batch_norm({view}, g_{o}, beta_{o}, mean=mm_{o}, "
                    f"variance=mv_{o}, epsilon=1e-3, is_training=False)")
        else:
            call = (f"tf.compat.v1.nn.fused_batch_norm({view}, g_{o}, beta_{o}, epsilon=1e-3, "
                    f"is_training=True)")
        return [f"{o} = tf.reshape({call}[0], [-1, {d}])"]

    def _keras_bn(self, s: Stmt, a: str) -> list[str]:
        d, o = self.d, s.out
        if s.params["variant"] == "2d":
            self.setup.append(f"L_{o} = layer({self.key()}, K.layers.BatchNormalization(), "
                              f"(None, {d}))")
            return [f"{o} = L_{o}({a}, training=True)"]
        h, w, c = image_layout(d, s.params["layout"])
        self.setup.append(f"L_{o} = layer({self.key()}, K.layers.BatchNormalization(), "
                          f"(None, {h}, {w}, {c}))")
        return [f"{o} = tf.reshape(L_{o}(tf.reshape({a}, [-1, {h}, {w}, {c}]), "
                f"training=True), [-1, {d}])"]

    def _layernorm(self, s: Stmt, a: str) -> list[str]:
        d, o = self.d, s.out
        if s.params["variant"] == "keras":
            self.setup.append(f"L_{o} = layer({self.key()}, K.layers.LayerNormalization(), "
                              f"(None, {d}))")
            return [f"{o} = L_{o}({a})"]
        if s.params["variant"] == "one_channel":
            # (keras.io's timeseries Transformer: a LayerNorm over a series' one
            # channel, eps 1e-6; its output is beta and x's gradient 0 exactly)
            self.setup.append(f"L_{o} = layer({self.key()}, K.layers.LayerNormalization("
                              f"epsilon=1e-6), (None, {d}, 1))")
            return [f"{o} = tf.reshape(L_{o}(tf.reshape({a}, [-1, {d}, 1])), tf.shape({a}))"]
        self._scale_and_offset(o, d)
        return [f"mean_{o}, var_{o} = tf.nn.moments({a}, axes=[-1], keepdims=True)",
                f"{o} = ({a} - mean_{o}) * tf.math.rsqrt(var_{o} + 1e-3) * g_{o} + beta_{o}"]

    def _attention(self, s: Stmt, a: str) -> list[str]:
        d, o = self.d, s.out
        t, e = sequence_layout(d, s.params["layout"])
        k = self.key()
        for index, name in enumerate("qkv"):
            self.setup.append(f"W{name}_{o} = var({k + index}, ({e}, {e}), den={self._den(e)})")
        lines = [f"x3_{o} = tf.reshape({a}, [-1, {t}, {e}])"]
        if s.params["variant"] == "einsum":
            lines += [f'{n}_{o} = tf.einsum("bte,ef->btf", x3_{o}, W{n}_{o})' for n in "qkv"]
            lines += [f'p_{o} = tf.nn.softmax(tf.einsum("bqe,bke->bqk", q_{o}, k_{o}) * '
                      f'{e ** -0.5})',
                      f'{o} = tf.reshape(tf.einsum("bqk,bke->bqe", p_{o}, v_{o}), [-1, {d}])']
            return lines
        lines += [f"{n}_{o} = tf.matmul(x3_{o}, W{n}_{o})" for n in "qkv"]
        lines.append(f"s_{o} = tf.matmul(q_{o}, k_{o}, transpose_b=True) * {e ** -0.5}")
        if s.params["variant"] == "causal":
            lines += [f"mask_{o} = tf.linalg.band_part(tf.ones([{t}, {t}]), -1, 0)",
                      f"s_{o} = s_{o} + (1.0 - mask_{o}) * -1e9"]
        if s.params["variant"] == "bias":
            # a bias made once, outside the step (a constant it captures, which a
            # body reads as an argument): keys padded at random, the first
            # sample's all padding
            self.setup.append(
                f"B_{o} = tf.constant((1.0 - np.concatenate([np.zeros((1, {t})), "
                f"ints({k + 3}, (BATCH - 1, {t}), 3) != 0], 0)[:, None, :]) * -1e9, "
                f"tf.float32)")
            lines.append(f"s_{o} = s_{o} + B_{o}")
        if s.params["variant"] == "padded":
            # keys marked padding by the ids; the first sample's keys all padding (a
            # padded query's row: float32's softmax of equal -1e9s is uniform)
            lines += [f"valid_{o} = tf.cast(ids[:, :{t}] % 3 != 0, tf.float32)",
                      f"valid_{o} = tf.concat([tf.zeros_like(valid_{o}[:1]), valid_{o}[1:]], 0)",
                      f"s_{o} = s_{o} + (1.0 - valid_{o}[:, None, :]) * -1e9"]
        lines.append(f"{o} = tf.reshape(tf.matmul(tf.nn.softmax(s_{o}), v_{o}), [-1, {d}])")
        return lines

    def _softmax(self, s: Stmt, a: str) -> list[str]:
        o = s.out
        if s.params["variant"] == "log_softmax":
            return [f"{o} = tf.nn.log_softmax({a}, axis=-1) * 0.25"]
        if s.params["variant"] == "written_out":  # exp(x - max(x)) / sum
            return [f"e_{o} = tf.exp({a} * 2.0 - tf.reduce_max({a} * 2.0, axis=-1, keepdims=True))",
                    f"{o} = e_{o} / tf.reduce_sum(e_{o}, axis=-1, keepdims=True) * {float(self.d)}"]
        if s.params["variant"] == "two_axes":  # Keras's Softmax layer over two axes
            half = self.d // 2
            return [f"x_{o} = tf.reshape({a} * 2.0, [-1, 2, {half}])",
                    f"{o} = tf.reshape(tf.exp(x_{o} - tf.reduce_logsumexp("
                    f"x_{o}, axis=[1, 2], keepdims=True)), [-1, {self.d}]) * {float(self.d)}"]
        return [f"{o} = tf.nn.softmax({a} * 2.0, axis=-1) * {float(self.d)}"]

    def _bmm(self, s: Stmt, a: str, b: str) -> list[str]:
        o = s.out
        return [f"s_{o} = tf.matmul({a}, {b}, transpose_b=True) / {float(self.d)}",
                f"{o} = tf.matmul(tf.nn.softmax(s_{o}), {b})"]

    def _embedding(self, s: Stmt, a: str) -> list[str]:
        d, o = self.d, s.out
        t, e = sequence_layout(d, s.params["layout"])
        variant = s.params["variant"]
        ids = f"ids[:, :{t}]"
        if variant == "keras":
            self.setup.append(f"L_{o} = layer({self.key()}, K.layers.Embedding({VOCAB}, {e}), "
                              f"(None, {t}))")
            emb = f"L_{o}({ids})"
        elif variant == "tied":  # a tied output layer: the looked-up table, transposed
            self.setup.append(f"E_{o} = var({self.key()}, ({VOCAB}, {e}), den=8)")
            return [f"logits_{o} = tf.matmul(tf.reshape({a}, [-1, {t}, {e}]), E_{o}, "
                    f"transpose_b=True)",
                    f"back_{o} = tf.matmul(tf.nn.softmax(logits_{o}), E_{o})",
                    f"{o} = {a} + tf.reshape(tf.gather(E_{o}, {ids}) + back_{o}, [-1, {d}])"]
        else:
            self.setup.append(f"E_{o} = var({self.key()}, ({VOCAB}, {e}), den=8)")
            emb = {"gather": f"tf.gather(E_{o}, {ids})",
                   "lookup": f"tf.nn.embedding_lookup(E_{o}, {ids})",
                   "one_hot": f'tf.einsum("btv,ve->bte", tf.one_hot({ids}, {VOCAB}), E_{o})',
                   }[variant]
        return [f"{o} = {a} + tf.reshape({emb}, [-1, {d}])"]

    def _int_ops(self, s: Stmt, a: str) -> list[str]:
        d, o = self.d, s.out
        return {
            "rsqrt_size": [f"{o} = {a} * tf.math.rsqrt(tf.cast(tf.shape({a})[-1], tf.float32)) "
                           f"* 4.0"],
            "positions": [f"{o} = {a} + tf.cast(tf.range({d}), tf.float32)[None, :] / {d}.0"],
            "argmax_one_hot": [f"{o} = {a} + tf.one_hot(tf.argmax(x1, axis=-1), {d})"],
            "segment_sum": [f"seg_{o} = labels % 2",
                            f"sums_{o} = tf.math.unsorted_segment_sum({a}, seg_{o}, 2)",
                            f"{o} = {a} - 0.25 * tf.gather(sums_{o}, seg_{o})"],
            "range_mask": [f"n_{o} = tf.shape({a})[-1] // 2",
                           f"{o} = {a} * tf.cast(tf.range({d}) < n_{o}, tf.float32) + 0.5 * {a}"],
        }[s.params["variant"]]

    def _reduce(self, s: Stmt, a: str) -> list[str]:
        d, o = self.d, s.out
        r = {"sum": f"tf.reduce_sum({a}, axis=-1, keepdims=True) / {float(d)}",
             "mean": f"tf.reduce_mean({a}, axis=-1, keepdims=True)",
             "max": f"tf.reduce_max({a}, axis=-1, keepdims=True)",
             "min": f"tf.reduce_min({a}, axis=-1, keepdims=True)",
             "logsumexp": f"tf.reduce_logsumexp({a}, axis=-1, keepdims=True)",
             "l2": f"tf.norm({a}, axis=-1, keepdims=True)",
             "mean_all": f"tf.reduce_mean({a})",
             "sum_batch": f"tf.reduce_sum({a}, axis=0, keepdims=True)",
             "top_k": f"tf.reduce_mean(tf.math.top_k({a}, k=2).values, axis=-1, keepdims=True)",
             }[s.params["variant"]]
        combine = {"sub": f"{a} - r_{o}", "mul": f"{a} * tf.tanh(r_{o})",
                   "div": f"{a} / (1.0 + tf.abs(r_{o}))"}[s.params["combine"]]
        return [f"r_{o} = {r}", f"{o} = {combine}"]

    def _cumsum(self, s: Stmt, a: str) -> list[str]:
        return [f"{s.out} = tf.math.cumsum({a}, axis=-1) / {float(self.d)}"]

    def _where(self, s: Stmt, a: str, b: str) -> list[str]:
        o = s.out
        return {
            "leaky": [f"{o} = tf.where({a} > 0, {a}, 0.125 * {a})"],
            "finite": [f"{o} = tf.where(tf.math.is_finite({a}), {a}, tf.zeros_like({a}))"],
            "pick": [f"{o} = tf.where({a} > {b}, {a}, {b})"],
            "labels": [f"{o} = tf.where(tf.equal(labels % 2, 0)[:, None], {a}, {b})"],
        }[s.params["variant"]]

    def _cast(self, s: Stmt, a: str) -> list[str]:
        o = s.out
        return {
            "half_round_trip": [f"{o} = tf.cast(tf.cast({a}, tf.float16), tf.float32)"],
            "bf16_round_trip": [f"{o} = tf.cast(tf.cast({a}, tf.bfloat16) * 2.0, tf.float32)"],
            "float64": [f"{o} = tf.cast(tf.cast({a}, tf.float64) * 1.5 + 0.25, tf.float32)"],
            "bool_mask": [f"{o} = {a} * tf.cast({a} > 0, tf.float32) + 0.5 * {a}"],
            "int_floor": [f"{o} = tf.cast(tf.cast(x0 * 4.0, tf.int32), tf.float32) / 4.0 "
                          f"+ 0.5 * {a}"],
        }[s.params["variant"]]

    def _random(self, s: Stmt, a: str) -> list[str]:
        o, seed = s.out, s.params["seed"]
        variant = s.params["variant"]
        if variant == "generator":
            self.setup += [f"gen_{o} = tf.random.Generator.from_seed({seed})",
                           f"state.append(gen_{o}.state)"]
            return [f"{o} = {a} + 0.25 * gen_{o}.normal(tf.shape({a}))"]
        return {
            "stateless_normal": [f"{o} = {a} + 0.25 * tf.random.stateless_normal("
                                 f"tf.shape({a}), seed=[{seed}, 1])"],
            "stateless_dropout": [f"{o} = tf.nn.experimental.stateless_dropout({a}, rate=0.25, "
                                  f"seed=[{seed}, 2])"],
            "stateless_uniform": [f"{o} = {a} * tf.random.stateless_uniform(tf.shape({a}), "
                                  f"seed=[{seed}, 3], minval=0.5, maxval=1.5)"],
        }[variant]

    def _unary(self, s: Stmt, a: str) -> list[str]:
        expr = {
            "exp": f"tf.exp(tf.clip_by_value({a}, -4.0, 2.0)) * 0.25",
            "log1p_sq": f"tf.math.log1p({a} * {a})",
            # (floor 0.55, not clip's bound 0.5: 16-bit rounding of a tiny
            # a * a put sqrt(a * a + 0.25) exactly on the bound, whose gradient
            # float32 never passes; the long mode's 3000474, session 15)
            "sqrt": f"tf.sqrt({a} * {a} + 0.3)",
            "pow": f"tf.pow(tf.abs({a}) + 0.5, 1.5)",
            "square": f"tf.square({a}) * 0.5",
            "rsqrt": f"tf.math.rsqrt({a} * {a} + 1.0)",
            "erf": f"tf.math.erf({a})",
            "reciprocal": f"1.0 / (1.0 + tf.abs({a}))",
            "clip": f"tf.clip_by_value({a}, -0.5, 0.5)",
            "sin": f"tf.sin({a} * 2.0)",
            "swish": f"{a} * tf.sigmoid({a})",
            "softsign": f"tf.nn.softsign({a})",
            "selu": f"tf.nn.selu({a})",
            "log_sigmoid": f"tf.math.log_sigmoid({a})",
            "l2_normalize": f"tf.math.l2_normalize({a}, axis=-1)",
        }[s.params["variant"]]
        return [f"{s.out} = {expr}"]

    def _binary(self, s: Stmt, a: str, b: str) -> list[str]:
        expr = {
            "add": f"{a} + {b}", "mul": f"{a} * {b}", "sub": f"{a} - 0.5 * {b}",
            "maximum": f"tf.maximum({a}, {b})",
            "sqdiff": f"tf.math.squared_difference({a}, {b}) * 0.5",
            "div": f"{a} / (1.0 + {b} * {b})",
        }[s.params["variant"]]
        return [f"{s.out} = {expr}"]

    def _shape(self, s: Stmt, a: str, b: str) -> list[str]:
        d, o = self.d, s.out
        half = d // 2
        return {
            "concat_split": [f"c_{o} = tf.concat([{a}, {b}], axis=-1)",
                             f"s1_{o}, s2_{o} = tf.split(c_{o}, 2, axis=-1)",
                             f"{o} = s1_{o} * 0.75 + s2_{o} * 0.25"],
            "stack_mean": [f"{o} = tf.reduce_mean(tf.stack([{a}, {b}], axis=1), axis=1)"],
            "transpose": [f"{o} = tf.reshape(tf.transpose(tf.reshape({a}, [-1, {half}, 2]), "
                          f"[0, 2, 1]), [-1, {d}])"],
            "pad_slice": [f"{o} = tf.pad({a}, [[0, 0], [1, 1]])[:, 1:-1] "
                          f"+ tf.pad({b}, [[0, 0], [2, 0]])[:, :{d}]"],
            "tile_slice": [f"{o} = tf.tile({a}, [1, 2])[:, {half}:{half + d}]"],
            "roll_reverse": [f"{o} = tf.roll({a}, shift=1, axis=1) + 0.5 * tf.reverse({b}, [1])"],
            "gather": [f"{o} = tf.gather({a}, {[(3 * i + 1) % d for i in range(d)]}, axis=1)"],
        }[s.params["variant"]]

    # -- blocks -------------------------------------------------------------------------

    def _body(self, s: Stmt, first: str) -> tuple[list[str], str]:
        return self.block(s.body or [], first)

    def _while(self, s: Stmt, a: str) -> list[str]:
        o, n = s.out, s.params["trips"]
        body, last = self._body(s, f"h_{o}")
        return ([f"def body_{o}(i, h_{o}):"] + _indent(body)
                + [f"    return i + 1, {last}",
                   f"_, {o} = tf.while_loop(lambda i, h: i < {n}, body_{o}, "
                   f"(tf.constant(0), {a}), maximum_iterations={n})"])

    def _map_fn(self, s: Stmt, a: str) -> list[str]:
        o = s.out
        body, last = self._body(s, f"h_{o}")
        return ([f"def row_{o}(r):", f"    h_{o} = r[None, :]"] + _indent(body)
                + [f"    return {last}[0]", f"{o} = tf.map_fn(row_{o}, {a})"])

    def _scan(self, s: Stmt, a: str) -> list[str]:
        o = s.out
        body, last = self._body(s, f"h_{o}")
        return ([f"def scan_{o}(acc, r):", f"    h_{o} = (acc * 0.5 + r)[None, :]"]
                + _indent(body)
                + [f"    return {last}[0]",
                   f"{o} = tf.scan(scan_{o}, {a}, initializer=tf.zeros([{self.d}]))"])

    def _tensorlist(self, s: Stmt, a: str) -> list[str]:
        o, n = s.out, s.params["trips"]
        body, last = self._body(s, f"h_{o}")
        if s.params["variant"] == "list_ops":
            push = f"list_ops.tensor_list_push_back(acc, {last})"
            start = (f"list_ops.empty_tensor_list(element_shape=tf.shape({a}), "
                     f"element_dtype=tf.float32, max_num_elements={n})")
            stack = f"list_ops.tensor_list_stack(acc_{o}, tf.float32)"
        else:
            push = f"acc.write(i, {last})"
            start = f"tf.TensorArray(tf.float32, size={n})"
            stack = f"acc_{o}.stack()"
        return ([f"def body_{o}(i, h_{o}, acc):"] + _indent(body)
                + [f"    return i + 1, {last}, {push}",
                   f"_, _, acc_{o} = tf.while_loop(lambda i, *_: i < {n}, body_{o}, "
                   f"(tf.constant(0), {a}, {start}), maximum_iterations={n})",
                   f"{o} = tf.reduce_mean({stack}, axis=0)"])

    def _cond(self, s: Stmt, a: str) -> list[str]:
        o = s.out
        body, last = self._body(s, a)
        pred = ("tf.reduce_sum(labels) >= 0" if s.params["pred"] == "labels"
                else f"tf.reduce_max(tf.abs({a})) >= 0.0")
        return ([f"def then_{o}():"] + _indent(body or ["pass"]) + [f"    return {last}",
                f"{o} = tf.cond({pred}, then_{o}, lambda: {a} * 0.5)"])

    def _function(self, s: Stmt, a: str, decorator: str) -> list[str]:
        o = s.out
        body, last = self._body(s, f"h_{o}")
        self.setup += ["", decorator, f"def f_{o}(h_{o}):"] + _indent(body) + [
            f"    return {last}", ""]
        return [f"{o} = f_{o}({a})"]

    def _nested_fn(self, s: Stmt, a: str) -> list[str]:
        plain = s.params["variant"] == "plain"
        return self._function(s, a, "@tf.function(autograph=False)" if plain else "@tf.function")

    def _xla_fn(self, s: Stmt, a: str) -> list[str]:
        return self._function(s, a, "@tf.function(jit_compile=True)")

    def _tape(self, s: Stmt, a: str) -> list[str]:
        o = s.out
        body, last = self._body(s, a)
        return ([f"with tf.GradientTape() as tape_{o}:", f"    tape_{o}.watch({a})"]
                + _indent(body)
                + [f"    s_{o} = tf.reduce_sum(tf.square({last})) * 0.5",
                   f"{o} = {a} + 0.5 * tape_{o}.gradient(s_{o}, {a}, "
                   f"unconnected_gradients=tf.UnconnectedGradients.ZERO)"])


def _indent(lines: list[str]) -> list[str]:
    return ["    " + line for line in lines]


assert all(hasattr(_Writer, f"_{name}") for name in KINDS), "a kind without a renderer"
