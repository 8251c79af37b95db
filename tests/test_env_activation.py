"""TFAMP_ENABLE=1 on unmodified scripts, run in subprocesses as a user would.

These need tfamp *installed* (the start-up hook lives in site-packages), as
``bash scripts/setup.sh`` does.
"""

import json
import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import numpy as np
import pytest

import tfamp

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"


@pytest.fixture(scope="module", autouse=True)
def installed_hook():
    hook = Path(sysconfig.get_paths()["purelib"]) / "tfamp_startup.pth"
    assert hook.is_file(), (
        f"tfamp's start-up hook is not installed at {hook}; run `bash scripts/setup.sh` "
        f"(these tests exercise the installed package)")


def run(script_or_args, tmp_path, **env):
    args = script_or_args if isinstance(script_or_args, list) else [str(script_or_args)]
    environment = {k: v for k, v in os.environ.items() if not k.startswith("TFAMP_")}
    environment.update({"TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": "", **env})
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=600, env=environment, cwd=str(tmp_path))


def last_json(result):
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


FIT_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    flavour = sys.argv[1]
    if flavour == "tf_keras":
        import tf_keras as keras
    else:
        import tensorflow as tf
        keras = tf.keras
    keras.utils.set_random_seed(0)
    x = np.random.default_rng(0).normal(size=(512, 16)).astype("float32")
    y = x[:, :4].sum(axis=1, keepdims=True)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    history = model.fit(x, y, epochs=6, batch_size=64, verbose=0)
    print(json.dumps({"loss": history.history["loss"],
                      "optimizer": type(model.optimizer).__name__,
                      "pred": model.predict(x[:8], verbose=0).ravel().tolist(),
                      "tfamp_imported": "tfamp" in sys.modules}))
""")


@pytest.mark.parametrize("flavour", ["tf_keras", "keras3"])
def test_unmodified_keras_fit_runs_mixed_precision(tmp_path, flavour):
    script = tmp_path / "fit.py"
    script.write_text(FIT_SCRIPT)
    plain = last_json(run([str(script), flavour], tmp_path))
    reports = tmp_path / "reports"
    amp_result = run([str(script), flavour], tmp_path, TFAMP_ENABLE="1",
                     TFAMP_REPORT_DIR=str(reports))
    amp = last_json(amp_result)
    assert plain["tfamp_imported"] is False and plain["optimizer"] == "Adam"
    assert amp["tfamp_imported"] is True and amp["optimizer"] == "LossScaleOptimizer"
    assert "ops -> float16 (MatMul" in amp_result.stderr
    saved = [tfamp.RewriteReport.from_dict(json.loads(p.read_text()))
             for p in sorted(reports.glob("*.json"))]
    assert any(r.converted.get("MatMul", 0) >= 2 for r in saved), [r.function for r in saved]
    # Predictions differ by 16-bit rounding (plus any skipped overflow step) only.
    want, got = np.array(plain["pred"]), np.array(amp["pred"])
    assert not np.array_equal(want, got)
    np.testing.assert_allclose(got, want, atol=0.1 * np.abs(want).max())
    assert amp["loss"][-1] == pytest.approx(plain["loss"][-1], rel=0.15)


def test_custom_loop_overflow_step_is_skipped_only_with_tfamp(tmp_path):
    script = EXAMPLES / "plain_custom_loop.py"
    plain = run(script, tmp_path)
    amp = run(script, tmp_path, TFAMP_ENABLE="1")
    assert plain.returncode == 0 and amp.returncode == 0, amp.stderr[-3000:]
    assert "weights unchanged: False, finite: False" in plain.stdout
    assert "step 40: loss nan" in plain.stdout
    assert "weights unchanged: True, finite: True" in amp.stdout
    final = float(amp.stdout.strip().splitlines()[-1].split()[-1])
    assert final < 0.1
    assert "train_step: " in amp.stderr and "-> float16 (MatMul" in amp.stderr


CUSTOM_LOOP_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    import tensorflow as tf
    flavour, feed = sys.argv[1], sys.argv[2]
    if feed == "mirrored":
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    if flavour == "tf_keras":
        import tf_keras as keras
    else:
        keras = tf.keras
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="relu"),
                              keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(1e-6)
    x = np.random.default_rng(0).normal(size=(128, 16)).astype("float32")
    y = 30.0 * x.sum(axis=1, keepdims=True)

    def loss_and_update(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(model(xb) - yb))  # a sum: overflows at 2**15
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    if feed == "batches":
        step = tf.function(loss_and_update)
        for i in range(4):
            step(x[32 * i:32 * (i + 1)], y[32 * i:32 * (i + 1)])
    elif feed == "traced_first":
        step = tf.function(loss_and_update)
        step.get_concrete_function(x[:32], y[:32])  # traced (its tape scaled), not run
        predict = tf.function(lambda xb: model(xb))
        predict(x[:32])  # the first run after that trace: no loss, not the step
        for i in range(4):
            step(x[32 * i:32 * (i + 1)], y[32 * i:32 * (i + 1)])
    elif feed == "mirrored":  # one machine, two replicas, a distributed batch
        with strategy.scope():
            model = keras.Sequential([keras.Input((16,)),
                                      keras.layers.Dense(64, activation="relu"),
                                      keras.layers.Dense(1)])
            optimizer = keras.optimizers.SGD(1e-6)
        @tf.function
        def step(batch):
            return strategy.run(loss_and_update, args=batch)
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
        for batch in strategy.experimental_distribute_dataset(data):
            step(batch)
    else:  # the step reads its batch from an iterator
        @tf.function
        def step(iterator):
            return loss_and_update(*next(iterator))
        iterator = iter(tf.data.Dataset.from_tensor_slices((x, y)).batch(32))
        for _ in range(4):
            step(iterator)
    from tfamp.runtime import startup  # (the test reads the custom-loop scale)
    print(json.dumps({"skipped": int(startup.process_scale_state().skipped_steps.numpy())}))
""")


