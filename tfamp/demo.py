"""The demo: a small CNN on synthetic data, what tfamp changed, fp32 vs 16-bit loss.

Run with ``tfamp demo`` (or ``python -m tfamp demo``). Everything is embedded:
the model, the data (seeded), and the comparison.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import tensorflow as tf
import tf_keras as keras

from tfamp.config import AmpConfig
from tfamp.keras.optimizer_tf_keras import LossScaleOptimizer
from tfamp.rewrite.report import RewriteReport
from tfamp.runtime.runner import function as amp_function

RANGES_DIR = "tfamp_demo_out/ranges"


@dataclasses.dataclass
class TrainResult:
    label: str
    losses: list[float]
    seconds: float
    report: RewriteReport | None
    loss_scale: str = "none"
    model: keras.Model | None = None
    optimizer: keras.optimizers.Optimizer | None = None


def build_model(num_classes: int) -> keras.Model:
    """A small CNN: Conv2D + BatchNorm blocks, then Dense layers and softmax."""
    layers = keras.layers
    return keras.Sequential([
        layers.Conv2D(16, 3, padding="same", input_shape=(16, 16, 3)),
        layers.BatchNormalization(),
        layers.ReLU(),
        layers.MaxPooling2D(),
        layers.Conv2D(32, 3, padding="same"),
        layers.BatchNormalization(),
        layers.ReLU(),
        layers.GlobalAveragePooling2D(),
        layers.Dense(64, activation="relu"),
        layers.Dense(num_classes),
    ])


def synthetic_data(samples: int, num_classes: int, seed: int = 0):
    """Images whose class is set by which colour channel dominates a patch."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, num_classes, size=samples)
    images = rng.normal(0.0, 1.0, size=(samples, 16, 16, 3)).astype("float32")
    for i, label in enumerate(labels):
        row, col = divmod(int(label), 2)
        images[i, row * 8:(row + 1) * 8, col * 8:(col + 1) * 8, :] += 1.5
    return tf.constant(images), tf.constant(labels.astype("int64"))


def train(label: str, config: AmpConfig | None, steps: int, batch: int, seed: int) -> TrainResult:
    keras.utils.set_random_seed(seed)
    num_classes = 4
    model = build_model(num_classes)
    images, labels = synthetic_data(steps * batch, num_classes, seed)
    optimizer = keras.optimizers.Adam(2e-3)
    if config is not None and config.dtype == "float16":
        # float16 gradients can underflow: scale the loss (dynamic, from 2**15).
        optimizer = LossScaleOptimizer(optimizer)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        optimizer.minimize(loss, model.trainable_variables, tape=tape)
        return loss

    fn = tf.function(step) if config is None else amp_function(step, config=config, check=True)
    losses = []
    start = time.perf_counter()
    for i in range(steps):
        x, y = images[i * batch:(i + 1) * batch], labels[i * batch:(i + 1) * batch]
        losses.append(float(fn(x, y)))
    seconds = time.perf_counter() - start
    report = None if config is None else fn.reports[0]
    assert all(v.dtype == tf.float32 for v in model.variables), "master weights changed dtype"
    scale = "none"
    if isinstance(optimizer, LossScaleOptimizer):
        scale = (f"dynamic, now {float(optimizer.loss_scale):g} after "
                 f"{int(optimizer.skipped_steps.numpy())} skipped step(s)")
    return TrainResult(label, losses, seconds, report, scale, model, optimizer)


