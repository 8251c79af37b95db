"""What every rewrite of every generated program must satisfy.

For each configuration (float16 and bfloat16; the graph with ``_output_shapes``
and without; with shapes, the Casts also placed for XLA, run compiled by XLA
(on the CPU) where XLA compiles the float32 step, as a Keras 3 user's step
runs, else by TensorFlow's executor like the others; and float16 for a GPU,
checked without running):

1. ``rewrite_graph_def`` does not raise;
2. the input GraphDef's serialized bytes are unchanged;
3. ``tfamp.check_graph_def`` finds no problem (TensorFlow imports the result,
   every edge's dtype matches);
4. the step's outputs keep their dtypes;
5. variables stay float32 (no op that reads or writes a resource gets a 16-bit
   type), and nothing goes 16-bit where no allow-list op does (a program of
   data movement alone, a tf.cond around a flip, rounded for nothing: pix2pix's
   augmentation, session 43);
6. run on the CPU from the same variable values, the rewritten step's outputs
   and its variable updates agree with float32's within the tolerance below
   (a compiled run with the float32 step compiled by XLA, whose lowerings it
   shares: session 26's fused BatchNorm was exact on the executor, and XLA's
   expansion of its variance cancelled).

The tolerance. Inputs and weights lie on grids exact in both 16-bit types, so
the 16-bit run starts from the same numbers; only its rounding differs. Each
output is compared as a whole tensor (for a variable: its update, after -
before), with c the float32 result, n the result of a float32 run with
rounding noise of the 16-bit type's unit roundoff u at every op (``noise``),
and r the rewritten run:

- ill-conditioned at that precision, not compared: ``|n - c| > SKIP * |c|``
  (rounding alone moves it by more than a quarter: its 16-bit value may be
  anything, an overflow included), or c not finite;
- otherwise r is finite wherever c and n are (n overflows where a float16
  result would: see ``noise``), and where n is finite everywhere
  ``|r - c| <= K * |n - c| + F * u * |c|`` (norms over the tensor);
- integers (argmax, an optimizer's step count, a generator's state) must be
  equal, unless the noisy run changes them too.

A failure is a ``Failure`` with a ``signature`` the shrinker keeps while it
removes statements.
"""

from __future__ import annotations

import dataclasses
import hashlib
import sys
import time
import traceback
from collections.abc import Sequence

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import types_pb2
from tensorflow.python.util import nest

import tfamp
from tests.progen import noise
from tfamp.rewrite import boundaries
from tfamp.rewrite.graph import build_view, dtype_name
from tfamp.rewrite.shapes import without_recorded_shapes
from tfamp.runtime import runner

UNIT_ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}
TINY = {"float16": 2.0 ** -25, "bfloat16": 0.0}  # float16's subnormal half-spacing
# Past these a value overflows (float16 rounds 65520 and above to infinity).
LARGEST = {"float16": 65520.0, "bfloat16": np.inf}
K = 8.0
F = 8.0
SKIP = 0.25
# More samples of the noise a numerics failure is confirmed against (``check``),
# and a sample with no rounding noise in which near-tied values compare as equal
# (TIES: noise.rounding_noise's `ties_only`), and one in which sums within their
# rounding of zero change sign (CROSSED: `crossed`, a ReLU's other branch).
# Seven more random samples, not two: Adam's first step is lr * sign(g), and a
# gradient element the noise moves by many times its size may keep its sign in
# a few samples (13000886: a BatchNorm offset's gradient, 5e-5 in float32, a
# cancellation; bfloat16 rounding gives -2.7e-4; 1 of 8 samples flips it).
TIES = -1
CROSSED = -2
# The sample whose every rounding grows its value (`away`): which elements any
# sample could overflow. A non-finite 16-bit result is confirmed against it.
AWAY = -3
EXTRA_SALTS = (1, 2, 3, 4, 5, 6, 7, TIES, CROSSED)
_SIXTEEN = {types_pb2.DT_HALF, types_pb2.DT_BFLOAT16}


