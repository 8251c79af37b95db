"""The mixed-precision graph rewrite: ``rewrite_graph_def(graph_def, config)``
-> ``(GraphDef, report)``.

One module per question: ``graph`` (read-only view of a GraphDef and its library),
``kernels`` (can an op run in 16-bit on a device?), ``coloring`` (which ops go
16-bit and why), ``value_ranges`` (what an op's inputs say about its range:
a softmax's bounded Exp, an Rsqrt that overflows, a mask's sentinel),
``tied_output`` (a tied output layer's products), ``casts`` (the edit),
``check`` (graph lint), ``report`` (what the pass did), ``pipeline`` (the pass
itself, in that order).
"""

from tfamp.rewrite.pipeline import rewrite_graph_def

__all__ = ["rewrite_graph_def"]
