"""TFAMP_ENABLE=1 next to what a script already does (subprocesses, as a user runs them).

These need tfamp *installed* (the start-up hook lives in site-packages), as
``bash scripts/setup.sh`` does.
"""

import sysconfig
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tests.test_env_activation import last_json, run


@pytest.fixture(scope="module", autouse=True)
def installed_hook():
    hook = Path(sysconfig.get_paths()["purelib"]) / "tfamp_startup.pth"
    assert hook.is_file(), f"tfamp's start-up hook is not installed at {hook}; run setup.sh"


def tfamp_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("tfamp:")
            and "no GPU with fast 16-bit math" not in line]


MIXED_POLICY_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    if sys.argv[1] == "tf_keras":
        import tf_keras as keras
    else:
        import keras
    keras.mixed_precision.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    x = np.random.default_rng(0).normal(size=(256, 16)).astype("float32")
    y = x[:, :4].sum(axis=1, keepdims=True)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(1, dtype="float32")])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    history = model.fit(x, y, epochs=3, batch_size=64, verbose=0)
    scale = model.optimizer.loss_scale if sys.argv[1] == "tf_keras" else (
        model.optimizer.dynamic_scale)
    # a method of the model traced outside Keras's makers, as keras-hub's generate is
    import tensorflow as tf
    direct = tf.function(model.predict_step)(tf.constant(x[:4]))
    print(json.dumps({"loss": history.history["loss"], "scale": float(scale.numpy()),
                      "optimizer": type(model.optimizer).__name__,
                      "pred": model.predict(x[:4], verbose=0).ravel().tolist(),
                      "direct": np.asarray(direct).ravel().tolist()}))
""")


@pytest.mark.parametrize("flavour", ["tf_keras", "keras3"])
def test_keras_mixed_policy_under_tfamp_enable_trains_as_keras_alone(tmp_path, flavour):
    script = tmp_path / "mixed.py"
    script.write_text(MIXED_POLICY_SCRIPT)
    plain = last_json(run([str(script), flavour], tmp_path))
    result = run([str(script), flavour], tmp_path, TFAMP_ENABLE="1")
    amp = last_json(result)
    # Keras's own mixed precision and loss scale, untouched: the same numbers exactly.
    assert amp == plain
    assert "LossScaleOptimizer" in amp["optimizer"] and amp["scale"] >= 2 ** 14
    lines = tfamp_lines(result.stderr)
    assert len(lines) == 1, lines
    assert "model 'sequential' runs Keras's 'mixed_float16' policy" in lines[0]
    assert "tfamp steps aside" in lines[0]


PIPELINE_SCRIPT = textwrap.dedent("""
    import json
    import numpy as np
    import tensorflow as tf

    @tf.function
    def prep(a):
        return tf.matmul(a, tf.eye(3)) + 0.0

    x = np.array([[0.1, 7e4, 1.0001]], np.float32)
    mapped = [v.numpy().tolist() for v in tf.data.Dataset.from_tensors(x).map(prep)]
    batched = [v.numpy().tolist() for v in tf.data.Dataset.from_tensors(x).map(
        lambda a: tf.cond(tf.reduce_all(a > -1e9), lambda: prep(a), lambda: a))]
    print(json.dumps({"mapped": mapped, "nested": batched,
                      "step": prep(tf.constant(x)).dtype.name}))