@dataclasses.dataclass(frozen=True)
class Config:
    dtype: str
    shapes: bool  # the GraphDef carries _output_shapes
    device: str = "CPU"
    run: bool = True
    # "auto": the executor's cost model unless the step is jit-compiled; "xla":
    # the rules for a step XLA compiles (its fused costs, float32 statistics in
    # bfloat16, ...), whose numerics a CPU run checks as well as any other
    runtime: str = "auto"

    def __str__(self) -> str:
        return (f"{self.dtype}/{'shapes' if self.shapes else 'no-shapes'}/{self.device}"
                f"{'' if self.runtime == 'auto' else '/' + self.runtime}"
                f"{'' if self.run else '/not-run'}")


CONFIGS = (Config("float16", True), Config("float16", False), Config("bfloat16", True),
           Config("bfloat16", False), Config("float16", True, runtime="xla"),
           Config("bfloat16", True, runtime="xla"), Config("float16", True, "GPU", run=False))


@dataclasses.dataclass
class Failure:
    invariant: str  # program, raises, input_mutated, invalid_graph, output_dtype,
    # variable_dtype, sixteen_without_allow, runs, nonfinite, numerics
    config: str
    message: str
    detail: str = ""  # (what the signature adds: an exception's type and place)

    def signature(self) -> tuple[str, str, str]:
        """What a shrunk program must still show to count as the same failure."""
        dtype = self.config.split("/")[0]
        return (self.invariant, dtype, self.detail)

    def __str__(self) -> str:
        return f"[{self.invariant}] {self.config}: {self.message}"


@dataclasses.dataclass
class Outcome:
    failures: list[Failure]
    compared: int = 0  # outputs compared numerically
    skipped: int = 0  # outputs not compared: ill-conditioned at that precision
    # of those, outputs the 16-bit run made non-finite (past its range, or an
    # ill-conditioned overflow): what the tolerance lets through, counted
    unjudged_nonfinite: int = 0
    ratios: list[float] = dataclasses.field(default_factory=list)  # |r - c| / bound
    # (|r - c|, |n - c|) / (u |c|) of every float output compared: what the
    # tolerance's constants are chosen from (BUILD_NOTES, session 12)
    errors: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    # rewrites run compiled by XLA (an XLA configuration where XLA compiles the
    # float32 step), and XLA configurations run on the executor (it does not)
    compiled: int = 0
    not_compiled: int = 0
    seconds: float = 0.0
    # TensorFlow's own float32 run of the program fails at run time (a kernel or a
    # grappler pass of TensorFlow's, not the rewrite): what it said. The rewrite is
    # still checked (invariants 1-5); its runs are not, having nothing to compare to.
    refused: str = ""

    @property
    def ok(self) -> bool:
        return not self.failures


