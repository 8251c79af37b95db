"""Training scenarios for tfamp under tf.distribute, one process per run (a command line).

    python tests/scale_scenarios.py STRATEGY FLAVOUR MODE SCENARIO [SCENARIO ...]

STRATEGY: ``single`` (no strategy), ``mirrored`` (MirroredStrategy on two logical CPUs),
``mirrored1`` (MirroredStrategy on one device, as on a machine with one GPU: fit's
iterator is a distributed one) or ``multiworker`` (MultiWorkerMirroredStrategy;
TF_CONFIG from the environment). FLAVOUR: ``tf_keras``, ``tf_keras_legacy`` (compiled
with its legacy Adam, ``keras.optimizers.legacy``) or ``keras3``. MODE: ``enable``
(``tfamp.enable`` after compile), ``env`` (run under ``TFAMP_ENABLE=1``: the script
never imports tfamp) or ``float32`` (no tfamp: the reference).
Prints one line, ``SCENARIO_RESULT {json}``: per scenario, what the tests compare.

Every worker reads its own data (a different seed per worker, its own
dataset, no auto-sharding), and under MirroredStrategy each batch's two
halves (one per replica) differ too:

* ``probe``: inputs of magnitude ~300, whose first kernel's gradients (~50)
  overflow float16 at the old start scale 2^15: the start-scale probe must
  run and pick the scale;
* ``forward``: a frozen Dense whose outputs exceed 65504 on the second half
  of each batch (replica 1; under MultiWorkerMirroredStrategy on worker 1's
  data only): every step overflows in the forward pass, whatever the scale;
* ``backward``: a Dense on inputs of magnitude ~1000 whose kernel gradient
  overflows float16 even at loss scale 1 (the forward pass is finite);
* ``resume`` (with ``--backup DIR``): ``forward`` with BackupAndRestore,
  interrupted at the start of epoch 2 by ``--interrupt``; run again without it
  to resume.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

N, BATCH = 256, 32


def _strategy(kind: str):
    import tensorflow as tf

    if kind == "mirrored":
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    if kind == "mirrored1":
        return tf.distribute.MirroredStrategy(["/cpu:0"])
    if kind == "multiworker":
        return tf.distribute.MultiWorkerMirroredStrategy()
    return tf.distribute.get_strategy()


def _worker() -> int:
    config = os.environ.get("TF_CONFIG")
    return json.loads(config)["task"]["index"] if config else 0


def _dataset(x, y, batch: int = BATCH):
    import tensorflow as tf

    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).with_options(options)


def probe_data(worker: int):
    rng = np.random.default_rng(10 + worker)
    x = (300.0 * rng.normal(size=(N, 16))).astype("float32")
    w = rng.normal(size=(16, 1)).astype("float32")
    y = np.tanh(x @ w / 3000.0).astype("float32")
    return x, y


def overflow_data(worker: int, strategy_kind: str, scale: float = 1000.0):
    """Features in [0, `scale`) where a frozen Dense with stddev-30 weights gives
    ~2e5 (inf in float16), in [0, 1) where it stays finite; the target depends
    on x / scale only."""
    rng = np.random.default_rng(20 + worker)
    x = rng.uniform(0, 1, size=(N, 16)).astype("float32")
    if strategy_kind == "multiworker":
        large = np.full(N, worker == 1)
    else:  # the second half of every batch: replica 1's rows
        large = (np.arange(N) % BATCH) >= BATCH // 2
    x[large] *= scale
    w = rng.normal(size=(16, 1)).astype("float32")
    features = np.where(large[:, None], x / scale, x)
    y = (np.tanh(features @ w / 4) + rng.normal(scale=0.1, size=(N, 1))).astype("float32")
    return x, y


def backward_data(worker: int):
    rng = np.random.default_rng(30 + worker)
    x = rng.uniform(0, 1000, size=(N, 16)).astype("float32")
    y = (200.0 + 10.0 * rng.normal(size=(N, 1))).astype("float32")
    return x, y


def probe_model(k, adam):
    k.utils.set_random_seed(0)
    small = k.initializers.RandomNormal(stddev=1e-3)  # hidden ~1 on inputs ~300
    model = k.Sequential([k.Input((16,)),
                          k.layers.Dense(32, activation="relu", name="hidden",
                                         kernel_initializer=small),
                          k.layers.Dense(1, name="head")], name="probe")
    model.compile(optimizer=adam(1e-3), loss="mse")
    return model


def forward_model(k, adam):
    """A frozen projection (outputs ~2e5 on large inputs) -> x1e-5 -> a small head."""
    k.utils.set_random_seed(0)
    inputs = k.Input((16,))
    frozen = k.layers.Dense(32, name="frozen",
                            kernel_initializer=k.initializers.RandomNormal(stddev=30.0))
    frozen.trainable = False
    h = k.layers.Rescaling(1e-5, name="rescale")(frozen(inputs))
    h = k.layers.Dense(16, activation="relu", name="hidden")(h)
    model = k.Model(inputs, k.layers.Dense(1, name="head")(h), name="pipe")
    model.compile(optimizer=adam(3e-3), loss="mse")
    return model


def backward_model(k, adam):
    """Dense 'wide' on inputs ~1000: its kernel gradient x^T g exceeds 65504 at scale 1."""
    k.utils.set_random_seed(0)
    inputs = k.Input((16,))
    h = k.layers.Dense(8, name="wide",
                       kernel_initializer=k.initializers.RandomNormal(stddev=1e-4))(inputs)
    model = k.Model(inputs, k.layers.Dense(1, name="head", kernel_initializer="ones")(h),
                    name="grad")
    model.compile(optimizer=adam(1e-3), loss="mse")
    return model


def local_values(strategy, variable):
    import tensorflow as tf

    inner = getattr(variable, "_value", None)
    inner = inner if isinstance(inner, tf.Variable) else variable
    return [np.asarray(v) for v in strategy.experimental_local_results(inner)]


def summary(strategy, model, history, x, y) -> dict:
    per_variable = [local_values(strategy, v) for v in model.trainable_variables]
    replicas_identical = all(all(np.array_equal(values[0], v) for v in values[1:])
                             for values in per_variable)
    weights = np.concatenate([values[0].ravel() for values in per_variable])
    state = getattr(model, "_tfamp_state", None)
    start = getattr(state, "start_scale", None)
    moved = list(getattr(getattr(state, "fallback", None), "moved", ()))
    decisions = [d.kind for d in getattr(getattr(state, "fallback", None), "decisions", [])]
    history = {k: [float(v) for v in vals] for k, vals in history.history.items()}
    return {
        "history": history,
        "replicas": strategy.num_replicas_in_sync,
        "replicas_identical": bool(replicas_identical),
        "weights": weights.astype("float64").tolist(),
        "evaluate": float(np.mean((model.predict(x, batch_size=BATCH, verbose=0) - y) ** 2)),
        "start_scale": getattr(start, "scale", None) if start else None,
        "start_max": getattr(start, "max_abs", None) if start else None,
        "start_how": getattr(start, "how", None) if start else None,
        "keep_fp32": list(getattr(getattr(state, "config", None), "keep_fp32", ())),
        "moved": moved,
        "decisions": decisions,
        "optimizer": type(model.optimizer).__module__ + "." + type(model.optimizer).__name__,
    }


def run(strategy_kind: str, flavour: str, mode: str, scenarios: list[str], *,
        backup: str | None, interrupt: bool, epochs: int) -> dict:
    strategy = _strategy(strategy_kind)
    if flavour.startswith("tf_keras"):
        import tf_keras as k
    else:
        import keras as k
    # tf_keras_legacy: compiled with tf_keras's legacy Adam (keras.optimizers.legacy).
    adam = k.optimizers.legacy.Adam if flavour == "tf_keras_legacy" else k.optimizers.Adam
    enable = None
    if mode == "enable":
        import tfamp

        def enable(model):
            tfamp.enable(model, verbose=False)
    worker = _worker()
    builders = {"probe": (probe_model, lambda: probe_data(worker)),
                "forward": (forward_model, lambda: overflow_data(worker, strategy_kind)),
                "resume": (forward_model, lambda: overflow_data(worker, strategy_kind)),
                "backward": (backward_model, lambda: backward_data(worker))}
    out = {"worker": worker}
    for scenario in scenarios:
        build, data = builders[scenario]
        x, y = data()
        with strategy.scope():
            model = build(k, adam)
            if enable is not None:
                enable(model)
        callbacks = []
        if scenario == "resume":
            callbacks.append(k.callbacks.BackupAndRestore(backup))
            if interrupt:
                class Interrupt(k.callbacks.Callback):
                    def on_epoch_begin(self, epoch, logs=None):
                        if epoch == 2:
                            raise RuntimeError("interrupted")

                callbacks.append(Interrupt())
        try:
            history = model.fit(_dataset(x, y), epochs=epochs, verbose=0, callbacks=callbacks)
        except RuntimeError as err:
            if "interrupted" not in str(err):
                raise
            state = getattr(model, "_tfamp_state", None)
            out[scenario] = {"interrupted": True,
                             "moved": list(getattr(state.fallback, "moved", ()))
                             if state is not None else []}
            continue
        out[scenario] = summary(strategy, model, history, x, y)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("strategy", choices=["single", "mirrored", "mirrored1", "multiworker"])
    parser.add_argument("flavour", choices=["tf_keras", "tf_keras_legacy", "keras3"])
    parser.add_argument("mode", choices=["enable", "env", "float32"])
    parser.add_argument("scenarios", nargs="+", choices=["probe", "forward", "backward",
                                                          "resume"])
    parser.add_argument("--backup", default=None)
    parser.add_argument("--interrupt", action="store_true")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)
    result = run(args.strategy, args.flavour, args.mode, args.scenarios, backup=args.backup,
                 interrupt=args.interrupt, epochs=args.epochs)
    print("SCENARIO_RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
