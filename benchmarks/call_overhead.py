"""What calling a rewritten function costs on top of a plain tf.function.

The same small step (a 4x4 MatMul, a bias, a ReLU) as ``tf.function`` and as
``tfamp.function``, called in a loop; the two take turns (``--rounds``), and each
round's time per call is the best of ``--repeat`` loops of ``--calls`` calls, so
a change of the machine's speed lands on both. Prints microseconds per call and
the difference.

    python benchmarks/call_overhead.py [--calls 3000] [--repeat 5] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

import tfamp  # noqa: E402


def step(x, w, b):
    return tf.nn.relu(tf.matmul(x, w) + b)


def per_call_us(fn, args, calls: int, repeat: int) -> float:
    fn(*args)  # trace (and rewrite) outside the timing
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    x, w, b = tf.ones([4, 4]), tf.Variable(tf.ones([4, 4])), tf.Variable(tf.zeros([4]))
    plain = tf.function(step)
    rewritten = tfamp.function(step)
    plain_us, tfamp_us = [], []
    for _ in range(args.rounds):
        plain_us.append(per_call_us(plain, (x, w, b), args.calls, args.repeat))
        tfamp_us.append(per_call_us(rewritten, (x, w, b), args.calls, args.repeat))
    p, t = min(plain_us), min(tfamp_us)
    for label, best, rounds in (("tf.function", p, plain_us), ("tfamp.function", t, tfamp_us)):
        listed = ", ".join(f"{v:.1f}" for v in rounds)
        print(f"{label:<15} {best:8.1f} us per call (rounds: {listed})")
    print(f"overhead        {t - p:8.1f} us per call ({t / p:.3f}x)")


if __name__ == "__main__":
    main()