def check(module, configs: Sequence[Config] = CONFIGS, numerics: bool = True,
          changes: dict | None = None, compiled_reference: bool = True) -> Outcome:
    """Checks a loaded program (see ``source``) under every configuration.

    Args:
      module: the program (``source.load``, or a program file imported).
      configs: the configurations to rewrite it in.
      numerics: also run the rewritten steps and compare (invariant 6).
      changes: ``AmpConfig`` list changes for the rewrite (tests of this
        harness: the tolerance's reference keeps the default lists).
      compiled_reference: compile the float32 step with XLA as the XLA
        configurations' reference; False runs them on the executor (where
        XLA's compile of the float32 step kills the process: longrun).
    """
    start = time.perf_counter()
    outcome = Outcome([])
    try:
        step, state = module.build()
        concrete = step.get_concrete_function(*module.input_specs())
        inputs = module.make_inputs()
        captured = list(concrete.variables)
        snapshot = [v.numpy() for v in captured]
        state = full_state(concrete, state)
        before = [v.numpy() for v in state]
    except Exception as err:  # (the program cannot be built: a generator bug)
        outcome.failures.append(Failure("program", "float32", _describe(err),
                                        type(err).__name__))
        outcome.seconds = time.perf_counter() - start
        return outcome
    try:
        clean = _run(concrete, inputs, state)
    except tf.errors.OpError as err:
        # TensorFlow refuses the float32 program it traced (45000613: grappler's
        # arithmetic optimizer and the oneDNN layer-norm fusion give a kernel an
        # offset of shape [1, 16]; 44000326: a oneDNN reorder). A user's script
        # would fail alike without tfamp; the rewrite is still checked.
        outcome.refused = _describe(err)
        numerics = False
    except Exception as err:  # (anything else: the generator's program is wrong)
        outcome.failures.append(Failure("program", "float32", _describe(err),
                                        type(err).__name__))
        outcome.seconds = time.perf_counter() - start
        return outcome
    graph_defs = {}
    outputs = [t.name for t in concrete.graph.outputs]
    jit = concrete._attrs.get("_XlaMustCompile") if hasattr(concrete, "_attrs") else None
    jit = bool(getattr(jit, "b", jit))
    results: dict[str, tuple] = {}  # a rewritten graph (as text) -> its run
    noisy: dict[str, tuple] = {}
    noisy_step = None
    # [float32's compiled run, or None: XLA cannot compile it]
    compiled_clean: list = [] if compiled_reference else [None]
    for config in configs:
        if config.shapes not in graph_defs:
            graph_defs[config.shapes] = concrete.graph.as_graph_def(add_shapes=config.shapes)
        graph_def = graph_defs[config.shapes]
        new = _rewrite_checked(graph_def, outputs, config, jit, outcome, changes or {})
        if new is None or not config.run or not numerics:
            continue
        reference, compile_it = clean, False
        if config.runtime == "xla" and not jit:  # (a jit step's runs are all compiled)
            if not compiled_clean:
                compiled_clean.append(_compiled_run(concrete, inputs, state, captured,
                                                    snapshot))
            if compiled_clean[0] is not None:
                reference, compile_it = compiled_clean[0], True
            outcome.compiled += compile_it
            outcome.not_compiled += not compile_it
        where = f"{config}/compiled" if compile_it else str(config)
        key = config.dtype + ("/compiled" if compile_it else "") + _fingerprint(new)
        if key not in results:
            try:
                rewritten = _concrete_from(new, concrete)
                _restore(captured, snapshot)
                results[key] = _run(_compiled(rewritten) if compile_it else rewritten,
                                    inputs, state)
            except Exception as err:
                outcome.failures.append(Failure("runs", where, _describe(err), _where(err)))
                continue
            finally:
                _restore(captured, snapshot)
        if config.dtype not in noisy:
            try:
                noisy_step = noisy_step or _NoisyStep(module)
                noisy[config.dtype] = noisy_step.run(config.dtype)
            except Exception as err:
                outcome.failures.append(Failure("program", f"{config.dtype}/noisy",
                                                _describe(err), type(err).__name__))
                continue
        found = Outcome([])
        _compare(reference, noisy[config.dtype], results[key], before, config, found,
                 label=where)
        reach = None
        if any(f.invariant == "nonfinite" for f in found.failures):
            # An element a 16-bit result overflows where this sample stayed finite
            # is confirmed against the sample that grows every value: past the
            # range there, another sample's signs could have overflowed it too.
            try:
                reach = noisy_step.run(config.dtype, AWAY)
            except Exception:  # (a sample that does not run: keep the first's verdict)
                reach = None
            if reach is not None:
                found = Outcome([])
                _compare(reference, noisy[config.dtype], results[key], before, config, found,
                         reach, label=where)
        if any(f.invariant == "numerics" for f in found.failures):
            # A numerics failure is confirmed against more samples of the noise
            # (5000536: an Adam update of a gradient that the noise moves by 0.3
            # to 4 times its size; one sample kept every sign, 5 of 8 flipped some,
            # and Adam turns a sign into a whole step), and against the sample
            # in which near-tied values compare as equal (9000082: a where that
            # 16-bit rounding turns): each output is judged against the sample
            # that moved it most.
            try:
                worst = _worst_noise(reference, [noisy[config.dtype]] + [
                    noisy_step.run(config.dtype, salt) for salt in EXTRA_SALTS])
            except Exception:  # (another sample that does not run: keep the first's verdict)
                worst = None
            if worst is not None:
                found = Outcome([])
                _compare(reference, worst, results[key], before, config, found, reach,
                         label=where)
        _merge(outcome, found)
    outcome.seconds = time.perf_counter() - start
    return outcome


