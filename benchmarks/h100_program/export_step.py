"""Export subprocess (the project's Python): one model x mode's Keras 3 fit step as HLO.

Builds the model, compiles it with ``jit_compile=True`` (what Keras 3 does by default where
XLA can compile the step), builds the train function the way ``fit`` does, and asks
TensorFlow for the step's HLO before XLA's optimisations
(``experimental_get_compiler_ir(...)(stage="hlo_serialized")``), without running it, so a
CPU-only machine is enough. A ``tfamp`` mode must be started with ``TFAMP_ENABLE=1`` (and
``TFAMP_DTYPE``): the step is then tfamp's rewrite of the unmodified float32 script.

    python -m benchmarks.h100_program.export_step --model resnet50 --mode fp32 \
        --batch 64 --out DIR/resnet50_b64_fp32
writes DIR/resnet50_b64_fp32.hlo.pb and .export.json.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from benchmarks.h100_program import models  # noqa: E402
from benchmarks.h100_program.plan import MODES  # noqa: E402


def _is_jit_function(obj) -> bool:
    return (isinstance(obj, tf.types.experimental.PolymorphicFunction)
            and bool(getattr(obj, "_jit_compile", False)))


def find_step(train_function):
    """The jit-compiled function of one step inside Keras 3's ``train_function``.

    Under tfamp, ``train_function`` says which function is the rewritten step
    (``.rewritten``); under Keras alone, the step is the jit-compiled ``tf.function`` the
    Python loop function closes over (Keras wraps it in a ``functools.wraps`` adapter).
    """
    rewritten = getattr(train_function, "rewritten", None)
    if rewritten:
        return rewritten[0]
    seen, todo = set(), [train_function]
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if _is_jit_function(obj):
            return obj
        for inner in (getattr(obj, "python_function", None), getattr(obj, "__wrapped__", None)):
            if inner is not None:
                todo.append(inner)
        if inspect.isfunction(obj):
            todo.extend(inspect.getclosurevars(obj).nonlocals.values())
    raise RuntimeError("no jit-compiled step function found in the model's train_function; "
                       "was the model compiled with jit_compile=True?")


def build_step(model_name: str, mode_name: str, batch: int):
    """(model, the step's jit-compiled function, one batch) as ``fit`` builds them."""
    mode = MODES[mode_name]
    if mode.policy:
        keras.mixed_precision.set_global_policy(mode.policy)
    model, optimizer, loss, x, y = models.build(model_name, batch)
    model.compile(optimizer=optimizer, loss=loss, jit_compile=True)
    data = (tf.constant(x), tf.constant(y))
    model._symbolic_build(data_batch=data)  # what fit does first: weights and slots exist
    model.make_train_function(force=True)
    return model, find_step(model.train_function), data


def export(model_name: str, mode_name: str, batch: int, out_prefix: str) -> dict:
    mode = MODES[mode_name]
    tfamp_on = os.environ.get("TFAMP_ENABLE", "") not in ("", "0")
    if (mode.side == "tfamp") != tfamp_on:
        raise SystemExit(f"export_step: mode {mode_name} needs TFAMP_ENABLE "
                         f"{'=1' if mode.side == 'tfamp' else 'unset'}; the benchmark sets it")
    started = time.perf_counter()
    model, step, data = build_step(model_name, mode_name, batch)
    hlo = step.experimental_get_compiler_ir(data)(stage="hlo_serialized")
    with open(out_prefix + ".hlo.pb", "wb") as f:
        f.write(hlo)
    info = {"model": model_name, "mode": mode_name, "batch": batch,
            "optimizer": type(model.optimizer).__name__, "keras": keras.__version__,
            "tensorflow": tf.__version__, "hlo_bytes": len(hlo),
            "export_s": round(time.perf_counter() - started, 1)}
    if mode.side == "tfamp":
        import tfamp
        info["tfamp_file"] = tfamp.__file__
    with open(out_prefix + ".export.json", "w") as f:
        json.dump(info, f, indent=1)
    return info


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, choices=sorted(models.DEFAULT_BATCH))
    parser.add_argument("--mode", required=True, choices=sorted(MODES))
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--out", required=True, help="prefix of the files written")
    args = parser.parse_args(argv)
    print(json.dumps(export(args.model, args.mode, args.batch, args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
