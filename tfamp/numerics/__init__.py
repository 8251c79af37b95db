"""Where numbers sit against 16-bit limits, on graphs (Keras models: ``tfamp.keras``).

``ranges`` (log2 buckets, ``TensorRange``), ``range_report`` (a run's
``RangeReport``), ``advice`` (the one loss-scale recommendation),
``graph_probe`` (traced inference graphs), ``monitor`` (a report's files and
TensorBoard histograms), ``plot`` (PNG and HTML of a range report),
``nonfinite`` (the first op of a traced step that produced an inf or nan),
``run_graph`` (running a rewritten GraphDef on live variables).
"""