def _fingerprint(graph_def) -> str:
    """A GraphDef's hash without what only records shapes (``_output_shapes``,
    resource arguments' ``handle_data``): the rewrites of a graph with and
    without shapes that decide alike run once."""
    bare = without_recorded_shapes(graph_def)
    for fdef in bare.library.function:
        for arg in (*fdef.signature.input_arg, *fdef.signature.output_arg):
            arg.ClearField("handle_data")
    return hashlib.sha256(bare.SerializeToString(deterministic=True)).hexdigest()


def _rewrite_checked(graph_def, outputs, config: Config, jit: bool, outcome: Outcome,
                     changes: dict):
    """Invariants 1-5 for one configuration; the rewritten GraphDef, or None."""
    serialized = graph_def.SerializeToString(deterministic=True)
    try:
        new, report = tfamp.rewrite_graph_def(
            graph_def, tfamp.AmpConfig(dtype=config.dtype, device_type=config.device,
                                       runtime=config.runtime, **changes),
            outputs=outputs, jit_compile=jit)
    except Exception as err:
        outcome.failures.append(Failure("raises", str(config), _describe(err), _where(err)))
        return None
    converted = [n for n in report.nodes if n.converted]
    if converted and not any(n.list == "allow" for n in converted):
        outcome.failures.append(Failure(
            "sixteen_without_allow", str(config),
            f"{len(converted)} ops converted with no allow-list op converted (first: "
            f"{converted[0].op} {converted[0].name!r}: {converted[0].reason[:120]})",
            converted[0].op))
    if graph_def.SerializeToString(deterministic=True) != serialized:
        outcome.failures.append(Failure("input_mutated", str(config),
                                        _what_changed(graph_def, serialized)))
    problems = tfamp.check_graph_def(new)
    if problems:
        outcome.failures.append(Failure("invalid_graph", str(config), "; ".join(problems[:3]),
                                        problems[0].split(":")[0][:60]))
        return None
    for failure in _dtype_problems(graph_def, new, outputs):
        outcome.failures.append(dataclasses.replace(failure, config=str(config)))
    return new


def _dtype_problems(old, new, outputs) -> list[Failure]:
    old_view, new_view = build_view(old), build_view(new)
    found = []
    for name in outputs:
        node, _, index = name.rpartition(":")
        was = old_view.bodies[0].nodes[node].outputs[int(index)].dtype
        now_node = new_view.bodies[0].nodes.get(node)
        now = now_node.outputs[int(index)].dtype if now_node else None
        if now != was:
            found.append(Failure("output_dtype", "", f"output {name} was {dtype_name(was)}, "
                                 f"is {dtype_name(now) if now is not None else 'missing'}"))
    sixteen_before = {(body.name, name) for body in old_view.bodies
                      for name, node in body.nodes.items() if _sixteen_bit_attrs(node)}
    for body in new_view.bodies:
        original = boundaries.original_function_name(body.name)
        for name, node in body.nodes.items():
            ports = node.inputs + node.outputs
            # (a call or loop passes handles and values in one list: its
            # signature is checked by check_graph_def, the variable ops inside here)
            if (any(p.dtype == types_pb2.DT_RESOURCE for p in ports) and not node.called_functions
                    and _sixteen_bit_attrs(node) and (original, name) not in sixteen_before):
                found.append(Failure("variable_dtype", "", f"{node.op} {name!r} in "
                                     f"{body.name or 'the top graph'} touches a variable "
                                     f"with {_sixteen_bit_attrs(node)}", node.op))
    return found


