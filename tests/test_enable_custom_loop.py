"""tfamp.enable(model) + the user's own GradientTape loop (issue 11, item 2).

Inside a plain ``@tf.function`` step an enabled model runs as a nested
tfamp-rewritten function (16-bit forward, and so 16-bit backward), the tape
scales the loss, and the optimizer update skips non-finite steps. Both Keras
flavours: tf_keras and Keras 3.
"""

import warnings

import keras as keras3
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

import tfamp
from tfamp.keras import scale_state

FLAVOURS = ["tf_keras", "keras3"]
HALF = tf.float16.as_datatype_enum
STEPS = 25


def make_model(flavour, compiled=True, optimizer="sgd"):
    k = tf_keras if flavour == "tf_keras" else keras3
    k.utils.set_random_seed(0)
    model = k.Sequential([k.Input((8,)), k.layers.Dense(16, activation="relu"),
                          k.layers.Dense(1)])
    opt = k.optimizers.SGD(0.05) if optimizer == "sgd" else k.optimizers.Adam(1e-2)
    if compiled:
        model.compile(optimizer=opt, loss="mse")
    return model, opt


def data():
    x = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")
    return x, x[:, :1] * 0.5


def apply(flavour, optimizer, grads, variables):
    if flavour == "tf_keras":
        optimizer.apply_gradients(zip(grads, variables))
    else:
        optimizer.apply(grads, variables)


def make_step(model, optimizer, flavour, *, wrap=tf.function, scale_by_hand=False):
    @wrap
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
            target = loss
            if scale_by_hand:
                target = (optimizer.get_scaled_loss(loss) if flavour == "tf_keras"
                          else optimizer.scale_loss(loss))
        grads = tape.gradient(target, model.trainable_variables)
        if scale_by_hand and flavour == "tf_keras":
            grads = optimizer.get_unscaled_gradients(grads)
        apply(flavour, optimizer, grads, model.trainable_variables)
        return loss
    return step


def train(flavour, enable, *, which="model", optimizer="sgd", scale_by_hand=False):
    """Returns (model, step, losses, optimizer used) after STEPS custom-loop steps."""
    model, own = make_model(flavour, compiled=which != "separate", optimizer=optimizer)
    if enable:
        tfamp.enable(model, verbose=False)
    used = model.optimizer if which == "model" else own
    step = make_step(model, used, flavour, scale_by_hand=scale_by_hand)
    x, y = data()
    losses = [float(step(x, y)) for _ in range(STEPS)]
    return model, step, losses, used


def matmul_types(concrete):
    """{function name: [T of every MatMul]} over the step's graph and its library."""
    graph_def = concrete.graph.as_graph_def()
    found = {"<step>": [n.attr["T"].type for n in graph_def.node if n.op == "MatMul"]}
    for function in graph_def.library.function:
        found[function.signature.name] = [n.attr["T"].type for n in function.node_def
                                           if n.op == "MatMul"]
    return found


def scale_of(model):
    return float(scale_state.current_scale(model._tfamp_state.scale_owner()))