@pytest.mark.parametrize("flavour", ["keras3", "tf_keras"])
def test_a_custom_loop_starts_at_a_scale_from_its_own_gradients(tmp_path, flavour):
    """The probe fit runs, before the step's first run: no step lost to 2**15's
    overflows (which the fixed start shows it would lose)."""
    script = tmp_path / "loop.py"
    script.write_text(CUSTOM_LOOP_SCRIPT)
    auto = run([str(script), flavour, "batches"], tmp_path, TFAMP_ENABLE="1")
    assert last_json(auto)["skipped"] == 0, auto.stderr[-3000:]
    assert "tfamp: start loss scale 2^" in auto.stderr
    assert "loss scale skipped" not in auto.stderr
    fixed = run([str(script), flavour, "batches"], tmp_path, TFAMP_ENABLE="1",
                TFAMP_INITIAL_SCALE="32768")
    skipped = last_json(fixed)["skipped"]
    assert skipped >= 1
    assert "tfamp: start loss scale" not in fixed.stderr
    # A custom loop has no History: the skips are told once, at exit.
    assert (f"tfamp: your training loop's dynamic loss scale skipped {skipped} step"
            in fixed.stderr), fixed.stderr[-2000:]


COMPILED_OPTIMIZER_LOOP = textwrap.dedent("""
    import json, sys
    import numpy as np
    import tensorflow as tf
    flavour, which, where = sys.argv[1], sys.argv[2], sys.argv[3]
    if flavour == "tf_keras":
        import tf_keras as keras
    else:
        keras = tf.keras
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"),
                              keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    optimizer = model.optimizer if which == "compiled" else keras.optimizers.SGD(0.01)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 16)).astype("float32")
    y = 8.0 * rng.normal(size=(256, 1)).astype("float32")
    before = [w.copy() for w in model.get_weights()]

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
        grads = tape.gradient(loss, model.trainable_variables)
        if where == "eager":  # the function returns its gradients; applied eagerly
            return grads
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    for i in range(8):
        out = step(x[32 * i:32 * (i + 1)], y[32 * i:32 * (i + 1)])
        if where == "eager":
            optimizer.apply_gradients(zip(out, model.trainable_variables))
    from tfamp.runtime import startup
    print(json.dumps({
        "optimizer": type(optimizer).__name__,
        "skipped": int(startup.process_scale_state().skipped_steps.numpy()),
        "update": [(a - b).ravel().tolist() for a, b in zip(model.get_weights(), before)]}))
""")