def _sixteen_bit_attrs(node) -> list[str]:
    found = []
    for key, value in node.node_def.attr.items():
        types = [value.type] if value.WhichOneof("value") == "type" else list(value.list.type)
        if any(t in _SIXTEEN for t in types):
            found.append(key)
    return found


def _compiled(fn):
    """`fn` called in a function XLA compiles (on the CPU), as a Keras 3 step runs."""
    return tf.function(lambda *args: fn(*args), jit_compile=True, autograph=False)


def run_compiled_float32(module) -> bool:
    """Builds the program and runs its float32 step compiled by XLA, as ``check``
    does for the XLA configurations' reference: False where XLA refuses it. (For
    longrun: a process whose worker died runs this alone.)"""
    step, state = module.build()
    concrete = step.get_concrete_function(*module.input_specs())
    captured = list(concrete.variables)
    snapshot = [v.numpy() for v in captured]
    state = full_state(concrete, state)
    return _compiled_run(concrete, module.make_inputs(), state, captured,
                         snapshot) is not None


def _compiled_run(concrete, inputs, state, captured, snapshot):
    """The float32 step's run compiled by XLA (the reference of a compiled rewrite:
    the same lowerings, of random ops too), or None where XLA cannot compile it
    (a program outside what XLA takes: its XLA rewrites then run on the executor)."""
    _restore(captured, snapshot)
    try:
        return _run(_compiled(concrete), inputs, state)
    except Exception:  # noqa: BLE001 (any refusal of XLA's: the float32 step's own limit)
        return None
    finally:
        _restore(captured, snapshot)


def _concrete_from(new_graph_def, concrete):
    """The rewritten GraphDef as a ConcreteFunction on the original's captures
    (what ``tfamp.rewrite_concrete_function`` does after its rewrite)."""
    return runner.concrete_from_graph_def(new_graph_def, concrete)


def _run(concrete, inputs, state) -> tuple[list[tuple[str, np.ndarray]], list[np.ndarray]]:
    """(named flat outputs, state values after) of one call."""
    outputs = concrete(*inputs)
    flat = nest.flatten_with_joined_string_paths(outputs, expand_composites=True)
    return [(path, np.asarray(value)) for path, value in flat], [v.numpy() for v in state]


def full_state(concrete, state: list) -> list:
    """The program's `state`, then any other variable the step captures (an
    optimizer's slots, iteration count and learning rate), in the order the
    step's graph first reads them.

    Not in capture order: each build of a program is compared with the others
    variable by variable (the noisy builds with float32's), and a Keras 3
    optimizer's variables are captured in another order in every trace
    (45000237: Adam's momentum of one layer judged against another's velocity,
    or skipped as shaped differently). The graph's ops come in trace order,
    which is the same in every build."""
    known = {id(v) for v in state}
    extra = [v for v in concrete.variables if id(v) not in known]
    placeholder = {id(outer): inner.op.name for outer, inner in concrete.graph.captures}
    wanted = {placeholder.get(id(getattr(v, "handle", None))): v for v in extra}
    wanted.pop(None, None)  # (a variable without a captured handle: capture order)
    first_read: dict[int, int] = {}
    for index, op in enumerate(concrete.graph.get_operations()):
        for tensor in op.inputs:
            variable = wanted.get(tensor.op.name)
            if variable is not None and id(variable) not in first_read:
                first_read[id(variable)] = index
    unread = len(first_read)  # (a variable no op reads keeps its capture order, last)
    return state + sorted(extra, key=lambda v: first_read.get(id(v), unread))