""")


def test_a_function_inside_a_tf_data_pipeline_runs_float32(tmp_path):
    """tensorflow/docs' pix2pix calls a tf.function of its own in Dataset.map: it
    was rewritten like a training step, so the host-side pipeline computed in
    16 bits (a product of 7e4 gave inf and nan). Inside a pipeline, nested in a
    cond too, it now runs as traced; called as a step it is still rewritten."""
    script = tmp_path / "pipeline.py"
    script.write_text(PIPELINE_SCRIPT)
    result = run(script, tmp_path, TFAMP_ENABLE="1")
    out = last_json(result)
    x = [[0.1, 7e4, 1.0001]]
    assert out["mapped"] == [np.float32(x).tolist()] == out["nested"]
    assert out["step"] == "float32"  # (its outputs keep their dtype)
    assert [line for line in tfamp_lines(result.stderr)
            if line.startswith("tfamp: prep: ")], result.stderr  # the step, rewritten
    # A script whose only tf.function is its pipeline's is told so at exit.
    script.write_text(PIPELINE_SCRIPT.replace('"step": prep(tf.constant(x)).dtype.name', ""))
    result = run(script, tmp_path, TFAMP_ENABLE="1")
    assert last_json(result)["mapped"] == [np.float32(x).tolist()]
    assert "the script's only tf.functions (prep) ran inside its tf.data pipeline, which " \
        "stays float32" in result.stderr, result.stderr


def test_exit_notice_is_silent_after_a_crash(tmp_path):
    # A crash before any tf.function: the notice "traced no tf.function" would
    # be true, but after a traceback it is noise.
    script = "import tensorflow as tf\nraise RuntimeError('the script fails early')\n"
    result = run(["-c", script], tmp_path, TFAMP_ENABLE="1")
    assert result.returncode == 1
    assert "RuntimeError: the script fails early" in result.stderr
    assert "TFAMP_ENABLE is on but" not in result.stderr


def test_exit_notice_still_warns_when_nothing_was_traced(tmp_path):
    script = "import tensorflow as tf\nprint('eager only', float(tf.ones([])))\n"
    result = run(["-c", script], tmp_path, TFAMP_ENABLE="1")
    assert result.returncode == 0
    assert "the script traced no tf.function" in result.stderr


def test_a_process_that_never_imports_tensorflow_imports_and_prints_nothing(tmp_path):
    """pip, shell tools, any Python process of a shell with TFAMP_ENABLE exported."""
    code = "import sys; print(sorted(m for m in sys.modules if m.split('.')[0] in " \
           "('tensorflow', 'keras', 'tf_keras', 'numpy')))"
    result = run(["-X", "importtime", "-c", code], tmp_path, TFAMP_ENABLE="1")
    assert result.returncode == 0 and result.stdout.strip() == "[]"
    assert not [line for line in result.stderr.splitlines() if line.startswith("tfamp")]
    imported = {line.split("|")[-1].strip() for line in result.stderr.splitlines()
                if line.startswith("import time:")}
    ours = {name for name in imported if name.startswith("tfamp")}
    # The hook and the settings reader, nothing heavier (no dataclasses/typing either).
    assert ours == {"tfamp", "tfamp.runtime", "tfamp.runtime.hook", "tfamp.env"}, ours
    assert not imported & {"typing", "dataclasses", "logging"}


@pytest.mark.parametrize("first_import", ["import keras", "import tf_keras",
                                          "from tensorflow import keras"])
def test_tfamp_activates_whatever_is_imported_first(tmp_path, first_import):
    script = textwrap.dedent(f"""
        {first_import}
        import tensorflow as tf
        f = tf.function(lambda x: tf.matmul(x, x))
        print(f(tf.ones([4, 4])).dtype.name)
    """)
    result = run(["-c", script], tmp_path, TFAMP_ENABLE="1")
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "float32"
    assert "-> float16 (MatMul x1)" in result.stderr


def test_a_misspelled_variable_gets_a_hint_and_tfamp_stays_off(tmp_path):
    script = "import sys; print('tensorflow' in sys.modules)"
    result = run(["-c", script], tmp_path, TFAMP_ENABLED="1")
    assert result.returncode == 0 and result.stdout.strip() == "False"
    assert tfamp_lines(result.stderr) == [
        "tfamp: TFAMP_ENABLED is not a tfamp setting; did you mean TFAMP_ENABLE? "
        "(TFAMP_ENABLE is not set, so tfamp is off)"]


KERAS3_FIT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import keras
    x = np.random.default_rng(0).normal(size=(256, 16)).astype("float32")
    y = x[:, :4].sum(axis=1, keepdims=True)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer="adam", loss="mse", steps_per_execution=int(sys.argv[1]),
                  jit_compile=True if sys.argv[2] == "jit" else "auto")
    history = model.fit(x, y, epochs=3, batch_size=32, verbose=0)
    print(json.dumps({"loss": history.history["loss"]}))
""")