@pytest.mark.parametrize("where", ["traced", "eager"])
@pytest.mark.parametrize("flavour", ["keras3", "tf_keras"])
def test_a_custom_loop_with_the_compiled_optimizer_halves_the_scale_it_seeds_with(
        tmp_path, flavour, where):
    """The compiled model's optimizer (tfamp's loss-scale optimizer under TFAMP_ENABLE)
    in a custom loop: the tape seeds with the process-wide scale, so that scale must
    be the one that halves when a step overflows. (It used to halve its own, unused,
    scale: the process scale stayed at 2^15 and 7 of 8 steps were skipped, update
    cosine 0.31 against float32's.) Same skips and update as with a plain optimizer.
    "eager": the traced function returns its gradients and the update runs eagerly
    (session 37: the same defect there, every step skipped from 2^22 on)."""
    script = tmp_path / "loop.py"
    script.write_text(COMPILED_OPTIMIZER_LOOP)
    runs = {which: last_json(run([str(script), flavour, which, where], tmp_path,
                                 TFAMP_ENABLE="1", TFAMP_INITIAL_SCALE="32768"))
            for which in ("compiled", "own")}
    compiled, own = runs["compiled"], runs["own"]
    assert compiled["optimizer"] == "LossScaleOptimizer" and own["optimizer"] == "SGD"
    assert 1 <= own["skipped"] <= 3  # 2^15 overflows here; halving fixes it
    assert compiled["skipped"] == own["skipped"]
    for got, want in zip(compiled["update"], own["update"], strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)


ONE_CHANNEL_NORM_LOOP = textwrap.dedent("""
    import json, sys
    import tensorflow as tf
    tests, flavour, check = sys.argv[1], sys.argv[2], sys.argv[3]
    sys.path.insert(0, tests)
    import patterns
    # (since session 38 the rewrite keeps a normalisation over one element float32:
    # switched off, so the step makes the 16-bit cancellation the check is for)
    from tfamp.rewrite import value_ranges
    value_ranges.one_element_variance = lambda body, counts, node: ""
    if check == "unchecked":  # the float32 probe's choice, as before the check
        from tfamp.keras import start_scale
        start_scale._checked_on_16bit = lambda found, *args, **kwargs: found
    keras = patterns.keras_module(flavour)
    model, (x, y), _ = patterns.build(keras, "one_channel_norm")
    optimizer = keras.optimizers.SGD(0.01)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
                yb, model(xb, training=True)))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    n = patterns.BATCH
    for k in range(patterns.STEPS):
        step(x[k * n:(k + 1) * n], y[k * n:(k + 1) * n])
    from tfamp.runtime import startup
    print(json.dumps({"skipped": int(startup.process_scale_state().skipped_steps.numpy())}))
""")


@pytest.mark.parametrize("flavour", ["keras3", "tf_keras"])
def test_a_custom_loops_start_scale_is_checked_on_its_16bit_step(tmp_path, flavour):
    """A custom loop's probe traces the step itself; its scale is checked on that
    trace's rewrite, as fit's is (keras.io's timeseries Transformer's one-channel
    LayerNorm, whose variance gradient only the 16-bit step makes large)."""
    script = tmp_path / "loop.py"
    script.write_text(ONE_CHANNEL_NORM_LOOP)
    tests = str(Path(__file__).parent)
    if flavour == "keras3":  # (the check's absence shows once: seconds of subprocess)
        unchecked = run([str(script), tests, flavour, "unchecked"], tmp_path,
                        TFAMP_ENABLE="1")
        assert last_json(unchecked)["skipped"] >= 2, unchecked.stderr[-3000:]
    checked = run([str(script), tests, flavour, "checked"], tmp_path, TFAMP_ENABLE="1")
    assert last_json(checked)["skipped"] == 0, checked.stderr[-3000:]
    [line] = [s for s in checked.stderr.splitlines() if "tfamp: start loss scale 2^" in s]
    assert "set by the float16 step" in line and "layer_normalization" in line, line