def _restore(variables, values) -> None:
    for variable, value in zip(variables, values, strict=True):
        variable.assign(value)


class _NoisyStep:
    """A fresh build of the program traced under ``noise.rounding_noise`` (one
    build per noise sample, `salt`; TIES: the near-ties sample; CROSSED: the
    near-zero sums crossed; AWAY: every rounding away from zero); run with the
    noise of one 16-bit type at a time, from the same start. A sample's run is
    kept: the configurations of one dtype judge against the same samples (a
    numerics failure confirmed in three of them ran its nine extra samples three
    times, two thirds of the suite's four slowest tests)."""

    def __init__(self, module):
        self.module = module
        self.builds: dict[int, tuple] = {}
        self.runs: dict[tuple, tuple] = {}

    def _build(self, salt: int):
        if salt > 0 and salt not in self.builds:  # another random sample: the same trace
            concrete, graph_def, *rest = self._build(0)
            self.builds[salt] = (concrete, noise.with_salt(graph_def, salt), *rest)
        if salt not in self.builds:
            step, state = self.module.build()
            with noise.rounding_noise(max(salt, 0), ties_only=salt == TIES,
                                      crossed=salt == CROSSED, away=salt == AWAY):
                concrete = step.get_concrete_function(*self.module.input_specs())
            captured = list(concrete.variables)
            self.builds[salt] = (concrete, concrete.graph.as_graph_def(),
                                 self.module.make_inputs(), captured,
                                 [v.numpy() for v in captured], full_state(concrete, state))
        return self.builds[salt]

    def run(self, dtype: str, salt: int = 0):
        key = (dtype, salt, UNIT_ROUNDOFF[dtype], TINY[dtype], LARGEST[dtype])
        if key not in self.runs:
            concrete, graph_def, inputs, captured, snapshot, state = self._build(salt)
            sized = noise.with_noise_size(graph_def, UNIT_ROUNDOFF[dtype], TINY[dtype],
                                          tfamp.AmpConfig(dtype=dtype).op_lists,
                                          LARGEST[dtype])
            _restore(captured, snapshot)
            try:
                self.runs[key] = _run(_concrete_from(sized, concrete), inputs, state)
            finally:
                _restore(captured, snapshot)
        return self.runs[key]


def _worst_noise(clean, samples):
    """One noisy run made of `samples` (runs of noisy steps): each output and
    variable the one farthest from float32's `clean` (norm of the difference),
    or None where the samples' structures differ."""
    def far(c, n):
        if n is None or np.shape(n) != np.shape(c) or np.asarray(c).dtype.kind != "f":
            return -1.0
        d = np.asarray(n, np.float64) - np.asarray(c, np.float64)
        return float(np.linalg.norm(d)) if np.all(np.isfinite(d)) else np.inf
    clean_out, clean_state = clean
    if any(len(s[0]) != len(clean_out) or len(s[1]) != len(clean_state) for s in samples):
        return None
    outs = [max((s[0][i] for s in samples), key=lambda item, c=c: far(c, item[1]))
            for i, (_, c) in enumerate(clean_out)]
    state = [max((s[1][i] for s in samples), key=lambda n, c=c: far(c, n))
             for i, c in enumerate(clean_state)]
    return outs, state


def _merge(outcome: Outcome, found: Outcome) -> None:
    """Adds `found`'s failures and counts to `outcome` (its time is check's own)."""
    for field in dataclasses.fields(Outcome):
        if field.name != "seconds":
            setattr(outcome, field.name,
                    getattr(outcome, field.name) + getattr(found, field.name))