@pytest.mark.parametrize("steps_per_execution, jit", [(1, "auto"), (4, "auto"), (4, "jit")])
def test_keras3_fit_logs_one_summary_per_rewritten_step(tmp_path, steps_per_execution, jit):
    script = tmp_path / "fit.py"
    script.write_text(KERAS3_FIT)
    reports = tmp_path / "reports"
    result = run([str(script), str(steps_per_execution), jit], tmp_path, TFAMP_ENABLE="1",
                 TFAMP_REPORT_DIR=str(reports))
    loss = last_json(result)["loss"]
    assert loss[-1] < loss[0]
    summaries = [line for line in tfamp_lines(result.stderr) if " ops -> " in line]
    # The train step, once; not Keras's multi_step_on_iterator wrapped around it.
    assert len(summaries) == 1, summaries
    assert "-> float16 (MatMul" in summaries[0]
    assert not any("multi_step_on_iterator" in line for line in result.stderr.splitlines())
    assert [p.name for p in reports.glob("*.json")] == ["001_" + summaries[0].split(":")[1]
                                                       .strip() + ".json"]


KERAS_OWN_LSO = textwrap.dedent("""
    import json, sys
    import numpy as np
    import tf_keras as keras
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 8)).astype("float32")
    y = x[:, :1]
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                              keras.layers.Dense(1)])
    optimizer = keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    model.compile(optimizer=optimizer, loss="mse")
    before = np.concatenate([w.ravel() for w in model.get_weights()])
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    delta = np.concatenate([w.ravel() for w in model.get_weights()]) - before
    model.save(sys.argv[1], save_format="tf")
    again = keras.models.load_model(sys.argv[1])
    again.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    print(json.dumps({"delta": delta.tolist(), "scale": float(model.optimizer.loss_scale),
                      "reloaded": type(again.optimizer).__name__}))
""")


def test_tf_keras_own_loss_scale_optimizer_is_kept_and_scales_once(tmp_path):
    """A tf_keras model compiled with Keras's LossScaleOptimizer (or reloaded from a
    SavedModel with one) keeps it under TFAMP_ENABLE: tfamp rewrites its graphs, Keras
    scales the loss once (scaled a second time by the tape patch, 2^30, every step
    overflowed and was skipped: the weights never moved)."""
    script = tmp_path / "own_lso.py"
    script.write_text(KERAS_OWN_LSO)
    plain = last_json(run([str(script), str(tmp_path / "plain")], tmp_path))
    amp_result = run([str(script), str(tmp_path / "amp")], tmp_path, TFAMP_ENABLE="1")
    amp = last_json(amp_result)
    assert "uses Keras's own LossScaleOptimizer" in amp_result.stderr
    assert "ops -> float16 (MatMul" in amp_result.stderr
    assert amp["reloaded"] == plain["reloaded"]
    want, got = np.array(plain["delta"]), np.array(amp["delta"])
    cosine = float(want @ got / np.linalg.norm(want) / np.linalg.norm(got))
    assert cosine > 0.99 and 0.9 < np.linalg.norm(got) / np.linalg.norm(want) < 1.1