OVERFLOWING_LAYER_LOOP = textwrap.dedent("""
    import json, math, sys
    import numpy as np
    import tensorflow as tf
    flavour, fallback, when = sys.argv[1], sys.argv[2], sys.argv[3]
    mirrored = "mirrored" in sys.argv[4:]  # one machine, two replicas
    norm = "norm" in sys.argv[4:]  # a BatchNorm after the overflow
    if fallback == "unrepaired":  # (the moving statistics left as the skips wrote them)
        from tfamp.keras import fallback
        fallback.reset_moving_statistics = lambda variables: ()
    if mirrored:
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    else:
        strategy = tf.distribute.get_strategy()
    if flavour == "tf_keras":
        import tf_keras as keras
    else:
        keras = tf.keras
    if fallback == "off":  # (as before the custom loop had one)
        from tfamp.runtime import startup
        startup._custom_loop_fallback = lambda *args: False
    keras.utils.set_random_seed(0)
    # A frozen Dense whose outputs pass float16's 65504 (16 inputs near 1 times 1e4),
    # scaled down after: float32 trains; its float16 forward pass is inf at any scale.
    # "later": from the 17th batch on (inputs 10x larger, weights 1e3).
    steps = 8 if when == "start" else 64
    with strategy.scope():
        inputs = keras.Input((16,))
        frozen = keras.layers.Dense(32, name="frozen", trainable=False)
        hidden = keras.layers.Lambda(lambda t: t * 1e-5, name="shrink")(frozen(inputs))
        if norm:
            hidden = keras.layers.BatchNormalization(name="norm")(hidden)
        model = keras.Model(inputs, keras.layers.Dense(1, name="head")(hidden))
        weight = 1e4 if when == "start" else 1e3
        frozen.set_weights([np.full((16, 32), weight, np.float32), np.zeros(32, np.float32)])
        optimizer = keras.optimizers.SGD(0.01)
    rng = np.random.default_rng(0)
    x = rng.uniform(0.5, 1.0, size=(32 * steps, 16)).astype("float32")
    if when == "later":
        x[32 * 16:] *= 10.0
    y = rng.normal(size=(32 * steps, 1)).astype("float32")

    def train(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    if mirrored:  # the step calls strategy.run on a distributed batch
        @tf.function
        def step(batch):
            return strategy.reduce("MEAN", strategy.run(train, args=batch), axis=None)

        data = strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices((x, y)).batch(32))
        losses = [float(step(batch)) for batch in data]
    else:
        step = tf.function(train)
        losses = [float(step(x[32 * i:32 * (i + 1)], y[32 * i:32 * (i + 1)]))
                  for i in range(steps)]
    from tfamp.runtime import startup
    print(json.dumps({"skipped": int(startup.process_scale_state().skipped_steps.numpy()),
                      "finite": all(math.isfinite(v) for v in losses),
                      "finite_at_end": all(math.isfinite(v) for v in losses[-steps // 4:]),
                      "inference_finite": bool(np.isfinite(
                          model(x[:32], training=False).numpy()).all()),
                      "keep_fp32": list(startup._active.config.keep_fp32)}))
""")


@pytest.mark.parametrize("flavour, feed", [("keras3", "batches"), ("tf_keras", "batches"),
                                           ("keras3", "mirrored")])
def test_a_custom_loop_layer_that_overflows_float16_moves_to_float32(tmp_path, flavour,
                                                                     feed):
    """fit's float32 fallback for a custom loop's step under TFAMP_ENABLE: the start
    scale's check finds the float16 step inf at every scale, the locator names the
    layer at loss scale 1, and the step is rewritten with it float32 before its first
    run. Without it every step was skipped and the loop printed NaN losses. Under
    MirroredStrategy the check does not run (one device only): the watch's early reads
    (after calls 2, 3, 4) find it, so 4 of 8 steps are skipped (before: all 8)."""
    script = tmp_path / "loop.py"
    script.write_text(OVERFLOWING_LAYER_LOOP)
    if flavour == "keras3" and feed == "batches":  # (the fallback's absence shows once)
        off = last_json(run([str(script), flavour, "off", "start"], tmp_path,
                            TFAMP_ENABLE="1"))
        assert off["skipped"] == 8 and not off["finite"], off
    result = run([str(script), flavour, "on", "start", feed], tmp_path, TFAMP_ENABLE="1")
    got = last_json(result)
    skipped = 4 if feed == "mirrored" else 0
    assert got["skipped"] == skipped and got["finite_at_end"], (got, result.stderr[-3000:])
    [pattern] = got["keep_fp32"]
    assert "frozen" in pattern, pattern
    [line] = [s for s in result.stderr.splitlines() if "tfamp: float32 fallback on" in s]
    name = "step" if feed == "mirrored" else "train"  # (the function that trains)
    assert f"custom loop step '{name}'" in line and "gave inf in float16" in line, line
    assert f"TFAMP_KEEP_FP32='{pattern}'" in line, line