def _compare(clean, noisy, got, before, config: Config, outcome: Outcome,
             reach=None, label: str = "") -> None:
    """Judges each output and variable update of the 16-bit run `got` (``_judge``)
    against `clean`, float32's run; `reach`: the AWAY sample's run, or None;
    `label`: the configuration as failures name it (default ``str(config)``)."""
    label = label or str(config)
    (clean_out, clean_state), (noisy_out, noisy_state), (got_out, got_state) = (
        clean, noisy, got)
    u = UNIT_ROUNDOFF[config.dtype]
    if len(noisy_state) != len(clean_state):  # (the builds differ: compare outputs only)
        noisy_state = [None] * len(clean_state)
    reach_out, reach_state = reach if reach is not None else ([], [])
    if len(reach_out) != len(clean_out):
        reach_out = [(None, None)] * len(clean_out)
    if len(reach_state) != len(clean_state):
        reach_state = [None] * len(clean_state)
    pairs = [(name, c, n, r, 0.0, a) for (name, c), (_, n), (_, r), (_, a)
             in zip(clean_out, noisy_out, got_out, reach_out, strict=True)]
    for index, (b, c, n, r, a) in enumerate(zip(before, clean_state, noisy_state, got_state,
                                                reach_state, strict=True)):
        if n is not None and n.shape == c.shape:
            pairs.append((f"variable {index} {c.shape} update", _delta(c, b), _delta(n, b),
                          _delta(r, b), _resolution(c),
                          None if a is None or a.shape != c.shape else _delta(a, b)))
    for name, c, n, r, floor, a in pairs:
        if r.dtype != c.dtype or r.shape != c.shape:
            outcome.failures.append(Failure("output_dtype", label,
                                            f"{name}: {c.dtype}{c.shape} became "
                                            f"{r.dtype}{r.shape}"))
            continue
        if n.shape != c.shape:  # (5000648: the noisy run's value has another shape, so
            outcome.skipped += 1  # it bounds nothing; r's shape was checked above)
            continue
        verdict = _judge(c, n, r, u, floor, a, LARGEST[config.dtype])
        if verdict is None:
            outcome.skipped += 1
            if r.dtype.kind == "f" and not np.all(np.isfinite(r)):
                outcome.unjudged_nonfinite += 1
            continue
        outcome.compared += 1
        kind, ratio, message, relative = verdict
        if ratio is not None:
            outcome.ratios.append(ratio)
        if relative is not None:
            outcome.errors.append(relative)
        if kind:
            outcome.failures.append(Failure(kind, label, f"{name}: {message}"))


def _resolution(after) -> float:
    """The norm of one unit in the last place of each element of a variable's new
    value: an update is a difference of two stored values, so no update is known
    to better than that. (5000408: an SGD step below half a float32 step of a
    gamma near 1 rounds to no change in float32; the float16 gradient, a little
    larger, moved it by one float32 step, 1.2e-7, against a bound of 0.)"""
    if after.dtype.kind != "f":
        return 0.0
    return float(np.linalg.norm(np.spacing(np.abs(after)).astype(np.float64)))


def _delta(after, before):
    if after.dtype.kind == "f":
        return after.astype(np.float64) - before.astype(np.float64)
    return after


