"""tfamp under tf.distribute: MirroredStrategy and MultiWorkerMirroredStrategy.

What these tests pin down:

* a tf_keras MLP compiled with Adam/mse and ``tfamp.enable``-d inside a
  ``MirroredStrategy`` over two logical CPU devices trains like the same model on
  one replica: the same loss-scale decisions, final loss and weights within
  float16 tolerance, identical weights on both replicas. The training step
  really ran rewritten: ``model.train_function`` is a ``RewrittenFunction``
  whose RewriteReports convert MatMul on *both* replicas (twice the
  single-replica count);
* an overflowing step (one sample finite in float32 but inf in float16, so it
  reaches one replica only) is skipped once and everywhere: ``skipped_steps``
  +1 (not +1 per replica), the loss scale halves once, and every replica's
  weights and Adam slots are bit-for-bit unchanged; the next good step trains;
* with ``growth_interval=3`` the scale doubles exactly once per 3 good steps,
  identically on every replica;
* ``MultiWorkerMirroredStrategy`` with two worker processes on 127.0.0.1: both
  workers end identical, and match a single-process run within float16
  tolerance (slow: two TensorFlow processes with gRPC servers).

MirroredStrategy runs in two flavours: its default cross-device ops (collective
all-reduce on CPUs, as MultiWorkerMirroredStrategy always uses) and
``ReductionToOneDevice`` (plain reduce/broadcast ops).

Regression guards for two bugs these tests found (both fixed):

* call-time ("by reference") captures, which tf.distribute's collective
  all-reduce uses for its instance keys, must survive tfamp's rebuilt graph;
* the ``loss_scale`` and ``skipped_steps`` log entries must not be multiplied
  by the number of replicas, and must not stop Keras's epoch-end metric re-read
  (which keeps ``history["loss"]`` right under MultiWorkerMirroredStrategy).

Logical devices and TF_CONFIG must be in place before TensorFlow initialises,
so every scenario runs in its own Python process (``_SCRIPT`` below), bounded by
a timeout, and reports one JSON line; results are cached per module.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 240  # seconds, per subprocess (and for both workers together)
RESULT_PREFIX = "TFAMP_RESULT "

# float16 tolerance for two float16 trainings that differ only in how the batch
# is split (summation order, per-replica casts). Measured differences are ~1e-3.
RTOL = 2e-2


class SubprocessFailed(AssertionError):
    """A scenario's Python process exited with an error (its traceback attached)."""


# MirroredStrategy cross-device ops: its default (collective all-reduce on CPUs,
# which needs call-time captures) and ReductionToOneDevice.
CROSS_DEVICE = [
    "reduce_to_one_device",
    "default",
]