STYLE_LOSS_LOOP = textwrap.dedent("""
    import json
    import numpy as np
    import tensorflow as tf
    # keras.io's neural style transfer, reduced: a Gram-matrix loss of conv features
    # (past 65504 in float16), the optimizer on the image variable, which the traced
    # step takes as an argument and whose gradients are applied eagerly.
    tf.keras.utils.set_random_seed(0)
    conv = tf.keras.layers.Conv2D(16, 3, padding="same", activation="relu")
    rng = np.random.default_rng(0)
    reference = tf.constant(rng.uniform(0, 255, (1, 32, 32, 3)).astype("float32"))
    image = tf.Variable(rng.uniform(0, 255, (1, 32, 32, 3)).astype("float32"))

    def gram(x):
        features = tf.reshape(x, (-1, x.shape[-1]))
        return tf.matmul(features, features, transpose_a=True)

    @tf.function
    def compute_loss_and_grads(image, reference):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(gram(conv(image)) - gram(conv(reference)))) * 1e-12
        return loss, tape.gradient(loss, image)

    optimizer = tf.keras.optimizers.SGD(1.0)
    start = image.numpy().copy()
    losses = []
    for _ in range(10):
        loss, grads = compute_loss_and_grads(image, reference)
        optimizer.apply_gradients([(grads, image)])
        losses.append(float(loss))
    print(json.dumps({"losses": losses, "moved": float(np.abs(image.numpy() - start).max())}))
""")


def test_a_step_taking_a_variable_and_overflowing_outside_any_layer_falls_back(tmp_path):
    """Found on keras.io's neural style transfer: its step takes the image variable as an
    argument, and its Gram matrices ('MatMul', 'MatMul_1', in no layer scope) overflow
    float16. The watch saw every step skipped but said "its arguments are not all arrays
    or tensors" and stopped: the loss was NaN for ever and the image never moved. With a
    tensor argument it found 'MatMul' and stopped at 'MatMul_1' ("still computes in
    float16 though keep_fp32 has '^MatMul$'"). Now every call of it moves before the
    first step, and the loop trains as float32 does."""
    script = tmp_path / "style.py"
    script.write_text(STYLE_LOSS_LOOP)
    want = last_json(run([str(script)], tmp_path))
    result = run([str(script)], tmp_path, TFAMP_ENABLE="1")
    got = last_json(result)
    [line] = [s for s in result.stderr.splitlines() if "tfamp: float32 fallback on" in s]
    assert "custom loop step 'compute_loss_and_grads'" in line, line
    assert r"'^(gradient_tape/)?MatMul(_\d+)?(_grad)?(/|$)'" in line, line
    # Before the first step: the start scale's check runs on the step as it is traced,
    # the variable bound to its handle, so no step is skipped.
    np.testing.assert_allclose(got["losses"], want["losses"], rtol=0.01)
    assert got["moved"] > 0.5 * want["moved"], (got, want)