LEGACY_OPTIMIZERS = textwrap.dedent("""
    import json
    import numpy as np
    import tf_keras as keras
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 8)).astype("float32")
    y = x[:, :1]

    def mlp():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                 keras.layers.Dense(1)])

    def flat(model):
        return np.concatenate([w.ravel() for w in model.get_weights()])

    out = {}
    for name, optimizer in [
            ("legacy", keras.optimizers.legacy.Adam(1e-2)),
            ("keras_lso", keras.mixed_precision.LossScaleOptimizer(
                keras.optimizers.legacy.SGD(0.1)))]:
        model = mlp()
        model.compile(optimizer=optimizer, loss="mse")
        before = flat(model)
        model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
        out[name] = (flat(model) - before).tolist()
        out[name + "_scale"] = float(getattr(model.optimizer, "loss_scale", 0))
        skipped = getattr(model.optimizer, "skipped_steps", None)
        out[name + "_skipped"] = None if skipped is None else int(skipped.numpy())
    # One legacy optimizer compiled into two models (a GAN's discriminator and its
    # combined model, as Keras 2 scripts do), trained with train_on_batch.
    shared = keras.optimizers.legacy.Adam(1e-3)
    first, second = mlp(), mlp()
    first.compile(optimizer=shared, loss="mse")
    second.compile(optimizer=shared, loss="mse", metrics=["mae"])
    out["shared_logs"] = [first.train_on_batch(x[:32], y[:32]),
                          second.train_on_batch(x[:32], y[:32])]
    out["shared_one_optimizer"] = first.optimizer is second.optimizer
    out["shared_class"] = type(first.optimizer).__name__
    print(json.dumps(out))
""")


def test_tf_keras_legacy_optimizers_train_under_tfamps_loss_scaling(tmp_path):
    """tf_keras's legacy optimizers (``keras.optimizers.legacy.*``) stopped an
    unmodified script with a TypeError at compile (eriklindernoren/Keras-GAN's dcgan,
    session 33); then Keras's own LossScaleOptimizer scaled them, from 2^15, with no
    start-scale probe and no fallback (Keras-GAN's infogan skipped 7 of its first 12
    discriminator steps, session 34). tfamp's own loss-scale optimizer takes them now:
    probed start, no step skipped. A legacy one the script wrapped in Keras's
    LossScaleOptimizer keeps Keras's scaling, applied once (the tape patch once scaled
    it a second time: 2^30, every step skipped)."""
    script = tmp_path / "legacy.py"
    script.write_text(LEGACY_OPTIMIZERS)
    plain = last_json(run([str(script)], tmp_path))
    amp_result = run([str(script)], tmp_path, TFAMP_ENABLE="1")
    amp = last_json(amp_result)
    assert "legacy optimizer" not in amp_result.stderr
    assert "tfamp: start loss scale 2^" in amp_result.stderr
    assert "uses Keras's own LossScaleOptimizer" in amp_result.stderr
    assert "ops -> float16 (MatMul" in amp_result.stderr
    for name in ("legacy", "keras_lso"):
        want, got = np.array(plain[name]), np.array(amp[name])
        cosine = float(want @ got / np.linalg.norm(want) / np.linalg.norm(got))
        ratio = float(np.linalg.norm(got) / np.linalg.norm(want))
        print(f"{name}: cosine {cosine:.5f}, norm ratio {ratio:.4f}, "
              f"scale {amp[name + '_scale']:g}")
        assert cosine > 0.99 and 0.9 < ratio < 1.1, name
    assert amp["legacy_skipped"] == 0  # tfamp's counter: no step skipped
    assert amp["keras_lso_skipped"] is None
    assert amp["keras_lso_scale"] == 2.0**15  # Keras's: no step skipped (each halves it)
    # As float32 returns them: the loss as a number; a list with a metric.
    assert isinstance(amp["shared_logs"][0], float)
    assert len(amp["shared_logs"][1]) == len(plain["shared_logs"][1]) == 2
    np.testing.assert_allclose(amp["shared_logs"][0], plain["shared_logs"][0], rtol=1e-2)
    assert amp["shared_one_optimizer"]  # one scale for the optimizer they share
    assert amp["shared_class"] == "LegacyLossScaleOptimizer"


EAGER_THEN_TRACED = """
import sys
import numpy as np
import tensorflow as tf
if sys.argv[1] == "tf_keras":
    import tf_keras as keras
else:
    import keras
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                          keras.layers.Dense(1)])
optimizer = keras.optimizers.SGD(1e-2)
x = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")
for start in range(0, 64, 16):  # the guide's first loop: eager
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x[start:start + 16]) - 1.0))
    grads = tape.gradient(loss, model.trainable_weights)
    optimizer.apply_gradients(zip(grads, model.trainable_weights))
evaluate = tf.function(lambda b: tf.reduce_mean(model(b)))  # traced later
print(float(evaluate(x)))
"""


