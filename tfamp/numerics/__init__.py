"""Where a model's numbers sit against 16-bit limits.

``ranges`` (log2 buckets and the range report), ``keras_probe`` (a Keras
model's activations and gradients for one batch), ``graph_probe`` (traced
graphs and saved files), ``monitor`` (``tfamp.RangeMonitor`` and its files),
``plot`` (PNG and HTML of a range report), ``nonfinite`` (the first op that
produced an inf or nan), ``run_graph`` (running a rewritten GraphDef on live
variables).
"""