@pytest.mark.parametrize("feed", ["batches", "mirrored", "norm", "fixed"])
def test_a_custom_loop_layer_that_starts_overflowing_later_moves_too(tmp_path, feed):
    """The watch: the skipped-step counter is read after calls 2, 6, 14, 30, ...; the
    read at 30 finds 14 skipped (here from the 17th batch on, the inputs 10x larger),
    which makes the fallback look on that call's batch, a distributed one included (each replica's
    copy of the step checked). The loop's last steps then train, finite, where every
    step from the 17th was skipped (and printed NaN) before. "norm": a BatchNorm after
    the overflow, whose moving statistics the skipped steps' forward passes filled
    with inf/nan; reset to 0 / 1, inference is finite again (NaN without). "fixed": a
    fixed loss scale moves alike and keeps its value (no start scale sought again)."""
    script = tmp_path / "loop.py"
    script.write_text(OVERFLOWING_LAYER_LOOP)
    if feed == "batches":
        off = last_json(run([str(script), "keras3", "off", "later"], tmp_path,
                            TFAMP_ENABLE="1"))
        assert off["skipped"] == 48 and not off["finite_at_end"], off
    if feed == "norm":
        unrepaired = last_json(run([str(script), "keras3", "unrepaired", "later", feed],
                                   tmp_path, TFAMP_ENABLE="1"))
        assert unrepaired["finite_at_end"] and not unrepaired["inference_finite"], unrepaired
    env = {"TFAMP_LOSS_SCALE": "1024"} if feed == "fixed" else {}
    result = run([str(script), "keras3", "on", "later", feed], tmp_path, TFAMP_ENABLE="1",
                 **env)
    got = last_json(result)
    assert got["inference_finite"], (got, result.stderr[-3000:])
    if feed == "fixed":
        assert "fixed loss scale skipped 14 steps" in result.stderr, result.stderr[-3000:]
        assert "and ends at 1024;" in result.stderr
        assert "tfamp: start loss scale" not in result.stderr
    # Calls 17-30 skipped; read at the 30th, moved; 31-64 train.
    assert got["skipped"] == 14 and got["finite_at_end"], (got, result.stderr[-3000:])
    [pattern] = got["keep_fp32"]
    assert "frozen" in pattern, pattern
    assert "tfamp: float32 fallback on custom loop step '" in result.stderr
    assert result.stderr.count("tfamp: start loss scale 2^") == (feed != "fixed") * 2, \
        result.stderr[-3000:]
    assert "most of them before the float32 fallback kept" in result.stderr


def test_the_probe_waits_for_the_step_itself(tmp_path):
    """The step traced ahead (get_concrete_function) and another function run
    first: that one differentiates no loss, and the step's own first run is probed."""
    script = tmp_path / "loop.py"
    script.write_text(CUSTOM_LOOP_SCRIPT)
    result = run([str(script), "keras3", "traced_first"], tmp_path, TFAMP_ENABLE="1")
    assert last_json(result)["skipped"] == 0, result.stderr[-3000:]
    assert "tfamp: start loss scale 2^" in result.stderr
    assert "no start loss scale" not in result.stderr


def test_a_mirrored_custom_loop_is_probed_too(tmp_path):
    """One machine's strategy: the step calls strategy.run on a distributed batch."""
    script = tmp_path / "loop.py"
    script.write_text(CUSTOM_LOOP_SCRIPT)
    auto = run([str(script), "keras3", "mirrored"], tmp_path, TFAMP_ENABLE="1")
    assert last_json(auto)["skipped"] == 0, auto.stderr[-3000:]
    assert "tfamp: start loss scale 2^" in auto.stderr
    fixed = run([str(script), "keras3", "mirrored"], tmp_path, TFAMP_ENABLE="1",
                TFAMP_INITIAL_SCALE="32768")
    assert last_json(fixed)["skipped"] >= 1


def test_a_custom_loop_reading_an_iterator_is_not_probed(tmp_path):
    """A probe would take a batch from the iterator: the loop keeps its data and
    starts at 2**15, and one line says why and what to do."""
    script = tmp_path / "loop.py"
    script.write_text(CUSTOM_LOOP_SCRIPT)
    result = run([str(script), "keras3", "iterator"], tmp_path, TFAMP_ENABLE="1")
    assert last_json(result)["skipped"] >= 1  # started at 2**15
    # Halving from 2^15 (finite losses, the scale above its floor) is no overflow to
    # move: the fallback's watch stays silent (it warned of an iterator it could
    # not search, for skips the scale then fixed).
    assert "float32 fallback" not in result.stderr, result.stderr[-3000:]
    assert "no start loss scale from its gradients: it reads its batches from an " \
           "iterator or a dataset" in result.stderr
    assert "tfamp.calibrate_loss_scale(step, batch)" in result.stderr


