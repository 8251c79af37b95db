"""tfamp: automatic mixed precision for TensorFlow and Keras by graph rewrite.

The public API; everything else is an implementation module.
"""

from tfamp.check import GraphCheckError, check_graph_def
from tfamp.config import AmpConfig
from tfamp.oplists import DEFAULT_OP_LISTS, OpLists
from tfamp.report import RewriteReport
from tfamp.rewrite import rewrite_graph_def
from tfamp.runner import function, rewrite_concrete_function, rewrite_function

__version__ = "0.1.0"

__all__ = [
    "AmpConfig",
    "DEFAULT_OP_LISTS",
    "GraphCheckError",
    "OpLists",
    "RewriteReport",
    "check_graph_def",
    "function",
    "rewrite_concrete_function",
    "rewrite_function",
    "rewrite_graph_def",
]