@pytest.mark.parametrize("flavour", ["tf_keras", "keras3"])
def test_an_eager_loop_is_told_it_runs_float32_even_when_the_script_traces_later(
        tmp_path, flavour):
    # Issue 28.6: the exit notice spoke only when nothing at all was traced.
    result = run(["-c", EAGER_THEN_TRACED, flavour], tmp_path, TFAMP_ENABLE="1")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in tfamp_lines(result.stderr) if "applies gradients eagerly" in line]
    assert len(lines) == 1, tfamp_lines(result.stderr)
    assert "@tf.function" in lines[0]


def test_an_eager_loop_in_bfloat16_is_told_it_runs_float32_too(tmp_path):
    """Without loss scaling the scaling patches were not installed, and with them the
    line: a bfloat16 eager loop that traced something later was told nothing."""
    result = run(["-c", EAGER_THEN_TRACED, "tf_keras"], tmp_path, TFAMP_ENABLE="1",
                 TFAMP_DTYPE="bfloat16")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in tfamp_lines(result.stderr) if "applies gradients eagerly" in line]
    assert len(lines) == 1, tfamp_lines(result.stderr)


TRACED_GRADIENTS_EAGER_UPDATE = """
import json, sys
import numpy as np
import tensorflow as tf
if sys.argv[1] == "tf_keras":
    import tf_keras as keras
else:
    import keras
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(10, activation="relu"),
                          keras.layers.Dense(3)])
optimizer = keras.optimizers.SGD(1e-2)

@tf.function  # the tensorflow/docs walkthrough's grad(), decorated; the update stays eager
def grad(x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
    return loss, tape.gradient(loss, model.trainable_variables)

x = np.random.default_rng(0).random((32, 4)).astype("float32")
y = np.zeros((32, 3), "float32")
changed = []
for batch in (x, x * 1e5, x):  # the second's Dense output overflows float16, not float32
    before = [w.numpy() for w in model.trainable_variables]
    loss, grads = grad(batch, y)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    changed.append(any(not np.array_equal(b, w.numpy())
                       for b, w in zip(before, model.trainable_variables)))
print(json.dumps({"changed": changed}))
"""


@pytest.mark.parametrize("flavour", ["tf_keras", "keras3"])
def test_traced_gradients_applied_eagerly_are_not_told_they_run_float32(tmp_path, flavour):
    """The line said "runs in float32, decorate the step" to a script whose gradients
    come from a traced function: those are mixed precision and scaled, and the eager
    update skips the step that overflows float16."""
    result = run(["-c", TRACED_GRADIENTS_EAGER_UPDATE, flavour], tmp_path, TFAMP_ENABLE="1",
                 TFAMP_INITIAL_SCALE="1024")
    assert result.returncode == 0, result.stderr[-3000:]
    assert not [line for line in tfamp_lines(result.stderr) if "eagerly" in line], \
        tfamp_lines(result.stderr)
    assert last_json(result)["changed"] == [True, False, True]


def test_a_step_talking_to_other_workers_is_not_probed_by_the_hook():
    """The custom-loop probe runs on one machine's strategy (its collectives on
    /job:localhost) but not where workers would each pick a scale alone."""
    from types import SimpleNamespace

    from tensorflow.core.framework import graph_pb2

    from tfamp.runtime import startup

    def step_with_collective_on(device):
        graph_def = graph_pb2.GraphDef()
        graph_def.library.function.add().node_def.add(
            name="all_reduce", op="CollectiveReduceV2", device=device)
        return SimpleNamespace(graph=SimpleNamespace(as_graph_def=lambda: graph_def))

    assert startup._talks_to_other_workers(
        step_with_collective_on("/job:worker/replica:0/task:1/device:GPU:0"))
    assert "multi-worker" in startup._no_probe_reason(
        step_with_collective_on("/job:worker/replica:0/task:0/device:CPU:0"), (), {})
    local = step_with_collective_on("/job:localhost/replica:0/task:0/device:CPU:1")
    assert not startup._talks_to_other_workers(local)
    assert startup._no_probe_reason(local, (), {}) == ""