@pytest.mark.parametrize("variable, value, expected", [
    ("TFAMP_ENABLE", "maybe", "TFAMP_ENABLE='maybe' is not valid; accepted values: 1/true"),
    ("TFAMP_DTYPE", "float8", "TFAMP_DTYPE='float8' is not valid; accepted values: float16, "
                              "bfloat16"),
    ("TFAMP_LOSS_SCALE", "-3", "TFAMP_LOSS_SCALE='-3' is not valid; accepted values: dynamic"),
    ("TFAMP_ALLOWLIST_ADD", "Matmul", "TFAMP_ALLOWLIST_ADD: 'Matmul' is not a registered "
                                      "TensorFlow op; did you mean 'MatMul'?"),
    ("TFAMP_DENYLIST_ADD", "BiasAdd|Softmax", "op names separated by commas"),
    ("TFAMP_KEEP_FP32", "dense[", "'dense[' is not a regular expression"),
    ("TFAMP_VERBOSITY", "loud", "accepted values: 0/quiet, 1/info, 2/debug"),
    ("TFAMP_ENABEL", "1", "TFAMP_ENABEL is not a tfamp setting; did you mean TFAMP_ENABLE?"),
])
def test_invalid_setting_stops_before_the_script_with_one_line(tmp_path, variable, value,
                                                               expected):
    """Checked at start-up; op-list names (TensorFlow's op registry) when TensorFlow
    is imported, which is where the script would first use them."""
    env = {variable: value}
    if variable != "TFAMP_ENABLE":
        env["TFAMP_ENABLE"] = "1"
    needs_registry = variable == "TFAMP_ALLOWLIST_ADD"
    script = "import tensorflow\nprint('script ran')" if needs_registry else (
        "print('script ran')")
    result = run(["-c", script], tmp_path, **env)
    assert result.returncode == 2
    assert "script ran" not in result.stdout
    errors = [line for line in result.stderr.splitlines() if line.startswith("tfamp:")]
    assert len(errors) == 1 and errors[0].startswith("tfamp: error: ")
    assert expected in errors[0]
    assert "Traceback" not in result.stderr


def test_hook_does_nothing_when_unset(tmp_path):
    code = "import sys; print('tfamp' in sys.modules, 'tensorflow' in sys.modules)"
    for value in (None, "0", "off"):
        env = {} if value is None else {"TFAMP_ENABLE": value}
        result = run(["-X", "importtime", "-c", code], tmp_path, **env)
        assert result.returncode == 0
        assert result.stdout.strip() == "False False"
        assert "tfamp" not in result.stderr  # -X importtime lists every import


def test_eager_only_script_is_told_nothing_was_rewritten(tmp_path):
    script = tmp_path / "eager.py"
    script.write_text("import tensorflow as tf\nprint(float(tf.reduce_sum(tf.ones([2, 2]))))\n")
    result = run(script, tmp_path, TFAMP_ENABLE="1")
    assert result.returncode == 0 and result.stdout.strip() == "4.0"
    assert "traced no tf.function, so nothing was rewritten" in result.stderr


