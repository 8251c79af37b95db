"""Tiny graph builders and checks shared by the tests."""

from __future__ import annotations

import copy
import itertools

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import wrap_function

import tfamp
from tfamp.rewrite.graph import build_view, dtype_name
from tfamp.runtime import runner

_run_counter = itertools.count()


def trace(fn, *specs):
    """(GraphDef, output tensor names, concrete function) of `fn` traced as a tf.function."""
    concrete = tf.function(fn).get_concrete_function(*specs)
    return concrete.graph.as_graph_def(), [t.name for t in concrete.graph.outputs], concrete


def rewrite(fn, *specs, **config):
    """Traces `fn`, rewrites it, checks the result; returns (old, new, report)."""
    graph_def, outputs, _ = trace(fn, *specs)
    before = graph_def.SerializeToString(deterministic=True)
    new_graph_def, report = tfamp.rewrite_graph_def(
        graph_def, tfamp.AmpConfig(**config), outputs=outputs)
    assert graph_def.SerializeToString(deterministic=True) == before, "input mutated"
    problems = tfamp.check_graph_def(new_graph_def)
    assert not problems, problems
    return graph_def, new_graph_def, report


def decision(report, op_or_name, function=None):
    """The NodeReport of the single node with that name (or name scope suffix) or op type."""
    hits = [n for n in report.nodes
            if op_or_name in (n.name, n.op) or n.name.endswith("/" + op_or_name)
            and (function is None or (n.function != "") == function)]
    assert len(hits) == 1, f"expected one node {op_or_name!r}, found {hits}"
    return hits[0]


def node_dtypes(graph_def, function=""):
    """node name -> {type attr: dtype name} for one body of `graph_def`."""
    body = next(b for b in build_view(graph_def).bodies
                if (b.name == function) or (function is True and b.is_function))
    result = {}
    for name, node in body.nodes.items():
        result[name] = {p.type_attr: dtype_name(p.dtype)
                        for p in node.inputs + node.outputs if p.type_attr}
    return result


def run_graph_def(graph_def, inputs: dict, outputs: list[str], jit_compile: bool = False):
    """Evaluates a stateless GraphDef: {placeholder name: value} -> output arrays;
    compiled by XLA (on the CPU) with `jit_compile`.

    Library functions are registered under fresh names first (as tfamp's runner
    does), so an original and a rewritten graph can both run in one process.
    """
    graph_def = copy.deepcopy(graph_def)
    runner._register_renamed_library(graph_def, f"_test{next(_run_counter)}")
    if jit_compile:  # (imported in the compiled function's body: a call would not compile)
        kept = [n for n in graph_def.node if n.name not in inputs]  # (fed: input_map)
        del graph_def.node[:]
        graph_def.node.extend(kept)

        def body(*args):
            return tf.graph_util.import_graph_def(
                graph_def, input_map={f"{name}:0": a for name, a in zip(inputs, args, strict=True)},
                return_elements=outputs, name="")
        fn = tf.function(body, jit_compile=True, autograph=False)
    else:
        fn = wrap_function.function_from_graph_def(
            graph_def, [f"{name}:0" for name in inputs], outputs)
    return [np.asarray(v) for v in fn(*[tf.constant(v) for v in inputs.values()])]