def test_a_step_taking_a_dataset_is_not_probed_by_the_hook():
    """An epoch function looping over a (distributed) dataset: a probe would read it."""
    import tensorflow as tf

    from tfamp.runtime import startup

    data = tf.data.Dataset.range(4).batch(2)
    distributed = tf.distribute.MirroredStrategy(["/cpu:0"]).experimental_distribute_dataset(
        data)
    no_collectives = tf.function(lambda: tf.constant(1.0)).get_concrete_function()
    for argument in (data, distributed, iter(data), iter(distributed)):
        why = startup._no_probe_reason(no_collectives, (argument,), {})
        assert "iterator or a dataset" in why, (type(argument).__name__, why)
    assert startup._no_probe_reason(no_collectives, (tf.constant([1.0]),), {}) == ""


def test_tfamps_own_commands_give_no_exit_notice_under_tfamp_enable(tmp_path):
    """A shell that exported TFAMP_ENABLE=1 runs `tfamp inspect` / `tfamp export`: the
    exit notice ("the script traced no tf.function") speaks of a script's training,
    and was printed after tfamp's own commands (an export's saves are float32 traces
    since session 22, so they are not rewritten either)."""
    import tensorflow as tf

    @tf.function
    def step(x):
        return tf.nn.relu(tf.matmul(x, x))

    graph_def = step.get_concrete_function(tf.TensorSpec([8, 8])).graph.as_graph_def()
    path = tmp_path / "step.pb"
    path.write_bytes(graph_def.SerializeToString())
    result = run(["-m", "tfamp", "inspect", str(path)], tmp_path, TFAMP_ENABLE="1")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "MatMul" in result.stdout
    assert "TFAMP_ENABLE is on but" not in result.stderr, result.stderr[-2000:]


TENSORBOARD_GRAPH = """
import json, sys
import numpy as np
import tensorflow as tf
import tf_keras as keras
keras.utils.set_random_seed(0)
x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                          keras.layers.Dense(1)])
model.compile("adam", "mse")
logs = sys.argv[1]
# write_graph (its default) runs in a batch hook: with a progress bar (verbose=1)
history = model.fit(x, x[:, :1], epochs=1, batch_size=16, verbose=1,
                    callbacks=[keras.callbacks.TensorBoard(log_dir=logs)])
ops = set()
for path in tf.io.gfile.glob(logs + "/train/events.out.tfevents.*"):
    for event in tf.compat.v1.train.summary_iterator(path):
        if event.graph_def:
            graph = tf.compat.v1.GraphDef.FromString(event.graph_def)
            ops |= {node.op for node in graph.node}
            ops |= {node.op for f in graph.library.function for node in f.node_def}
print(json.dumps({"loss": history.history["loss"], "ops": sorted(ops)}))
"""


def test_tf_keras_tensorboard_writes_the_train_graph(tmp_path):
    """tf_keras's TensorBoard callback (write_graph, its default) reads the train
    function's first trace (``_concrete_variable_creation_fn``) after the first batch:
    under TFAMP_ENABLE that raised AttributeError and stopped fit (keras.io and
    tensorflow/docs scripts that log to TensorBoard). It gets the step as traced, in
    float32; ``tfamp inspect`` shows the rewrite."""
    script = tmp_path / "board.py"  # not tensorboard.py: the import would find it
    script.write_text(TENSORBOARD_GRAPH)
    result = run([str(script), str(tmp_path / "logs")], tmp_path, TFAMP_ENABLE="1")
    out = last_json(result)
    assert "ops -> float16 (MatMul" in result.stderr
    assert np.isfinite(out["loss"]).all()
    assert "MatMul" in out["ops"], out["ops"]