def test_tfamp_run_passes_arguments_and_enables(tmp_path):
    script = tmp_path / "args.py"
    script.write_text(textwrap.dedent("""
        import sys, tensorflow as tf
        f = tf.function(lambda x: tf.matmul(x, x))
        print(sys.argv[1:], f(tf.ones([4, 4])).dtype.name)
    """))
    tfamp_command = Path(sys.executable).parent / "tfamp"
    result = subprocess.run([str(tfamp_command), "run", str(script), "--epochs", "3"],
                            capture_output=True, text=True, timeout=300, cwd=str(tmp_path),
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "['--epochs', '3'] float32"
    assert "-> float16 (MatMul x1)" in result.stderr


def test_hook_line_knows_every_off_word():
    from tfamp.env import FALSE_WORDS

    line = (REPO / "tfamp_startup.pth").read_text()
    assert line.startswith("import os;") and line.count("\n") == 1
    assert all(f'"{word}"' in line for word in FALSE_WORDS)


def test_full_valid_environment_is_parsed():
    from tfamp.env import settings_from_env

    settings = settings_from_env({
        "TFAMP_ENABLE": "Yes", "TFAMP_DTYPE": "bfloat16", "TFAMP_LOSS_SCALE": "1024",
        "TFAMP_ALLOWLIST_REMOVE": "Einsum", "TFAMP_DENYLIST_ADD": "Tanh, Softmax",
        "TFAMP_KEEP_FP32": r"^head/,logits", "TFAMP_VERBOSITY": "debug",
        "TFAMP_REPORT_DIR": "/tmp/reports"})
    assert settings.enabled and settings.verbosity == 2 and settings.loss_scale == 1024.0
    config = settings.config
    assert config.dtype == "bfloat16" and config.keep_fp32 == (r"^head/", "logits")
    assert config.op_lists.list_of("Tanh") == "deny" and config.op_lists.list_of("Einsum") \
        == "unlisted"
    assert settings.report_dir == "/tmp/reports"
    assert settings_from_env({"TFAMP_DTYPE": "bfloat16"}).loss_scale is None


def test_tf_data_functions_are_left_alone(tmp_path):
    script = tmp_path / "pipeline.py"
    script.write_text(textwrap.dedent("""
        import tensorflow as tf
        w = tf.ones([4, 4])
        data = tf.data.Dataset.from_tensors(tf.ones([2, 4])).map(
            lambda x: tf.matmul(x, w, name="pipeline_matmul"))

        @tf.function
        def model_step(x):
            return tf.matmul(x, w, name="model_matmul")

        for x in data:
            print(x.dtype.name, model_step(x).dtype.name)
    """))
    reports = tmp_path / "reports"
    result = run(script, tmp_path, TFAMP_ENABLE="1", TFAMP_REPORT_DIR=str(reports))
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "float32 float32"
    saved = [tfamp.RewriteReport.from_dict(json.loads(p.read_text()))
             for p in sorted(reports.glob("*.json"))]
    names = {n.name for r in saved for n in r.nodes}
    assert "model_matmul" in names and "pipeline_matmul" not in names
    assert [r.function.split("_")[0] for r in saved] == ["model"]


def test_notice_when_nothing_could_be_converted(tmp_path):
    script = tmp_path / "no_matmul.py"
    script.write_text("import tensorflow as tf\n"
                      "f = tf.function(lambda x: tf.reduce_sum(tf.exp(x)))\n"
                      "print(float(f(tf.ones([3]))))\n")
    result = run(script, tmp_path, TFAMP_ENABLE="1")
    assert result.returncode == 0, result.stderr[-2000:]
    assert ("none of the 1 rewritten functions had an op that could run in float16"
            in result.stderr)
    assert "deny list" in result.stderr


def test_tfamp_runtime_sets_the_config_and_refuses_other_words():
    from tfamp.env import EnvError, settings_from_env

    assert settings_from_env({}).config.runtime == "auto"
    assert settings_from_env({"TFAMP_RUNTIME": " XLA "}).config.runtime == "xla"
    assert settings_from_env({"TFAMP_RUNTIME": "executor"}).config.runtime == "executor"
    with pytest.raises(EnvError, match=r"TFAMP_RUNTIME='jit' is not valid; accepted values: "
                                       r"auto .*executor .*xla"):
        settings_from_env({"TFAMP_RUNTIME": "jit"}, with_config=False)


def test_tfamp_device_type_sets_the_config_and_refuses_other_words():
    from tfamp.env import EnvError, settings_from_env

    assert settings_from_env({}).config.device_type == "auto"
    assert settings_from_env({"TFAMP_DEVICE_TYPE": " gpu "}).config.device_type == "GPU"
    assert settings_from_env({"TFAMP_DEVICE_TYPE": "CPU"}).config.device_type == "CPU"
    with pytest.raises(EnvError, match=r"TFAMP_DEVICE_TYPE='tpu' is not valid; accepted "
                                       r"values: auto .*GPU, CPU"):
        settings_from_env({"TFAMP_DEVICE_TYPE": "tpu"}, with_config=False)