def record_warnings(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn()
    return result, [w for w in caught if "tfamp" in str(w.message)]


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_plain_tf_function_step_runs_16bit_matmuls_forward_and_backward(flavour):
    (model, step, _, _), caught = record_warnings(lambda: train(flavour, True))
    assert caught == []
    found = matmul_types(step.get_concrete_function(*data()))
    every = [t for types in found.values() for t in types]
    backward = [t for name, types in found.items() if "backward" in name for t in types]
    assert every and all(t == HALF for t in every), found  # no float32 MatMul left
    assert len(backward) >= 3, found  # dW for both layers, dX for the second
    assert all(v.dtype == "float32" for v in model.trainable_variables)
    x, y = data()
    probe = tf.function(lambda: tf.gradients(  # the gradients the step's optimizer gets
        tf.reduce_mean((model(x, training=True) - y) ** 2), model.trainable_variables))
    assert all(g.dtype == tf.float32 for g in probe())


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("which", ["model", "inner", "separate"])
def test_custom_loop_converges_like_float32(flavour, which):
    # "model": model.optimizer (tfamp's loss-scale optimizer); "inner": the
    # optimizer given to compile; "separate": a model never compiled.
    _, _, want, _ = train(flavour, False, which=which)
    model, _, got, _ = train(flavour, True, which=which)
    assert got != want  # 16-bit rounding is visible...
    np.testing.assert_allclose(got, want, rtol=0.02)  # ...and small
    assert got[-1] < 0.3 * got[0]
    assert scale_of(model) == 2.0 ** 15  # nothing overflowed, nothing skipped


def optimizer_state(optimizer):
    # The update's own state (a loss-scale optimizer's inner one; its scale
    # state is checked through scale_of).
    optimizer = getattr(optimizer, "inner_optimizer", optimizer)
    variables = optimizer.variables
    variables = variables() if callable(variables) else variables
    return {v.name if hasattr(v, "name") else str(i): np.array(v.numpy())
            for i, v in enumerate(variables) if "iteration" not in v.name}


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("which", ["model", "inner", "separate"])
def test_overflowing_batch_is_skipped_and_the_scale_halves(flavour, which):
    model, step, _, used = train(flavour, True, which=which, optimizer="adam")
    x, y = data()
    weights = [v.numpy() for v in model.trainable_variables]
    state = optimizer_state(used)
    assert state  # Adam's moments exist
    bad = x.copy()
    bad[0, 0] = 1e6  # float16 overflows in the forward, so the gradients are inf/nan
    step(bad, y)
    assert scale_of(model) == 2.0 ** 14
    for before, variable in zip(weights, model.trainable_variables):
        np.testing.assert_array_equal(before, variable.numpy())
    for name, value in optimizer_state(used).items():
        np.testing.assert_array_equal(state[name], value, err_msg=name)
    step(x, y)  # the next good batch trains again
    assert any(not np.array_equal(b, v.numpy())
               for b, v in zip(weights, model.trainable_variables))
    assert scale_of(model) == 2.0 ** 14


@pytest.mark.parametrize("flavour", FLAVOURS)
@pytest.mark.parametrize("which", ["model", "separate"])
def test_gradients_a_traced_function_returns_are_checked_by_the_eager_update(flavour, which):
    """tensorflow/docs' walkthrough with its grad() traced and the update eager: the
    function's tape is scaled and unscaled, and an eager update with any optimizer but
    tfamp's applied its inf/nan, making every weight NaN for good."""
    model, own = make_model(flavour, compiled=which != "separate", optimizer="adam")
    tfamp.enable(model, verbose=False)
    used = model.optimizer if which == "model" else own

    @tf.function
    def grad(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
        return tape.gradient(loss, model.trainable_variables)

    x, y = data()
    bad = x.copy()
    bad[0, 0] = 1e6  # float16 overflows in the forward, so the gradients are inf/nan
    apply(flavour, used, grad(x, y), model.trainable_variables)
    weights = [v.numpy() for v in model.trainable_variables]
    state = optimizer_state(used)
    apply(flavour, used, grad(bad, y), model.trainable_variables)
    assert scale_of(model) == 2.0 ** 14
    for before, variable in zip(weights, model.trainable_variables, strict=True):
        np.testing.assert_array_equal(before, variable.numpy())
    for name, value in optimizer_state(used).items():
        np.testing.assert_array_equal(state[name], value, err_msg=name)
    apply(flavour, used, grad(x, y), model.trainable_variables)
    assert all(np.isfinite(v.numpy()).all() for v in model.trainable_variables)
    assert any(not np.array_equal(b, v.numpy())
               for b, v in zip(weights, model.trainable_variables, strict=True))


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_loss_scaled_by_hand_is_scaled_once(flavour):
    _, _, want, _ = train(flavour, False)
    model, _, got, optimizer = train(flavour, True, scale_by_hand=True)
    # Scaled twice, the update would be 2**15 times too large (or small): no match.
    np.testing.assert_allclose(got, want, rtol=0.02)
    assert got[-1] < 0.3 * got[0]
    assert float(scale_state.current_scale(optimizer)) == 2.0 ** 15


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_eager_custom_loop_warns_once_and_runs_float32(flavour):
    model, _ = make_model(flavour)
    x, y = data()
    want = float(tf.reduce_mean((model(x) - y) ** 2))
    tfamp.enable(model, verbose=False)

    def eager_steps():
        losses = []
        for _ in range(2):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
            losses.append(float(loss))
            tape.gradient(loss, model.trainable_variables)
        return losses

    losses, caught = record_warnings(eager_steps)
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert "float32" in message and "@tf.function" in message and model.name in message
    assert caught[0].filename == __file__  # points at the user's code
    assert losses[0] == want  # really float32, as it says
    _, caught = record_warnings(lambda: model(x))  # eager inference: no tape, no warning
    assert caught == []


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_model_inside_a_cond_of_the_step_warns_once_and_runs_float32(flavour):
    """Loss scaling cannot follow a call inside tf.cond: float32 there, said once."""
    model, _ = make_model(flavour)
    x, y = data()
    want = float(tf.reduce_mean((model(x) - y) ** 2))
    tfamp.enable(model, verbose=False)

    @tf.function
    def step(x, y, flag):
        with tf.GradientTape() as tape:
            out = tf.cond(flag, lambda: model(x, training=True), lambda: model(x * 2.0))
            loss = tf.reduce_mean((out - y) ** 2)
        tape.gradient(loss, model.trainable_variables)
        return loss

    (first, second), caught = record_warnings(
        lambda: (float(step(x, y, tf.constant(True))), float(step(x, y, tf.constant(True)))))
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert "tf.cond branch" in str(caught[0].message) and model.name in str(caught[0].message)
    assert first == second == pytest.approx(want, rel=1e-6)  # float32, as it says
    concrete = step.get_concrete_function(x, y, tf.constant(True))
    assert all(t != HALF for types in matmul_types(concrete).values() for t in types)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_inference_in_a_plain_tf_function_runs_16bit(flavour):
    model, _ = make_model(flavour)
    x, _ = data()
    want = model(x).numpy()
    tfamp.enable(model, verbose=False)
    predict = tf.function(lambda x: model(x, training=False))
    got = predict(x).numpy()
    found = matmul_types(predict.get_concrete_function(x))
    assert [t for types in found.values() for t in types].count(HALF) >= 2, found
    assert not np.array_equal(got, want)
    np.testing.assert_allclose(got, want, rtol=0.02, atol=0.02)
    assert got.dtype == np.float32  # outputs keep their dtype


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_enabled_model_as_a_layer_of_a_new_functional_model_builds(flavour):
    # Keras traces layers symbolically in scratch graphs: not a step, no nested function.
    k = tf_keras if flavour == "tf_keras" else keras3
    inner, _ = make_model(flavour)
    tfamp.enable(inner, verbose=False)
    inputs = k.Input((8,))
    outer = k.Model(inputs, k.layers.Dense(2)(inner(inputs)))
    x, _ = data()
    assert outer.predict(x, verbose=0).shape == (64, 2)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_disable_restores_the_float32_step(flavour):
    model, _ = make_model(flavour)
    tfamp.enable(model, verbose=False)
    tfamp.disable(model)
    step = make_step(model, model.optimizer, flavour)
    step(*data())
    found = matmul_types(step.get_concrete_function(*data()))
    assert HALF not in [t for types in found.values() for t in types], found
    assert "call" not in model.__dict__


def _gan_generator_update(flavour, tiny, enable):
    """4 steps of a GAN custom loop (tensorflow/docs' dcgan shape: one tape per model,
    the generator's loss computed by the discriminator); the generator's update."""
    k = tf_keras if flavour == "tf_keras" else keras3
    k.utils.set_random_seed(0)
    gen = k.Sequential([k.Input((8,)), k.layers.Dense(16, activation="relu"), k.layers.Dense(4)])
    disc = k.Sequential([k.Input((4,)), k.layers.Dense(16, activation="relu"), k.layers.Dense(1)])
    if enable:
        tfamp.enable(gen, verbose=False)
        tfamp.enable(disc, verbose=False)
    gen_opt, disc_opt = k.optimizers.SGD(0.1 / tiny), k.optimizers.SGD(0.1 / tiny)
    bce = k.losses.BinaryCrossentropy(from_logits=True)

    @tf.function
    def step(noise, real):
        with tf.GradientTape() as gen_tape, tf.GradientTape() as disc_tape:
            real_out = disc(real, training=True)
            fake_out = disc(gen(noise, training=True), training=True)
            gen_loss = bce(tf.ones_like(fake_out), fake_out) * tiny
            disc_loss = (bce(tf.ones_like(real_out), real_out)
                         + bce(tf.zeros_like(fake_out), fake_out)) * tiny
        gen_grads = gen_tape.gradient(gen_loss, gen.trainable_variables)
        disc_grads = disc_tape.gradient(disc_loss, disc.trainable_variables)
        gen_opt.apply_gradients(zip(gen_grads, gen.trainable_variables, strict=True))
        disc_opt.apply_gradients(zip(disc_grads, disc.trainable_variables, strict=True))

    rng = np.random.RandomState(0)
    before = np.concatenate([v.numpy().ravel() for v in gen.trainable_variables])
    for _ in range(4):
        step(rng.randn(16, 8).astype("float32"), rng.randn(16, 4).astype("float32"))
    return np.concatenate([v.numpy().ravel() for v in gen.trainable_variables]) - before


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_gans_generator_loss_through_the_discriminator_is_scaled(flavour):
    # The generator's loss reaches it only through the discriminator's rewritten
    # call: the tape took the nearest model (the discriminator, whose variables it
    # does not differentiate) and left the generator's gradient unscaled. With the
    # loss x1e-6 its float16 backward flushed to zero: the generator did not move.
    reference = _gan_generator_update(flavour, 1e-6, enable=False)
    update = _gan_generator_update(flavour, 1e-6, enable=True)
    cosine = update @ reference / (np.linalg.norm(update) * np.linalg.norm(reference) + 1e-30)
    assert cosine > 0.99, cosine
    assert 0.9 < np.linalg.norm(update) / np.linalg.norm(reference) < 1.1


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_loop_whose_steps_are_skipped_hears_it_at_exit(flavour, caplog):
    """An enabled model's custom loop has no History and no per-call hook: every step
    skipped (a forward overflow, here inputs of 1e6) printed NaN losses and tfamp said
    nothing. At exit (``tell_skips``, registered when the loop first scaled) one line
    counts the skips and, at the floor, names the fix."""
    from tfamp.keras import custom_loop

    model, used = make_model(flavour, optimizer="sgd")
    tfamp.enable(model, verbose=False)
    step = make_step(model, used, flavour)
    x, y = data()
    step(x, y)  # a good step: nothing to say about it
    loop = model._tfamp_state.loop
    with caplog.at_level("INFO", logger="tfamp"):
        custom_loop.tell_skips(lambda: loop)
    assert "its loss scale skipped" not in caplog.text
    bad = x.copy()
    bad[:, 0] = 1e6
    for _ in range(16):  # 2^15 halves to its floor, 1, and stays there
        step(bad, y)
    with caplog.at_level("INFO", logger="tfamp"):
        custom_loop.tell_skips(lambda: loop)
    assert "its loss scale skipped 16 steps" in caplog.text, caplog.text
    assert "ends at 1. It ends at its floor" in caplog.text and "keep_fp32" in caplog.text
    assert "calibrate_loss_scale(step, x_batch, y_batch, model=model)" in caplog.text


def overflowing_model(k, name="pipe"):
    """A frozen Dense whose float16 outputs pass 65504 (16 inputs near 1 times 1e4),
    scaled down after: float32 trains, the float16 forward pass is inf at any scale."""
    k.utils.set_random_seed(0)
    inputs = k.Input((16,))
    frozen = k.layers.Dense(32, name="frozen", trainable=False)
    hidden = k.layers.Lambda(lambda t: t * 1e-5, name="shrink")(frozen(inputs))
    model = k.Model(inputs, k.layers.Dense(1, name="head")(hidden), name=name)
    frozen.set_weights([np.full((16, 32), 1e4, np.float32), np.zeros(32, np.float32)])
    model.compile(optimizer=k.optimizers.SGD(0.01), loss="mse")
    return model


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_calibrate_keeps_a_layer_that_overflows_float16_float32_before_the_loop(flavour,
                                                                                caplog):
    """An enabled model's custom loop has no per-call hook, so no fallback once it runs:
    every step was skipped and the loop printed NaN. ``calibrate_loss_scale`` checks
    the start scale on the step with the model's call 16-bit; overflowing at every
    scale, it finds the layer at loss scale 1 and keeps it float32 before the step is
    traced, as fit's fallback would. The pattern it names (the layer's scope in a
    trace of the step) must also match the layer in the model's rewritten call: that
    call runs in the model's name scope, as Keras's own steps call it."""
    k = tf_keras if flavour == "tf_keras" else keras3
    rng = np.random.default_rng(0)
    x = rng.uniform(0.5, 1.0, size=(32, 16)).astype("float32")
    y = rng.normal(size=(32, 1)).astype("float32")

    def run(enable: bool, calibrate: bool):
        model = overflowing_model(k)
        if enable:
            tfamp.enable(model, verbose=False)
        step = make_step(model, model.optimizer, flavour)
        if calibrate:
            tfamp.calibrate_loss_scale(step, x, y, model=model)
        losses = [float(step(x, y)) for _ in range(4)]
        return model, step, losses

    _, _, want = run(False, False)
    if flavour == "keras3":  # (without it: every step skipped, the loss inf)
        model, _, losses = run(True, False)
        assert not np.isfinite(losses).any(), losses
        assert int(model._tfamp_state.scale_owner().skipped_steps.numpy()) == 4
    with caplog.at_level("INFO", logger="tfamp"):
        model, step, got = run(True, True)
    [line] = [s for s in caplog.messages if "float32 fallback on model 'pipe'" in s]
    assert "gave inf in float16" in line, line
    [pattern] = model._tfamp_state.config.keep_fp32
    assert "frozen" in pattern, pattern
    assert int(model._tfamp_state.scale_owner().skipped_steps.numpy()) == 0
    np.testing.assert_allclose(got, want, rtol=1e-2)
    found = matmul_types(step.get_concrete_function(x, y))
    [forward] = [types for name, types in found.items()
                 if name.startswith("__inference_pipe_call")]
    assert sorted(forward) == sorted([tf.float32.as_datatype_enum, HALF]), found


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_model_whose_name_is_no_root_scope_runs_in_the_users_scope(flavour):
    """The rewritten call enters the model's name scope in a graph of its own, where
    TensorFlow takes only a root scope name; Keras takes "_pipe" inside the user's
    ``tf.name_scope``. Such a name runs without the scope, as float32 does."""
    k = tf_keras if flavour == "tf_keras" else keras3
    k.utils.set_random_seed(0)
    inputs = k.Input((8,))
    model = k.Model(inputs, k.layers.Dense(1, name="head")(inputs), name="_pipe")
    model.compile(optimizer=k.optimizers.SGD(0.05), loss="mse")
    tfamp.enable(model, verbose=False)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape, tf.name_scope("outer"):
            loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
        grads = tape.gradient(loss, model.trainable_variables)
        apply(flavour, model.optimizer, grads, model.trainable_variables)
        return loss

    x, y = data()
    losses = [float(step(x, y)) for _ in range(3)]
    assert losses[-1] < losses[0], losses
    found = matmul_types(step.get_concrete_function(x, y))
    assert [HALF] in found.values(), found  # (the call ran rewritten)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_calibrate_moves_only_the_models_own_layers(flavour, caplog):
    """Two enabled models in one step, named "sequential" and "sequential_1" (Keras's
    own names for a GAN's generator and discriminator), the second overflowing. The
    scope pattern for "sequential" also matches tf_keras's "sequential_1", so the first
    model's check sees the overflow: nothing of the second model's moves into the first's
    config (one line says whose layer it is); calibrating the second moves it there,
    and the loop trains with no step skipped."""
    k = tf_keras if flavour == "tf_keras" else keras3
    rng = np.random.default_rng(0)
    x = rng.uniform(0.5, 1.0, size=(32, 16)).astype("float32")
    y = rng.normal(size=(32, 1)).astype("float32")
    k.utils.set_random_seed(0)
    first = k.Sequential([k.Input((16,)), k.layers.Dense(1, name="plain_head")],
                         name="sequential")
    first.compile(optimizer=k.optimizers.SGD(0.01), loss="mse")
    second = overflowing_model(k, name="sequential_1")
    tfamp.enable(first, verbose=False)
    tfamp.enable(second, verbose=False)

    @tf.function
    def step(x, y):
        with tf.GradientTape(persistent=True) as tape:
            first_loss = tf.reduce_mean((first(x, training=True) - y) ** 2)
            second_loss = tf.reduce_mean((second(x, training=True) - y) ** 2)
        for model, loss in ((first, first_loss), (second, second_loss)):
            grads = tape.gradient(loss, model.trainable_variables)
            apply(flavour, model.optimizer, grads, model.trainable_variables)
        return first_loss + second_loss

    with caplog.at_level("INFO", logger="tfamp"):
        tfamp.calibrate_loss_scale(step, x, y, model=first)
        tfamp.calibrate_loss_scale(step, x, y, model=second)
    assert first._tfamp_state.config.keep_fp32 == (), caplog.text
    lines = [m for m in caplog.messages if "model 'sequential':" in m]
    if flavour == "tf_keras":  # (Keras 3 scopes the second model "sequential_1_2" here)
        assert "which is not one of this model's: nothing moved" in lines[0], lines
    assert any("frozen" in p for p in second._tfamp_state.config.keep_fp32), caplog.text
    losses = [float(step(x, y)) for _ in range(3)]
    assert np.isfinite(losses).all(), losses
    for model in (first, second):
        assert int(model._tfamp_state.scale_owner().skipped_steps.numpy()) == 0