def _watch_calls(skipped_at, calls):
    """Drives a custom loop's watch: `skipped_at(i)` says whether call i (1-based)
    skipped. Returns (the calls it read the counter after, the call it looked at)."""
    from tfamp.runtime.startup import _LoopWatch

    watch, skipped, reads = _LoopWatch(), 0, []
    for i in range(1, calls + 1):
        skipped += bool(skipped_at(i))
        if watch.due():
            reads.append(i)
            if watch.observe(skipped):
                return reads, i
    return reads, None


def test_a_custom_loops_watch_reads_rarely_and_looks_soon_after_skips_begin():
    """Reads after calls 2, 6, 14, then every 16 while steps apply (a host read waits
    for the device); a read that finds 4 or more skips looks (one that finds fewer
    reads after every call until 4 in a row), not at the next full window (a helper's
    real script lost 27 of 50 steps to the first rule, which needed 16 in a row), and
    an overflow from the first step is looked at on the 4th (a MirroredStrategy loop,
    where the start-scale check does not run, lost all of its 8)."""
    from tfamp.keras import fallback
    from tfamp.runtime.startup import CHECK_EVERY, LOOK_AFTER, _LoopWatch

    reads, looked = _watch_calls(lambda i: False, 100)
    assert reads == [2, 6, 14, *range(14 + CHECK_EVERY, 101, CHECK_EVERY)], reads
    assert looked is None
    # Skipping from call 25 on: the read at 30 sees 6, and looks.
    assert _watch_calls(lambda i: i >= 25, 100) == ([2, 6, 14, 30], 30)
    # From call 29: the read at 30 sees 2, then one read per call.
    assert _watch_calls(lambda i: i >= 29, 100) == ([2, 6, 14, 30, 31, 32], 32)
    # Skipping from the first call: looked at the 4th.
    assert _watch_calls(lambda i: True, 100) == ([2, 3, 4], LOOK_AFTER)
    # Dynamic scaling's own single skips (one every 40 calls) never make it look, and
    # the reads go back to every 16 calls after the one that followed a skip.
    reads, looked = _watch_calls(lambda i: i % 40 == 0, 200)
    assert looked is None and len(reads) <= 200 // CHECK_EVERY + 5 * (200 // 40), reads
    # A look that finds nothing at loss scale 1 doubles the run it waits for.
    watch = _LoopWatch()
    watch.record(fallback.FallbackDecision(fallback.NOT_FOUND))
    assert watch.look_after == 2 * LOOK_AFTER


def test_a_custom_loops_exit_line_at_the_floor_names_a_forward_overflow(caplog):
    """keras.io's neural style transfer, before its fallback worked: 20 of 20 steps
    skipped, the scale at its floor, and the exit line blamed "float16 gradients" and
    offered TFAMP_INITIAL_SCALE, which cannot help a forward pass past 65504. At the
    floor it now says what most likely overflows and how to keep it float32."""
    import types

    import tensorflow as tf

    from tfamp.runtime.startup import _LoopWatch, _tell_custom_loop_skips

    def active(scale: float):
        state = types.SimpleNamespace(skipped_steps=tf.constant(20),
                                      current_loss_scale=tf.constant(scale), min_scale=1.0)
        return types.SimpleNamespace(scale_state=state, loop_watch=_LoopWatch(),
                                     settings=types.SimpleNamespace(loss_scale="dynamic"))

    with caplog.at_level("INFO", logger="tfamp"):
        _tell_custom_loop_skips(active(1.0))
    [record] = caplog.records
    assert record.levelname == "WARNING" and "ends at its floor, 1," in record.message
    assert "TFAMP_KEEP_FP32=" in record.message and "TFAMP_INITIAL_SCALE" not in record.message
    caplog.clear()
    with caplog.at_level("INFO", logger="tfamp"):
        _tell_custom_loop_skips(active(1024.0))
    [record] = caplog.records
    assert record.levelname == "INFO" and "TFAMP_INITIAL_SCALE=<number>" in record.message
