"""What collecting value ranges costs: one step of the demo model with and without it.

The step is the demo's float16 training step (``tfamp.demo``: small CNN,
batch 32, Adam in tfamp's LossScaleOptimizer, run through ``tfamp.function``).
Collecting is ``KerasRangeProbe.collect`` on the same batch: a separate
float32 forward and backward pass with every layer output, activation
gradient and weight gradient bucketed on the device, plus the snapshot and
restore of the BatchNorm statistics. Reported: median wall time of each over
--repeat calls after warm-up, and the ratio (step + collect) / step, i.e. the
cost of a step on which ranges are collected relative to a normal step
(target: about 2x or less). With collection off the step is the very same
function, so it costs nothing (no hook runs).

    python benchmarks/ranges_cost.py              # ~20 s on 2 cores
    python benchmarks/ranges_cost.py --repeat 50 --batch 64
"""

from __future__ import annotations

import argparse
import statistics
import time

import _common  # noqa: F401  (TensorFlow start-up, sys.path)
import tensorflow as tf
import tf_keras as keras

from tfamp import demo
from tfamp.config import AmpConfig
from tfamp.keras.optimizer_tf_keras import LossScaleOptimizer
from tfamp.keras.range_probe import KerasRangeProbe
from tfamp.runtime.runner import function as amp_function


def median_seconds(fn, repeat: int) -> float:
    for _ in range(3):  # warm-up (tracing, rewrite)
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()

    keras.utils.set_random_seed(0)
    model = demo.build_model(4)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer = LossScaleOptimizer(keras.optimizers.Adam(2e-3))
    model.compile(optimizer=optimizer, loss=loss_fn)  # the probe uses the compiled loss
    images, labels = demo.synthetic_data(args.batch, 4)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        optimizer.minimize(loss, model.trainable_variables, tape=tape)
        return loss

    train = amp_function(step, config=AmpConfig(dtype="float16"))
    probe = KerasRangeProbe(model)

    step_s = median_seconds(lambda: float(train(images, labels)), args.repeat)
    collect_s = median_seconds(lambda: probe.collect(images, labels), args.repeat)
    tensors = len(probe.collect(images, labels))
    ratio = (step_s + collect_s) / step_s
    print(f"demo model, batch {args.batch}, median of {args.repeat}:")
    print(f"  float16 training step:               {1000 * step_s:8.2f} ms")
    print(f"  range collection ({tensors} tensors):     {1000 * collect_s:8.2f} ms")
    print(f"  step with collection / normal step:  {ratio:8.2f}x   (target <= ~2x)")


if __name__ == "__main__":
    main()