# The scenario script. argv: mode [cross_device_ops]. Modes:
#   single       fit on one device, no strategy
#   mirrored     fit under MirroredStrategy over two logical CPUs
#   scale        MirroredStrategy: an overflowing train_on_batch, then growth
#   multiworker  fit under MultiWorkerMirroredStrategy (TF_CONFIG from env)
_SCRIPT = r'''
import json, os, sys
mode = sys.argv[1]
import numpy as np
import tensorflow as tf

if mode in ("mirrored", "scale"):
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    # argv[2]: "default" (MirroredStrategy's own choice: collective all-reduce
    # on CPUs) or "reduce_to_one_device" (plain reduce/broadcast ops).
    cross_device_ops = (tf.distribute.ReductionToOneDevice()
                        if sys.argv[2] == "reduce_to_one_device" else None)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"],
                                              cross_device_ops=cross_device_ops)
elif mode == "multiworker":
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
else:
    strategy = tf.distribute.get_strategy()  # the default (no) strategy

import tf_keras as keras
import tfamp
import tfamp.runtime.runner

FEATURES, HIDDEN, N, BATCH = 16, 32, 256, 32
EPOCHS = 3
INITIAL_SCALE, GROWTH = 2.0 ** 8, 6  # 24 steps: the scale grows 4 times


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, FEATURES)).astype("float32")
    w = rng.normal(size=(FEATURES, 1)).astype("float32")
    y = (np.tanh(x @ w / 2.0) + 0.1 * rng.normal(size=(N, 1))).astype("float32")
    return x, y


def build_model():
    model = keras.Sequential([
        keras.layers.Dense(HIDDEN, activation="relu", input_shape=(FEATURES,)),
        keras.layers.Dense(HIDDEN, activation="relu"),
        keras.layers.Dense(1),
    ])
    # Same starting weights everywhere, whatever the strategy does to seeding.
    rng = np.random.default_rng(1)
    model.set_weights([
        (rng.uniform(-1, 1, size=w.shape) * np.sqrt(6.0 / sum(w.shape))).astype("float32")
        if w.ndim == 2 else np.zeros(w.shape, "float32")
        for w in model.get_weights()])
    return model


def local(value):
    """Per-replica numpy values of a (possibly distributed) variable or tensor."""
    return [np.asarray(v) for v in strategy.experimental_local_results(value)]


def flat_weights(model):
    return np.concatenate([w.ravel() for w in model.get_weights()]).astype("float64")


def np_loss(model, x, y):
    """float32 numpy forward pass of the Dense/relu MLP: the loss of the weights."""
    ws = model.get_weights()
    h = x
    for i in range(0, len(ws), 2):
        h = h @ ws[i] + ws[i + 1]
        if i + 2 < len(ws):
            h = np.maximum(h, 0)
    return float(np.mean((h - y) ** 2))


def weight_summary(model, x, y):
    flat = flat_weights(model)
    return {
        "weights": flat.tolist(),
        "weight_sums": [float(w.sum()) for w in model.get_weights()],
        "checksum": float(np.sum(flat * np.cos(np.arange(flat.size)))),
        "np_loss": np_loss(model, x, y),
    }


_readers = {}


def replica_state(model):
    """loss scale, skipped_steps and growth counter as seen on each replica."""
    opt = model.optimizer
    if id(opt) not in _readers:
        def read():  # in a replica context: each replica reads its own copy
            return (tf.identity(opt.loss_scale), tf.identity(opt.skipped_steps),
                    tf.identity(opt.dynamic_counter))

        _readers[id(opt)] = tf.function(lambda: strategy.run(read))
    scale, skipped, counter = _readers[id(opt)]()
    return {"scale": [float(v) for v in local(scale)],
            "skipped": [int(v) for v in local(skipped)],
            "counter": [int(v) for v in local(counter)],
            "iterations": int(opt.iterations.numpy())}


n_vars = [0]


def replica_weights(model):
    """Every model weight and Adam slot, per replica: [replica][variable]."""
    variables = list(model.trainable_variables) + [
        v for v in model.optimizer.inner_optimizer.variables()
        if v.dtype == tf.float32 and len(v.shape) > 0]
    per_var = [local(v) for v in variables]
    n_vars[0] = len(variables)
    return [[vals[r] for vals in per_var] for r in range(len(per_var[0]))]


def reports_info(model):
    fn = model.train_function
    reports = list(getattr(fn, "reports", []))
    names = [n.name for r in reports for n in r.nodes if n.converted and n.op == "MatMul"]
    return {
        "train_function_type": type(fn).__module__ + "." + type(fn).__name__,
        "is_rewritten": isinstance(fn, tfamp.runtime.runner.RewrittenFunction),
        "report_types": [type(r).__module__ + "." + type(r).__name__ for r in reports],
        "all_reports_are_rewrite_reports": all(
            isinstance(r, tfamp.RewriteReport) for r in reports),
        "converted": [r.converted for r in reports],
        "converted_matmul_names": names,
    }


def compile_model(model, **enable_kwargs):
    model.compile(optimizer=keras.optimizers.Adam(learning_rate=1e-2), loss="mse")
    tfamp.enable(model, **enable_kwargs)


def run_fit():
    x, y = data()
    with strategy.scope():
        model = build_model()
        compile_model(model, initial_scale=INITIAL_SCALE, growth_interval=GROWTH)
    if mode == "multiworker":
        ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.DATA)
        history = model.fit(ds.with_options(options), epochs=EPOCHS, verbose=0)
    else:
        history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0)
    h = {k: [float(v) for v in vals] for k, vals in history.history.items()}
    out = {"mode": mode, "replicas": strategy.num_replicas_in_sync,
           "loss": h["loss"][-1], "history": h,
           "optimizer_type": type(model.optimizer).__name__}
    out.update(weight_summary(model, x, y))
    out.update(reports_info(model))
    out["skipped_steps"] = int(model.optimizer.skipped_steps.numpy())
    out["final_scale"] = float(model.optimizer.loss_scale.numpy())
    if strategy.num_replicas_in_sync > 1 and mode != "multiworker":
        out["replica_state"] = replica_state(model)
        w = replica_weights(model)
        out["replicas_identical"] = all(
            np.array_equal(a, b) for a, b in zip(w[0], w[1]))
    return out


def run_overflow():
    x, y = data()
    xb, yb = x[:BATCH], y[:BATCH]
    with strategy.scope():
        model = build_model()
        compile_model(model, initial_scale=2.0 ** 10, growth_interval=1000)
    steps = []

    def step(xs, label):
        before_w = replica_weights(model)
        before = replica_state(model)
        # float32 losses at the weights before the step: the whole batch, and each
        # replica's half of it (which the logs hold when the other half overflowed)
        half = len(xs) // 2
        np_losses = {"batch": np_loss(model, xs, yb),
                     "halves": [np_loss(model, xs[:half], yb[:half]),
                                np_loss(model, xs[half:], yb[half:])]}
        logs = model.train_on_batch(xs, yb, return_dict=True)
        loss = float(logs["loss"])
        after_w = replica_weights(model)
        after = replica_state(model)
        steps.append({
            "label": label, "loss": loss, "before": before, "after": after,
            "np_losses": np_losses,
            "logs": {k: float(v) for k, v in logs.items()},
            "unchanged": [all(np.array_equal(a, b) for a, b in zip(bw, aw))
                          for bw, aw in zip(before_w, after_w)],
            "replicas_identical": all(np.array_equal(a, b)
                                      for a, b in zip(after_w[0], after_w[1])),
        })

    step(xb, "good")
    # 1e5 is finite in float32 but inf in float16 (max 65504): only the rewritten
    # graph overflows. One sample lands on one replica: the batch is split in
    # halves, so the last and the first sample go to different replicas.
    bad_last = xb.copy()
    bad_last[-1, 0] = 1e5
    step(bad_last, "bad_on_last_replica")
    bad_first = xb.copy()
    bad_first[0, 0] = 1e5
    step(bad_first, "bad_on_first_replica")
    step(xb, "good_after")
    out = {"steps": steps, "optimizer_type": type(model.optimizer).__name__,
           "compared_variables": n_vars[0]}
    out.update({k: v for k, v in reports_info(model).items() if k != "converted_matmul_names"})
    return out


def run_growth():
    x, y = data()
    xb, yb = x[:BATCH], y[:BATCH]
    with strategy.scope():
        model = build_model()
        compile_model(model, initial_scale=2.0 ** 10, growth_interval=3)
    states = [replica_state(model)]
    for _ in range(7):
        model.train_on_batch(xb, yb)
        states.append(replica_state(model))
    return {"states": states,
            "is_rewritten": isinstance(model.train_function, tfamp.runtime.runner.RewrittenFunction)}


def run_scale():
    return {"mode": mode, "replicas": strategy.num_replicas_in_sync,
            "overflow": run_overflow(), "growth": run_growth()}


runner = {"single": run_fit, "mirrored": run_fit, "multiworker": run_fit,
          "scale": run_scale}[mode]
result = runner()
result["cross_device_ops"] = sys.argv[2] if len(sys.argv) > 2 else None
print("TFAMP_RESULT " + json.dumps(result), flush=True)
'''


