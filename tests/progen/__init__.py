"""A program generator for the rewrite: random training steps, their invariants, a shrinker.

``grammar`` (what a program is made of and how one is drawn from a seed),
``source`` (a program as a standalone Python file), ``noise`` (a float32 run
with rounding noise: how much 16-bit rounding may move each output),
``invariants`` (what every rewrite of every program must satisfy), ``shrink``
(delta debugging of a failing program), ``longrun`` (many programs in worker
processes), ``regressions/`` (shrunk failures, each a test). Long mode:
``python -m tests.progen --count 1000 --seed 1``.
"""