def _judge(c, n, r, u, floor: float = 0.0, reach=None, largest: float = np.inf):
    """None (not compared), or (failure kind or "", |r - c| / bound, message,
    (|r - c|, |n - c|) / (u |c|) or None). `floor`: what the bound is at least
    (``_resolution``). `reach`: the AWAY sample's value, or None: an element not
    finite there may be not finite in `r` too; so may one whose float32 value is
    past `largest` (the 16-bit range) in an output that overflowed in a noisy run
    (a sum's terms that cancel may shrink in the AWAY sample: 17000847's 6.6e4
    became 6.3e4 there, 16-bit rounding gave inf). An output no noisy run
    overflows (a deny op's, exact in the noise) is judged everywhere."""
    if c.dtype.kind not in "fc":
        if not np.array_equal(n, c):
            return None
        same = np.array_equal(r, c)
        return ("" if same else "numerics", None,
                "" if same else f"integers differ: {np.count_nonzero(r != c)} of {c.size}", None)
    c, n, r = (x.astype(np.float64) for x in (c, n, r))
    if not np.all(np.isfinite(c)):
        return None
    finite = np.isfinite(n)
    scale = np.linalg.norm(c)
    # Ill-conditioned at this precision: rounding alone moves it by more than
    # a quarter, so the 16-bit result may be anything, an overflow included
    # (2000574: a BatchNorm's gradient over one row, which is an exact
    # cancellation in float32 and its rounding residual times 1.6e4 in 16 bits).
    if np.all(finite) and np.linalg.norm(n - c) > SKIP * scale:
        return None
    judged = finite
    if reach is not None and np.shape(reach) == c.shape:
        reached = np.isfinite(np.asarray(reach, np.float64))
        judged = finite & reached
        if not (np.all(finite) and np.all(reached)):
            judged &= np.abs(c) <= largest
    if not np.all(np.isfinite(r[judged])):
        return ("nonfinite", None, f"{np.count_nonzero(~np.isfinite(r[judged]))} of {c.size} "
                f"values not finite (float32 and the noisy runs: finite; max |c| "
                f"{np.abs(c).max():.3g})", None)
    if not np.all(judged) or not np.all(np.isfinite(r)):
        return None
    noise_error = np.linalg.norm(n - c)
    error = np.linalg.norm(r - c)
    bound = K * noise_error + F * u * scale + floor
    ratio = error / bound if bound else (0.0 if error == 0 else np.inf)
    relative = ((error / (u * scale), noise_error / (u * scale)) if scale
                else None)
    if error <= bound:
        return "", ratio, "", relative
    return ("numerics", ratio, f"|r - c| = {error:.3g}, bound {bound:.3g} (|c| = {scale:.3g}, "
            f"noisy run's |n - c| = {noise_error:.3g}); max elementwise error "
            f"{np.abs(r - c).max():.3g}", relative)


def _describe(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    first = text[0][:300] if text else ""
    # TensorFlow's "Graph execution error:" says what failed further down: the op's
    # own message is the line before "[[{{node NAME}}]]" (13000717, 14000461: an
    # AbortedError whose first line alone said nothing).
    for index, line in enumerate(text):
        if "[[{{node" in line:
            said = next((t.strip() for t in reversed(text[:index]) if t.strip()), "")
            if said and said != first:
                first = f"{first} {said[:300]}"
            break
    return f"{type(err).__name__}: {first}"


def _where(err: BaseException) -> str:
    """The exception's type and the innermost tfamp frame (file:function)."""
    frames = [f for f in traceback.extract_tb(err.__traceback__) if "/tfamp/" in f.filename]
    place = f"{frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].name}" if frames else ""
    return f"{type(err).__name__}@{place}"


def _what_changed(graph_def, serialized: bytes) -> str:
    old = type(graph_def).FromString(serialized)
    if list(old.node) != list(graph_def.node):
        return "the top graph's nodes changed"
    changed = [new.signature.name for before, new in zip(old.library.function,
                                                         graph_def.library.function,
                                                         strict=False) if before != new]
    return f"library functions changed: {changed[:3]}" if changed else "the GraphDef changed"


def main(module) -> int:
    """Checks a program file's module; prints what failed. Exit status 1 on a failure."""
    outcome = check(module)
    for failure in outcome.failures:
        print(failure, file=sys.stderr)
    if outcome.refused:
        print(f"TensorFlow's own float32 run fails, numerics not judged: {outcome.refused}",
              file=sys.stderr)
    print(f"{'ok' if outcome.ok else 'FAILED'}: {outcome.compared} outputs compared, "
          f"{outcome.skipped} ill-conditioned, {outcome.seconds:.1f} s")
    return 0 if outcome.ok else 1