# --------------------------------------------------------------------------- helpers


def _env(tf_config: dict | None = None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["CUDA_VISIBLE_DEVICES"] = ""
    env.pop("TF_CONFIG", None)
    if tf_config is not None:
        env["TF_CONFIG"] = json.dumps(tf_config)
    return env


def _parse(what: str, returncode: int, stdout: str, stderr: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if returncode != 0 or not lines:
        # TensorFlow's errors can run to megabytes (every captured handle is
        # listed): keep the start of the last traceback and the final lines.
        start = stderr.rfind("Traceback (most recent call last)")
        excerpt = stderr[start:start + 3000] if start >= 0 else ""
        raise SubprocessFailed(
            f"{what} subprocess failed (exit {returncode}).\n--- stdout (tail) ---\n"
            f"{stdout[-2000:]}\n--- traceback ---\n{excerpt}\n--- stderr (tail) ---\n"
            f"{stderr[-1500:]}")
    return json.loads(lines[-1][len(RESULT_PREFIX):])


_cache: dict[tuple, object] = {}


def _cached(key: tuple, compute):
    """Runs each scenario once per module; a failure is re-raised to every user."""
    if key not in _cache:
        try:
            _cache[key] = compute()
        except SubprocessFailed as e:
            _cache[key] = e
    value = _cache[key]
    if isinstance(value, SubprocessFailed):
        raise value
    return value


def _run(mode: str, *args: str) -> dict:
    def compute():
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-c", _SCRIPT, mode, *args], env=_env(),
                              capture_output=True, text=True, timeout=TIMEOUT)
        result = _parse(" ".join((mode, *args)), proc.returncode, proc.stdout, proc.stderr)
        result["seconds"] = round(time.monotonic() - start, 1)
        return result
    return _cached((mode, *args), compute)


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _run_workers(n: int = 2) -> list[dict]:
    """Runs the multiworker scenario in `n` processes on loopback ports."""
    def compute():
        ports = _free_ports(n)
        cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
        procs = []
        start = time.monotonic()
        try:
            for i in range(n):
                tf_config = {"cluster": cluster, "task": {"type": "worker", "index": i}}
                procs.append(subprocess.Popen(
                    [sys.executable, "-c", _SCRIPT, "multiworker"], env=_env(tf_config),
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
            outputs = []
            for proc in procs:
                remaining = max(1.0, start + TIMEOUT - time.monotonic())
                stdout, stderr = proc.communicate(timeout=remaining)
                outputs.append((proc.returncode, stdout, stderr))
        finally:
            for proc in procs:  # on a timeout or any error: no worker outlives the test
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
        results = [_parse(f"multiworker[{i}]", *out) for i, out in enumerate(outputs)]
        for r in results:
            r["seconds"] = round(time.monotonic() - start, 1)
        return results
    return _cached(("multiworker", n), compute)


def _rel_l2(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _summary(name: str, r: dict) -> str:
    return (f"{name:>22}: history loss {r['history']['loss'][-1]:.6f}  final-weights loss "
            f"{r['np_loss']:.6f}  checksum {r['checksum']:+.6f}  scale {r['final_scale']:g}  "
            f"skipped {r['skipped_steps']}  ({r['seconds']} s)")


def _single() -> dict:
    return _run("single")


# --------------------------------------------------------------------------- the root cause


def test_call_time_captures_survive_the_rewrite():
    """The minimal form of what tf.distribute's collective all-reduce does."""
    import tensorflow as tf

    import tfamp

    @tfamp.function
    def f(x):
        k = tf.compat.v1.get_default_graph().capture_call_time_value(
            lambda: tf.constant(3.0), tf.TensorSpec([], tf.float32))
        return tf.matmul(x, x) * k

    np.testing.assert_allclose(f(tf.ones([2, 2])).numpy(), np.full([2, 2], 6.0))


# --------------------------------------------------------------------------- MirroredStrategy


@pytest.mark.parametrize("cross_device", CROSS_DEVICE)
def test_mirrored_fit_matches_single_replica(cross_device):
    single = _single()
    mirrored = _run("mirrored", cross_device)
    rel = _rel_l2(mirrored["weights"], single["weights"])
    print()
    print(_summary("single", single))
    print(_summary(f"mirrored x2 {cross_device}", mirrored))
    print(f"weights: relative L2 difference {rel:.2e}, max abs difference "
          f"{np.max(np.abs(np.subtract(mirrored['weights'], single['weights']))):.2e}")
    print(f"per-layer sums single   {np.round(single['weight_sums'], 5).tolist()}")
    print(f"per-layer sums mirrored {np.round(mirrored['weight_sums'], 5).tolist()}")
    print(f"epoch losses single {single['history']['loss']}\n"
          f"epoch losses mirrored {mirrored['history']['loss']}")

    assert single["replicas"] == 1 and mirrored["replicas"] == 2
    for r in (single, mirrored):
        assert r["optimizer_type"] == "LossScaleOptimizer"
        assert set(r["history"]) >= {"loss", "loss_scale", "skipped_steps"}
        assert r["skipped_steps"] == 0
        assert r["history"]["loss"][-1] < 0.5 * r["history"]["loss"][0]  # it learned
    # Scale decisions are exact: 24 good steps, growth every 6 -> 2**8 * 2**4.
    assert mirrored["final_scale"] == single["final_scale"] == 2.0 ** 12
    state = mirrored["replica_state"]
    assert state["scale"] == [2.0 ** 12] * 2 and state["skipped"] == [0, 0]
    assert state["counter"] == [0, 0] and state["iterations"] == 24
    # Loss and weights within float16 tolerance of one replica with the whole batch.
    np.testing.assert_allclose(mirrored["history"]["loss"], single["history"]["loss"],
                               rtol=RTOL)
    np.testing.assert_allclose(mirrored["np_loss"], single["np_loss"], rtol=RTOL)
    assert rel < RTOL
    np.testing.assert_allclose(mirrored["weight_sums"], single["weight_sums"],
                               rtol=RTOL, atol=RTOL * np.abs(single["weights"]).max())
    # Both replicas hold bit-identical weights and Adam slots.
    assert mirrored["replicas_identical"]


@pytest.mark.parametrize("cross_device", CROSS_DEVICE)
def test_mirrored_fit_runs_rewritten_graphs(cross_device):
    single = _single()
    mirrored = _run("mirrored", cross_device)
    for r in (single, mirrored):
        assert r["is_rewritten"], r["train_function_type"]
        assert r["train_function_type"] == "tfamp.runtime.runner.RewrittenFunction"
        assert r["report_types"] and r["all_reports_are_rewrite_reports"], r["report_types"]
        assert any("MatMul" in c for c in r["converted"]), r["converted"]
    single_mm = sum(c.get("MatMul", 0) for c in single["converted"])
    mirrored_mm = sum(c.get("MatMul", 0) for c in mirrored["converted"])
    print(f"\nconverted MatMul: single {single_mm}, mirrored {mirrored_mm}; "
          f"mirrored report: {mirrored['converted']}")
    # Both replicas' forward and backward MatMuls were converted, not just one.
    assert mirrored_mm == 2 * single_mm > 0
    assert any("replica_1" in name for name in mirrored["converted_matmul_names"]), \
        mirrored["converted_matmul_names"]


@pytest.mark.parametrize("cross_device", CROSS_DEVICE)
def test_mirrored_overflow_is_skipped_once_on_every_replica(cross_device):
    r = _run("scale", cross_device)
    o = r["overflow"]
    print()
    for s in o["steps"]:
        print(f"{s['label']:>22}: loss {s['loss']:.4g}  scale {s['before']['scale']} -> "
              f"{s['after']['scale']}  skipped {s['before']['skipped']} -> "
              f"{s['after']['skipped']}  iterations {s['before']['iterations']} -> "
              f"{s['after']['iterations']}  unchanged per replica {s['unchanged']}")
    print(f"({r['seconds']} s for this and the growth scenario)")
    assert r["replicas"] == 2 and o["is_rewritten"]
    assert o["optimizer_type"] == "LossScaleOptimizer"
    assert o["compared_variables"] == 3 * 6  # 6 weights, Adam's m and v for each
    good, bad_last, bad_first, good_after = o["steps"]

    assert np.isfinite(good["loss"])
    assert good["after"]["skipped"] == [0, 0] and good["after"]["scale"] == [2.0 ** 10] * 2
    assert good["unchanged"] == [False, False] and good["replicas_identical"]

    scale, skipped = 2.0 ** 10, 0
    for bad in (bad_last, bad_first):  # one sample, so one replica, each time
        # the rescued step's logs leave out the replica whose metrics it poisoned
        # (test_mirrored_logs_report_the_loss_scale_once_not_per_replica)
        assert np.isfinite(bad["loss"]), bad["loss"]
        skipped += 1
        scale /= 2
        # +1 in total and the same on each replica, not once per replica
        assert bad["after"]["skipped"] == [skipped, skipped], bad
        # halved once, on every replica
        assert bad["after"]["scale"] == [scale, scale], bad
        assert bad["after"]["counter"] == [0, 0]
        # weights and Adam slots untouched, on every replica
        assert bad["unchanged"] == [True, True], bad["label"]
        assert bad["replicas_identical"]
        # tf_keras behaviour kept: iterations still count the batch
        assert bad["after"]["iterations"] == bad["before"]["iterations"] + 1

    assert np.isfinite(good_after["loss"])
    assert good_after["unchanged"] == [False, False] and good_after["replicas_identical"]
    assert good_after["after"]["skipped"] == [2, 2]
    assert good_after["after"]["scale"] == [2.0 ** 8] * 2
    assert good_after["after"]["counter"] == [1, 1]


@pytest.mark.parametrize("cross_device", CROSS_DEVICE)
def test_mirrored_loss_scale_doubles_once_per_growth_interval(cross_device):
    r = _run("scale", cross_device)
    g = r["growth"]
    scales = [s["scale"] for s in g["states"]]
    counters = [s["counter"] for s in g["states"]]
    print(f"\nscale per replica, start and after each step: {scales}\n"
          f"growth counters: {counters}")
    assert r["replicas"] == 2 and g["is_rewritten"]
    base = 2.0 ** 10
    expected = [base, base, base, 2 * base, 2 * base, 2 * base, 4 * base, 4 * base]
    assert scales == [[e, e] for e in expected]
    assert counters == [[c, c] for c in [0, 1, 2, 0, 1, 2, 0, 1]]
    assert all(s["skipped"] == [0, 0] for s in g["states"])
    assert [s["iterations"] for s in g["states"]] == list(range(8))


def test_mirrored_logs_report_the_loss_scale_once_not_per_replica():
    cross_device = "reduce_to_one_device"
    single = _single()
    mirrored = _run("mirrored", cross_device)
    steps = _run("scale", cross_device)["overflow"]["steps"]
    print(f"\nhistory loss_scale: single {single['history']['loss_scale']}, mirrored "
          f"{mirrored['history']['loss_scale']} (real final scale "
          f"{mirrored['final_scale']:g})")
    print("train_on_batch logs vs real state: " + "; ".join(
        f"{s['label']}: logged scale {s['logs']['loss_scale']:g} skipped "
        f"{s['logs']['skipped_steps']:g}, real {s['after']['scale'][0]:g} / "
        f"{s['after']['skipped'][0]}" for s in steps))
    assert mirrored["history"]["loss_scale"] == single["history"]["loss_scale"]
    assert mirrored["history"]["loss_scale"][-1] == mirrored["final_scale"]
    for s in steps:
        assert s["logs"]["loss_scale"] == s["after"]["scale"][0]
        assert s["logs"]["skipped_steps"] == s["after"]["skipped"][0]
    # The loss, a metric's result, once too: tf_keras sums the replicas' logs, and
    # tfamp's choice of a metric's value after a step must not be made per replica
    # (it was: every batch log, and train_on_batch's, read twice the loss).
    good, bad_last, bad_first, good_after = steps
    print("train_on_batch loss logs vs float32 at the weights before: " + "; ".join(
        f"{s['label']}: {s['logs']['loss']:.5g} / batch {s['np_losses']['batch']:.5g}, "
        f"halves {s['np_losses']['halves'][0]:.5g} {s['np_losses']['halves'][1]:.5g}"
        for s in steps))
    for s in (good, good_after):
        assert s["logs"]["loss"] == pytest.approx(s["np_losses"]["batch"], rel=2e-2)
    # An overflow on one replica: its part is left out, the other replica's stays.
    assert bad_last["logs"]["loss"] == pytest.approx(bad_last["np_losses"]["halves"][0],
                                                     rel=2e-2)
    assert bad_first["logs"]["loss"] == pytest.approx(bad_first["np_losses"]["halves"][1],
                                                      rel=2e-2)


# --------------------------------------------------------------------------- MultiWorker


@pytest.mark.slow
def test_multi_worker_matches_single_process():
    single = _single()
    w0, w1 = _run_workers(2)
    print()
    print(_summary("single", single))
    print(_summary("worker 0", w0))
    print(_summary("worker 1", w1))
    print(f"worker0 vs worker1 max abs weight difference "
          f"{np.max(np.abs(np.subtract(w0['weights'], w1['weights']))):.2e}; "
          f"worker0 vs single relative L2 {_rel_l2(w0['weights'], single['weights']):.2e}")
    for w in (w0, w1):
        assert w["replicas"] == 2
        assert w["is_rewritten"] and w["all_reports_are_rewrite_reports"]
        assert any("MatMul" in c for c in w["converted"]), w["converted"]
        assert w["skipped_steps"] == 0
    # The two workers agree with each other...
    np.testing.assert_allclose(w0["weights"], w1["weights"], rtol=0, atol=1e-6)
    assert abs(w0["np_loss"] - w1["np_loss"]) <= 1e-6
    assert abs(w0["checksum"] - w1["checksum"]) <= 1e-6
    assert w0["final_scale"] == w1["final_scale"]
    assert w0["skipped_steps"] == w1["skipped_steps"]
    np.testing.assert_allclose(w0["history"]["loss"], w1["history"]["loss"], rtol=0,
                               atol=1e-6)
    # ... and with one process holding the whole batch, within float16 tolerance.
    assert w0["final_scale"] == single["final_scale"] == 2.0 ** 12
    np.testing.assert_allclose(w0["np_loss"], single["np_loss"], rtol=RTOL)
    assert _rel_l2(w0["weights"], single["weights"]) < RTOL


@pytest.mark.slow
def test_multi_worker_history_matches_single_process():
    single = _single()
    w0, _ = _run_workers(2)
    print(f"\nhistory single {single['history']}\nhistory worker0 {w0['history']}")
    np.testing.assert_allclose(w0["history"]["loss"], single["history"]["loss"], rtol=RTOL)
    assert w0["history"]["loss_scale"] == single["history"]["loss_scale"]
    assert w0["history"]["skipped_steps"] == single["history"]["skipped_steps"]
