"""Keras 3 under tf.distribute.MirroredStrategy (two logical CPUs), with tfamp.

* ``fit`` of an enabled model on two replicas matches one replica (float16
  tolerance), and the step really ran rewritten;
* an overflowing sample that only replica 1 sees is skipped on *both* replicas
  (Keras 3's own LossScaleOptimizer takes replica 0's finiteness flag under
  MirroredStrategy, so replica 0 would have applied the inf gradient): weights
  and Adam slots unchanged on every replica, scale halved once, one skip;
* a custom loop under ``TFAMP_ENABLE=1`` (``strategy.run`` of a tape +
  ``optimizer.apply`` step) decides the same way on every replica: the
  overflowing step is skipped everywhere and the process-wide scale halves once;
  its good steps match a single-replica run; the same with a tf_keras model
  and ``apply_gradients``;
* the same custom loop under ``MultiWorkerMirroredStrategy`` with two worker
  processes on 127.0.0.1, the overflow on worker 1 only: both workers skip it
  and end with identical weights (slow); with ``tfamp.enable`` and
  ``calibrate_loss_scale`` on workers reading different data, one start scale
  everywhere. Keras 3's own ``fit`` under MultiWorkerMirroredStrategy fails in
  Keras 3 itself, with or without tfamp (tests/test_lifecycle_at_scale.py pins
  it; README says what works).

Logical devices must be configured before TensorFlow initialises, so each
scenario runs in its own process and prints one JSON line.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tests import processes

_SCRIPT = textwrap.dedent(r'''
    import json, sys
    import numpy as np
    import tensorflow as tf

    mode, replicas = sys.argv[1], int(sys.argv[2])
    if mode in ("mw_loop", "mw_enable_loop"):  # MultiWorkerMirroredStrategy, TF_CONFIG
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    elif replicas == 2:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    else:
        strategy = tf.distribute.get_strategy()
    import keras

    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 16)).astype("float32")
    w = rng.normal(size=(16, 1)).astype("float32")
    y = (np.tanh(x @ w / 2.0) + 0.1 * rng.normal(size=(256, 1))).astype("float32")
    bad_x = x[:32].copy()
    bad_x[20, 0] = 1e5  # finite in float32, inf in float16; replica 1's half of 32

    def build():
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dense(1)])
        init = np.random.default_rng(1)
        model.set_weights([(init.uniform(-0.5, 0.5, size=v.shape)).astype("float32")
                           for v in model.get_weights()])
        return model

    def local(variable):
        value = getattr(variable, "value", variable)  # a keras.Variable's tf.Variable
        if callable(value) and not isinstance(value, tf.Variable):
            value = variable  # a tf.Variable (tf_keras): .value is a method
        return [np.asarray(v) for v in strategy.experimental_local_results(value)]

    def replica_values(variables):
        per_var = [local(v) for v in variables]
        return [[vals[r].tolist() for vals in per_var] for r in range(len(per_var[0]))]

    out = {}
    if mode in ("fit", "overflow"):
        import tfamp
        with strategy.scope():
            model = build()
            # SGD for fit: an update is -lr * gradient, so a gradient scaled
            # the wrong number of times on some replica cannot hide (Adam would).
            model.compile(optimizer=keras.optimizers.Adam(1e-2) if mode == "overflow"
                          else keras.optimizers.SGD(0.05), loss="mse")
            if mode == "overflow":
                tfamp.enable(model, initial_scale=2.0**8, growth_interval=6)
        if mode == "fit":  # outside the scope: tfamp enters the model's own
            tfamp.enable(model, initial_scale=2.0**8, growth_interval=6)
        if mode == "fit":
            history = model.fit(x, y, epochs=3, batch_size=32, shuffle=False, verbose=0)
            out["loss"] = history.history["loss"]
            out["scale"] = history.history["loss_scale"]
            out["skipped"] = history.history["skipped_steps"]
            out["weights"] = [v.numpy().ravel().tolist() for v in model.weights]
            out["matmuls"] = model.train_function.reports[0].converted.get("MatMul", 0)
        else:
            # fit, not train_on_batch: train_on_batch hands every replica the
            # whole batch; fit splits it (samples 0-15 / 16-31).
            def one_batch(bx, by):
                logs = model.fit(bx, by, batch_size=32, epochs=1, shuffle=False, verbose=0)
                return {k: v[-1] for k, v in logs.history.items()}

            one_batch(x[:32], y[:32])  # builds everything, one good step
            opt = model.optimizer
            tracked = list(model.trainable_variables) + [
                v for v in opt.inner_optimizer.variables if len(v.shape) > 0]
            before = replica_values(tracked)
            logs = one_batch(bad_x, y[:32])
            after = replica_values(tracked)
            out["skipped_unchanged"] = [a == b for a, b in zip(before, after)]
            out["finite"] = [bool(np.all(np.isfinite(np.concatenate(
                [np.ravel(v) for v in r])))) for r in after]
            out["logs"] = {k: float(v) for k, v in logs.items()}
            out["scale_per_replica"] = [float(v) for v in local(opt.dynamic_scale)]
            out["skipped_per_replica"] = [int(v) for v in local(opt.skipped_steps)]
            out["iterations"] = int(opt.iterations.numpy())
            good = one_batch(x[32:64], y[32:64])
            out["after_good"] = {k: float(v) for k, v in good.items()}
            out["trained_again"] = replica_values(tracked) != after
    elif mode in ("loop", "loop_tf_keras"):  # TFAMP_ENABLE=1: no tfamp import
        if mode == "loop_tf_keras":
            import tf_keras as keras
        with strategy.scope():
            model = build()
            optimizer = keras.optimizers.SGD(0.05)
            optimizer.build(model.trainable_variables)

        def replica_step(bx, by):
            with tf.GradientTape() as tape:
                per_example = tf.reduce_mean((model(bx, training=True) - by) ** 2, axis=1)
                loss = tf.reduce_sum(per_example) / 32.0
            grads = tape.gradient(loss, model.trainable_variables)
            if mode == "loop_tf_keras":
                optimizer.apply_gradients(zip(grads, model.trainable_variables))
            else:
                optimizer.apply(grads, model.trainable_variables)
            return loss

        @tf.function
        def step(bx, by):
            dist = strategy.experimental_distribute_values_from_function(
                lambda ctx: (bx[16 * ctx.replica_id_in_sync_group:][:32 // replicas],
                             by[16 * ctx.replica_id_in_sync_group:][:32 // replicas]))
            return strategy.run(replica_step, args=dist)

        for i in range(4):
            step(tf.constant(x[32 * i:32 * (i + 1)]), tf.constant(y[32 * i:32 * (i + 1)]))
        out["good_weights"] = [v.numpy().ravel().tolist() for v in model.weights]
        before = replica_values(model.trainable_variables)
        step(tf.constant(bad_x), tf.constant(y[:32]))
        after = replica_values(model.trainable_variables)
        out["skipped_unchanged"] = [a == b for a, b in zip(before, after)]
        import tfamp.runtime.startup as startup
        state = startup._active.scale_state
        out["scale"] = float(state.current_loss_scale.numpy())
        out["skipped"] = int(state.skipped_steps.numpy())
        out["iterations"] = [int(v) for v in local(optimizer.iterations)]
    elif mode == "mw_enable_loop":  # MultiWorkerMirroredStrategy, tfamp.enable
        import tfamp
        worker = json.loads(__import__("os").environ["TF_CONFIG"])["task"]["index"]
        # Each worker reads its own data; worker 1's inputs are 30 times larger, so
        # its gradients alone would choose a smaller start scale.
        xw = x[128 * worker:128 * (worker + 1)] * (30.0 if worker == 1 else 1.0)
        yw = y[128 * worker:128 * (worker + 1)]
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.OFF)
        dataset = tf.data.Dataset.from_tensor_slices((xw, yw)).batch(16).with_options(options)
        with strategy.scope():
            model = build()
            model.compile(optimizer=keras.optimizers.SGD(1e-4), loss="mse")
            tfamp.enable(model, verbose=False)
        optimizer = model.optimizer

        def replica_step(bx, by):
            with tf.GradientTape() as tape:
                per_example = tf.reduce_mean((model(bx, training=True) - by) ** 2, axis=1)
                loss = tf.reduce_sum(per_example) / 32.0
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply(grads, model.trainable_variables)

        @tf.function
        def step(batch):
            strategy.run(replica_step, args=batch)

        batches = iter(strategy.experimental_distribute_dataset(dataset))
        first = next(iter(dataset))
        found = tfamp.calibrate_loss_scale(step, next(batches), model=model)
        out["start"] = found.scale
        out["probe"] = [found.max_abs, found.where, found.how,
                        type(model._tfamp_state.strategy()).__name__,
                        model._tfamp_state.strategy().num_replicas_in_sync]
        out["local_first_batch_max"] = float(np.abs(first[0].numpy()).max())
        for batch in batches:
            step(batch)
        out["scale"] = float(optimizer.dynamic_scale.numpy())
        out["skipped"] = int(optimizer.skipped_steps.numpy())
        out["weights"] = [v.numpy().ravel().tolist() for v in model.weights]
    elif mode == "mw_loop":  # MultiWorkerMirroredStrategy, TFAMP_ENABLE=1
        worker = json.loads(__import__("os").environ["TF_CONFIG"])["task"]["index"]
        xw, yw = x[128 * worker:128 * (worker + 1)].copy(), y[128 * worker:128 * (worker + 1)]
        if worker == 1:
            xw[16 * 3 + 5, 0] = 1e5  # batch 3 of worker 1 only overflows in float16
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.OFF)
        dataset = tf.data.Dataset.from_tensor_slices((xw, yw)).batch(16).with_options(options)
        with strategy.scope():  # run with TFAMP_ENABLE=1: no tfamp import
            model = build()
            optimizer = keras.optimizers.SGD(0.05)
            optimizer.build(model.trainable_variables)

        def replica_step(bx, by):
            with tf.GradientTape() as tape:
                per_example = tf.reduce_mean((model(bx, training=True) - by) ** 2, axis=1)
                loss = tf.reduce_sum(per_example) / 32.0
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply(grads, model.trainable_variables)

        @tf.function
        def step(batch):
            strategy.run(replica_step, args=batch)

        for batch in strategy.experimental_distribute_dataset(dataset):
            step(batch)
        import tfamp.runtime.startup as startup
        state = startup._active.scale_state
        out["scale"] = float(state.current_loss_scale.numpy())
        out["skipped"] = int(state.skipped_steps.numpy())
        out["iterations"] = int(optimizer.iterations.numpy())
        out["weights"] = [v.numpy().ravel().tolist() for v in model.weights]
    print(json.dumps(out))
''')


def run(mode, replicas, **env):
    result = subprocess.run([sys.executable, "-c", _SCRIPT, mode, str(replicas)],
                            capture_output=True, text=True, timeout=300,
                            env=processes.environment(env))
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def flat(weights):
    return np.concatenate([np.ravel(w) for w in weights])


@pytest.mark.slow  # two TensorFlow processes, ~35 s
def test_mirrored_fit_matches_a_single_replica():
    single, mirrored = run("fit", 1), run("fit", 2)
    assert mirrored["matmuls"] == 2 * single["matmuls"] > 0  # both replicas rewritten
    assert mirrored["skipped"] == single["skipped"]
    assert mirrored["scale"] == single["scale"]
    np.testing.assert_allclose(mirrored["loss"], single["loss"], rtol=2e-2)
    got, want = flat(mirrored["weights"]), flat(single["weights"])
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-2


def test_mirrored_overflow_on_one_replica_is_skipped_on_every_replica():
    got = run("overflow", 2)
    assert got["skipped_unchanged"] == [True, True]
    assert got["finite"] == [True, True]
    assert got["logs"]["skipped_steps"] == 1 and got["logs"]["loss_scale"] == 2.0**7
    assert got["scale_per_replica"] == [2.0**7, 2.0**7]
    assert got["skipped_per_replica"] == [1, 1]
    assert got["iterations"] == 1  # the skipped step did not count
    assert got["after_good"]["skipped_steps"] == 1 and got["trained_again"]


@pytest.mark.slow  # two TensorFlow processes, ~35 s
@pytest.mark.parametrize("mode", ["loop", "loop_tf_keras"])
def test_tfamp_enable_custom_loop_under_mirrored_decides_alike_on_every_replica(mode):
    # A fixed start (the loop's start is probed otherwise: 2^12 here), so that one
    # skip is one halving from a known scale.
    mirrored = run(mode, 2, TFAMP_ENABLE="1", TFAMP_INITIAL_SCALE="32768")
    assert mirrored["skipped_unchanged"] == [True, True]
    assert mirrored["scale"] == 2.0**14 and mirrored["skipped"] == 1
    # A skipped step counts in iterations for tf_keras (its own wrapper's
    # rule), not for Keras 3 (its own wrapper's rule).
    iterations = 5 if mode == "loop_tf_keras" else 4
    assert mirrored["iterations"] == [iterations, iterations]
    single = run(mode, 1, TFAMP_ENABLE="1", TFAMP_INITIAL_SCALE="32768")
    assert single["skipped_unchanged"] == [True]
    got, want = flat(mirrored["good_weights"]), flat(single["good_weights"])
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-3)
    assert single["iterations"] == [iterations]



def run_workers(mode, **env):
    """`mode` in two MultiWorkerMirroredStrategy workers on loopback ports."""
    results = []
    for returncode, stdout, stderr in processes.run_workers(
            [sys.executable, "-c", _SCRIPT, mode, "1"], env, timeout=400):
        assert returncode == 0, stderr[-4000:]
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    return results


@pytest.mark.slow  # two TensorFlow worker processes with gRPC servers
def test_multiworker_enabled_custom_loop_calibrates_one_scale_on_every_worker():
    # Issue 29: calibrate_loss_scale on every worker, each with the batch it read,
    # sets the one scale the largest gradient of all gives (worker 1's inputs are
    # 30x larger: alone, worker 0 would pick a much larger scale).
    first, second = run_workers("mw_enable_loop")
    assert first["start"] == second["start"] < 2.0**15
    assert first["skipped"] == second["skipped"] == 0
    assert first["scale"] == second["scale"] == first["start"]
    np.testing.assert_array_equal(flat(first["weights"]), flat(second["weights"]))


@pytest.mark.slow  # two TensorFlow worker processes with gRPC servers
def test_multiworker_custom_loop_overflow_on_one_worker_is_skipped_on_both():
    # (Keras 3's own fit under MultiWorkerMirroredStrategy fails here with or
    # without tfamp: "Attempt to convert a value (PerReplica...)"; only the
    # custom loop is tested.)
    first, second = run_workers("mw_loop", TFAMP_ENABLE="1")
    # 8 steps; worker 1's batch 3 overflows: one skip, everywhere, scale halved once.
    for result in (first, second):
        assert result["skipped"] == 1 and result["scale"] == 2.0**14
        assert np.all(np.isfinite(flat(result["weights"])))
    assert first["iterations"] == second["iterations"]
    np.testing.assert_array_equal(flat(first["weights"]), flat(second["weights"]))
