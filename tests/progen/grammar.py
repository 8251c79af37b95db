"""What a generated program is made of, and how one is drawn from a seed.

A program is a training step over a "trunk" of float32 values that all have
the shape [batch, D]: every statement reads one or two earlier trunk values
and writes one new one (reshaping inside as a convolution or an attention
needs). So any statement can be removed by reading its first input instead,
and any block (a loop, a nested function, a tape) can be replaced by its body:
the shrinker needs nothing else. The kinds of statement are a table (KINDS),
each tagged with the feature it exercises; a program enables a random subset
of features and draws its statements from those.

Everything is JSON-able data (``Program.to_json``), written into each
generated file as ``SPEC`` so a kept regression can be shrunk again.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Iterator

# Where a statement sits: a set of restrictions. The step itself (and the
# bodies of loops, conds and tapes inside it) has none and sees the integer
# inputs ids / labels. NO_INTS: a nested function's body (it captures no step
# tensors). XLA: a jit_compile=True function's body. ROW: a map_fn / scan
# body, whose values have shape [1, D]. A body has its block's restrictions
# and those of where the block sits.
NO_INTS, XLA, ROW = "no_ints", "xla", "row"
# DIFFERENTIATED: a tape records it. A loop or a cond in an XLA function whose
# gradient is taken outside the function cannot run: TensorFlow does not pass a
# loop's TensorList accumulators across the XLA boundary ("Support for
# TensorList crossing the XLA/TF boundary is not implemented"), and a cond's
# intermediates leave it as Optionals, which XLA has no kernel for
# ("OptionalFromValue" on XLA_CPU_JIT; found by the long mode, session 13).
DIFFERENTIATED = "differentiated"
# TWICE: a tape's body inside another tape: the outer tape differentiates the
# inner one's gradient ops, and some have no gradient of their own in
# TensorFlow (SoftsignGrad: "gradient registry has no entry"; found by the long
# mode, session 13, program 2000796).
TWICE = "twice_differentiated"
_NOT_TWICE = {("unary", "softsign")}
TOP: frozenset[str] = frozenset()
# (A Keras recurrent layer runs a while loop.)
_NOT_DIFFERENTIATED_IN_XLA = frozenset({"while", "map_fn", "scan", "tensorlist", "cond",
                                        "keras_rnn"})


@dataclasses.dataclass(frozen=True)
class Kind:
    """One kind of statement.

    Attributes:
      name: the key in KINDS (and the renderer's name in ``source``).
      feature: the feature it exercises (what a program enables).
      arity: trunk values read (1 or 2).
      variants: choices of its ``params["variant"]``.
      block: whether it has a body of statements (a loop, function, tape).
      body_adds: restrictions its body adds to where the block sits.
    """

    name: str
    feature: str
    arity: int
    variants: tuple[str, ...] = ("",)
    block: bool = False
    body_adds: frozenset[str] = frozenset()


KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("dense", "dense", 1, ("relu", "tanh", "sigmoid", "gelu", "elu", "softplus",
                               "leaky_relu", "silu", "linear", "bias_add", "l2_head",
                               "unit_head")),
    Kind("einsum", "dense", 1, ("weight", "rowdot")),
    Kind("keras_dense", "keras_layer", 1, ("relu", "tanh", "linear")),
    Kind("keras_rnn", "keras_layer", 1, ("lstm", "gru", "simple_rnn")),
    Kind("keras_mha", "keras_layer", 1, ("self", "padded")),
    Kind("conv", "conv", 1, ("conv2d", "depthwise", "conv1d", "keras_conv2d",
                             "conv2d_relu_pool", "transpose", "separable", "avg_pool",
                             "resize")),
    Kind("bn_moments", "norm", 1, ("plain", "moving_average")),
    Kind("bn_fused", "norm", 1, ("training", "inference")),
    Kind("keras_bn", "norm", 1, ("4d", "2d")),
    Kind("layernorm", "norm", 1, ("manual", "keras", "one_channel")),
    Kind("attention", "attention", 1, ("plain", "causal", "einsum", "padded", "bias")),
    Kind("softmax", "attention", 1, ("softmax", "log_softmax", "written_out", "two_axes")),
    Kind("bmm", "attention", 2),
    Kind("embedding", "embedding", 1, ("gather", "lookup", "one_hot", "keras", "tied")),
    Kind("int_ops", "int_edge", 1, ("rsqrt_size", "positions", "argmax_one_hot",
                                    "segment_sum", "range_mask")),
    Kind("reduce", "reduction", 1, ("sum", "mean", "max", "min", "logsumexp", "l2",
                                    "mean_all", "sum_batch", "top_k")),
    Kind("cumsum", "reduction", 1),
    Kind("where", "where", 2, ("leaky", "finite", "pick", "labels")),
    Kind("cast", "cast", 1, ("half_round_trip", "bf16_round_trip", "float64", "bool_mask",
                             "int_floor")),
    Kind("random", "random", 1, ("stateless_normal", "stateless_dropout",
                                 "stateless_uniform", "generator")),
    Kind("unary", "elementwise", 1, ("exp", "log1p_sq", "sqrt", "pow", "square", "rsqrt",
                                     "erf", "reciprocal", "clip", "sin", "swish",
                                     "softsign", "selu", "log_sigmoid", "l2_normalize")),
    Kind("binary", "elementwise", 2, ("add", "mul", "sub", "maximum", "sqdiff", "div")),
    Kind("shape", "shape", 2, ("concat_split", "stack_mean", "transpose", "pad_slice",
                               "tile_slice", "roll_reverse", "gather")),
    # Blocks.
    Kind("while", "loop", 1, block=True),
    Kind("map_fn", "loop", 1, block=True, body_adds=frozenset({NO_INTS, ROW})),
    Kind("scan", "loop", 1, block=True, body_adds=frozenset({NO_INTS, ROW})),
    Kind("tensorlist", "tensorlist", 1, ("tensor_array", "list_ops"), block=True),
    Kind("cond", "cond", 1, block=True),
    Kind("nested_fn", "nested_function", 1, ("autograph", "plain"), block=True,
         body_adds=frozenset({NO_INTS})),
    Kind("xla_fn", "xla_function", 1, block=True, body_adds=frozenset({NO_INTS, XLA})),
    Kind("tape", "tape", 1, block=True, body_adds=frozenset({DIFFERENTIATED})),
)}

FEATURES = sorted({k.feature for k in KINDS.values()})
# Variants that need the batch's integer inputs, or cannot run under XLA.
# A value turned into an integer (a truncation, an argmax) is discontinuous: a
# rounding can move it by a whole step, which no tolerance can allow for, so
# those read the step's inputs (exact in 16-bit), which only the top sees.
_NEEDS_INTS = {("embedding", v) for v in KINDS["embedding"].variants} | {
    ("where", "labels"), ("int_ops", "segment_sum"), ("int_ops", "argmax_one_hot"),
    ("cast", "int_floor"), ("attention", "padded"), ("keras_mha", "padded")}
_NOT_IN_XLA = {("random", "generator")}
# A training-mode BatchNorm over the rows of a map_fn / scan body sees one
# sample per feature: its output is its offset whatever the input, and its
# gradient an exact cancellation in float32 that 16-bit rounding leaves as a
# residual times 1/sqrt(epsilon) (shrunk from the long mode's 2000574, session
# 14: bfloat16 moved such a gradient by 165%, beyond any rounding bound). It
# normalises nothing; a real model does not train that way.
# An attention bias made for the whole batch (attention/bias) has the batch's rows.
_NOT_IN_ROW = {("keras_bn", "2d"), ("attention", "bias")} | {
    ("keras_rnn", v) for v in ("lstm", "gru", "simple_rnn")}

OPTIMIZERS = ("none", "manual_sgd", "sgd", "momentum", "adam")
# Half the Adam programs train with AdamW, weight decay and clipping by the global
# norm (a transformer's usual optimizer: one norm over every gradient, read by every
# update). Drawn from a stream of its own, so every other choice of a seed stays.
ADAMW = "adamw_clip"
FLAVOURS = ("tf_keras", "keras3")
BATCH = 4
ID_LENGTH = 8  # ids input: [batch, ID_LENGTH] int32 in [0, VOCAB)
VOCAB = 8


@dataclasses.dataclass
class Stmt:
    """`out` = kind(args, params), with a body for blocks."""

    kind: str
    out: str
    args: list[str]
    params: dict
    body: list[Stmt] | None = None

    def to_json(self) -> dict:
        data = {"kind": self.kind, "out": self.out, "args": self.args, "params": self.params}
        if self.body is not None:
            data["body"] = [s.to_json() for s in self.body]
        return data

    @staticmethod
    def from_json(data: dict) -> Stmt:
        body = data.get("body")
        return Stmt(data["kind"], data["out"], list(data["args"]), dict(data["params"]),
                    None if body is None else [Stmt.from_json(s) for s in body])


@dataclasses.dataclass
class Program:
    """A training step: statements over the trunk, then a loss, a tape and an update.

    Attributes:
      seed: the program's seed (values come from it; see ``source``).
      d: the trunk's width D.
      dynamic_batch: traced with an unknown batch dimension.
      flavour: "tf_keras" or "keras3" (layers and optimizers).
      tape: the statements run under a GradientTape; the step returns gradients.
      optimizer: one of OPTIMIZERS, or ADAMW (with a tape).
      loss: "mse", "xent" (labels) or "mse_aux" (plus an earlier value's mean square).
      stmts: the top-level statements.
      outputs: trunk values returned besides the loss and gradients.
      int_output: also return argmax of the last value (an integer output).
    """

    seed: int
    d: int
    dynamic_batch: bool
    flavour: str
    tape: bool
    optimizer: str
    loss: str
    stmts: list[Stmt]
    outputs: list[str]
    int_output: bool
    aux: str = ""

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["stmts"] = [s.to_json() for s in self.stmts]
        return json.dumps(data, sort_keys=True)

    @staticmethod
    def from_json(text: str) -> Program:
        data = json.loads(text)
        data["stmts"] = [Stmt.from_json(s) for s in data["stmts"]]
        return Program(**data)

    def copy(self) -> Program:
        return Program.from_json(self.to_json())

    def walk(self) -> Iterator[tuple[Stmt, list[Stmt]]]:
        """Every statement, depth first, with the list that holds it."""
        def visit(stmts):
            for stmt in stmts:
                yield stmt, stmts
                if stmt.body is not None:
                    yield from visit(stmt.body)
        yield from visit(self.stmts)

    def features(self) -> dict[str, int]:
        """Feature -> number of statements exercising it (plus the step's own)."""
        counts: dict[str, int] = {}
        for stmt, _ in self.walk():
            feature = KINDS[stmt.kind].feature
            counts[feature] = counts.get(feature, 0) + 1
        for flag, name in ((self.tape, "tape"), (self.dynamic_batch, "dynamic_batch"),
                           (self.int_output, "int_edge")):
            if flag:
                counts[name] = counts.get(name, 0) + 1
        if self.optimizer not in ("none", "manual_sgd"):
            name = f"optimizer_{self.flavour}_{self.optimizer}"
            counts[name] = counts.get(name, 0) + 1
        return counts

    def size(self) -> int:
        return sum(1 for _ in self.walk())


def generate(seed: int) -> Program:
    """The program of `seed` (the same on every machine and Python version)."""
    rng = random.Random(seed)
    enabled = {f for f in FEATURES if rng.random() < 0.45} | {rng.choice(["dense", "conv"])}
    names = _Names()
    d = rng.choice([16, 32])
    tape = rng.random() < 0.8
    top = TOP | {DIFFERENTIATED} if tape else TOP
    stmts = _block(rng, enabled, names, top, ["x0", "x1"], rng.randint(2, 7), depth=0)
    values = [s.out for s in stmts]
    outputs = rng.sample(values, k=min(len(values), rng.randint(0, 2)))
    loss = rng.choice(["mse", "xent", "mse_aux"]) if tape else "mse"
    program = Program(
        seed=seed, d=d, dynamic_batch=rng.random() < 0.25, flavour=rng.choice(FLAVOURS),
        tape=tape, optimizer=rng.choice(OPTIMIZERS) if tape else "none",
        loss=loss, stmts=stmts, outputs=outputs, int_output=rng.random() < 0.2,
        aux=rng.choice(values) if loss == "mse_aux" else "")
    if program.optimizer == "adam" and random.Random(f"{seed}/adamw").random() < 0.5:
        program.optimizer = ADAMW
    return program


class _Names:
    def __init__(self):
        self.count = 0

    def __call__(self) -> str:
        self.count += 1
        return f"t{self.count}"


def allowed(kind: Kind, variant: str, context: frozenset[str]) -> bool:
    """May `kind` with `variant` sit in `context` (a set of restrictions)?"""
    if NO_INTS in context and (kind.name, variant) in _NEEDS_INTS:
        return False
    if TWICE in context and (kind.name, variant) in _NOT_TWICE:
        return False
    if ROW in context and (kind.name, variant) in _NOT_IN_ROW:
        return False
    if XLA in context and DIFFERENTIATED in context and kind.name in _NOT_DIFFERENTIATED_IN_XLA:
        return False
    return not (XLA in context and (kind.name, variant) in _NOT_IN_XLA)


def body_context(kind: Kind, context: frozenset[str]) -> frozenset[str]:
    """The restrictions of a block's body where the block sits in `context`."""
    if kind.name == "tape" and DIFFERENTIATED in context:
        return context | kind.body_adds | {TWICE}
    return context | kind.body_adds


def _block(rng: random.Random, enabled: set[str], names: _Names, context: frozenset[str],
           visible: list[str], count: int, depth: int) -> list[Stmt]:
    stmts: list[Stmt] = []
    visible = list(visible)
    choices = [k for k in KINDS.values() if k.feature in enabled
               and not (k.block and depth >= 2)]
    if not choices:
        choices = [KINDS["dense"]]
    for _ in range(count):
        kind = rng.choice(choices)
        variants = [v for v in kind.variants if allowed(kind, v, context)]
        if not variants:
            continue
        variant = rng.choice(variants)
        # Mostly the latest value (a chain), sometimes an earlier one (a branch).
        args = [visible[-1] if rng.random() < 0.7 else rng.choice(visible)]
        if kind.arity == 2:
            args.append(rng.choice(visible))
        params = {"variant": variant, **_params(rng, kind, context)}
        body = None
        if kind.block:
            inner = body_context(kind, context)
            body = _block(rng, enabled, names, inner, ["@in"], rng.randint(1, 2), depth + 1)
        stmt = Stmt(kind.name, names(), args, params, body)
        stmts.append(stmt)
        visible.append(stmt.out)
    return stmts


def _params(rng: random.Random, kind: Kind, context: frozenset[str]) -> dict:
    """The choices a kind makes besides its variant (sizes, axes, counts)."""
    if kind.name == "cond":  # (the predicate reads the labels where it can)
        return {"pred": "data" if NO_INTS in context else rng.choice(["labels", "data"])}
    if kind.name in ("while", "tensorlist"):
        return {"trips": rng.randint(1, 3)}
    if kind.name == "conv":
        return {"layout": rng.randint(0, 1), "k": rng.choice([1, 3])}
    if kind.name in ("attention", "bn_moments", "bn_fused", "keras_bn", "embedding",
                     "keras_rnn", "keras_mha"):
        return {"layout": rng.randint(0, 1)}
    if kind.name == "reduce":
        return {"combine": rng.choice(["sub", "mul", "div"])}
    if kind.name == "random":
        return {"seed": rng.randint(1, 1000)}
    return {}


# -- shapes the statements use: D split into factors -------------------------------

def image_layout(d: int, layout: int) -> tuple[int, int, int]:
    """(H, W, C) with H * W * C = d: a convolution's or BatchNorm's view of the trunk."""
    options = {16: [(2, 2, 4), (4, 4, 1)], 32: [(2, 2, 8), (4, 4, 2)]}[d]
    return options[layout % len(options)]


def sequence_layout(d: int, layout: int) -> tuple[int, int]:
    """(T, E) with T * E = d: an attention's or embedding's view of the trunk."""
    options = {16: [(4, 4), (2, 8)], 32: [(4, 8), (8, 4)]}[d]
    return options[layout % len(options)]