def describe_rewrite(report: RewriteReport, out) -> None:
    print(f"\nWhat tfamp did to the training step ({report.dtype}):", file=out)
    print(f"  nodes: {report.nodes_before} -> {report.nodes_after} "
          f"({report.casts_inserted} Cast nodes inserted at region boundaries)", file=out)
    converted = ", ".join(f"{op} x{n}" for op, n in report.converted.items())
    print(f"  now {report.dtype}: {converted}", file=out)
    if report.traffic_before_bytes and report.traffic_after_bytes:
        print(f"  estimated float memory traffic per step: "
              f"{_megabytes(report.traffic_before_bytes)} -> "
              f"{_megabytes(report.traffic_after_bytes)} "
              f"({100 * report.traffic_after_bytes / report.traffic_before_bytes:.0f}%)",
              file=out)
    kept = ", ".join(f"{kind}: {n}" for kind, n in report.kept_fp32.items())
    print(f"  listed ops kept float32, by reason: {kept}", file=out)
    print("  a few decisions:", file=out)
    shown: set[str] = set()
    for entry in report.nodes:
        key = (entry.op, entry.converted)
        wanted = entry.op in ("Conv2D", "MatMul", "FusedBatchNormV3", "Relu",
                              "SparseSoftmaxCrossEntropyWithLogits", "ReadVariableOp",
                              "Mean", "Conv2DBackpropFilter", "ResourceApplyAdam")
        if wanted and entry.op not in shown and not entry.function:
            shown.add(key[0])
            mark = report.dtype if entry.converted else "float32"
            print(f"    {entry.op:<36} {mark:<9} {entry.reason}", file=out)


def _megabytes(count: int) -> str:
    return f"{count / 1e6:.1f} MB"


def show_ranges(result: TrainResult, seed: int, out, folder: str = RANGES_DIR) -> None:
    """Where the trained float16 model's gradients sit against float16's limits."""
    from tfamp.keras.range_probe import collect_keras_ranges
    from tfamp.numerics.monitor import write_outputs

    model = result.model
    model.compile(optimizer=result.optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    images, labels = synthetic_data(3 * 32, 4, seed + 1)
    batches = [(images[i * 32:(i + 1) * 32], labels[i * 32:(i + 1) * 32]) for i in range(3)]
    report = collect_keras_ranges(model, batches, steps=3)
    written = write_outputs(report, folder)
    print("\nWhere the float16 run's numbers sit against float16's limits (3 batches):",
          file=out)
    for line in report.summary_text().splitlines():
        if line.strip().startswith(("recommendation:", "loss scale while")):
            print(f"  {line.strip()}", file=out)
    print(f"  the picture: {written.get('png', written['html'])} (and {written['html']}; "
          f"for your own model: tfamp.enable(model, ranges=True) or TFAMP_RANGES=1)",
          file=out)


def main(steps: int = 60, batch: int = 32, seed: int = 0, out=None) -> int:
    import sys

    out = out or sys.stdout
    print(f"tfamp demo: a small CNN (Conv2D+BatchNorm, Dense) on synthetic 16x16 images, "
          f"{steps} Adam steps of batch {batch}", file=out)
    runs = [train("float32", None, steps, batch, seed),
            train("float16", AmpConfig(dtype="float16"), steps, batch, seed),
            train("bfloat16", AmpConfig(dtype="bfloat16"), steps, batch, seed)]
    describe_rewrite(runs[1].report, out)
    print("\nTraining loss, same seed and data:", file=out)
    print(f"  {'step':>5}  " + "  ".join(f"{r.label:>9}" for r in runs), file=out)
    marks = sorted({0, *range(9, steps, max(1, steps // 6)), steps - 1})
    for i in marks:
        print(f"  {i + 1:>5}  " + "  ".join(f"{r.losses[i]:>9.4f}" for r in runs), file=out)
    base = np.mean(runs[0].losses[-10:])
    for r in runs[1:]:
        last = np.mean(r.losses[-10:])
        print(f"  mean of last 10 steps: {r.label} {last:.4f} vs float32 {base:.4f} "
              f"({100 * (last - base) / base:+.1f}%)", file=out)
    print("\nWall time here: " + ", ".join(f"{r.label} {r.seconds:.1f}s" for r in runs)
          + ". This machine has no 16-bit hardware, so 16-bit steps are not faster here;"
          " on a GPU with tensor cores the converted ops are the fast ones.", file=out)
    for r in runs[1:]:
        print(f"  loss scaling in the {r.label} run: {r.loss_scale}", file=out)
    print("All model variables stayed float32 (master weights).", file=out)
    show_ranges(runs[1], seed, out)
    return 0
