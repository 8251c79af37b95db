"""tfamp: automatic mixed precision for TensorFlow and Keras by graph rewrite.

The public API. Names resolve lazily (PEP 562) so that ``import tfamp`` alone,
the command line's start-up and the interpreter start-up hook do not import
TensorFlow until something actually needs it.
"""

from __future__ import annotations

# typing.TYPE_CHECKING without importing typing: the start-up hook imports this
# package in every process with a TFAMP_* variable set.
TYPE_CHECKING = False

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "AmpConfig": "tfamp.config",
    "DEFAULT_OP_LISTS": "tfamp.oplists",
    "GraphCheckError": "tfamp.rewrite.check",
    "OpLists": "tfamp.oplists",
    "RangeMonitor": "tfamp.keras.range_monitor",
    "RewriteReport": "tfamp.rewrite.report",
    "LossScaleOptimizer": "tfamp.keras.optimizer_tf_keras",
    "calibrate_loss_scale": "tfamp.keras.calibrate",
    "check_graph_def": "tfamp.rewrite.check",
    "disable": "tfamp.keras.activation",
    "enable": "tfamp.keras.activation",
    "export": "tfamp.serving.api",
    "function": "tfamp.runtime.runner",
    "rewrite_concrete_function": "tfamp.runtime.runner",
    "rewrite_function": "tfamp.runtime.runner",
    "rewrite_graph_def": "tfamp.rewrite.pipeline",
}

__all__ = [
    "AmpConfig",
    "DEFAULT_OP_LISTS",
    "GraphCheckError",
    "LossScaleOptimizer",
    "OpLists",
    "RangeMonitor",
    "RewriteReport",
    "calibrate_loss_scale",
    "check_graph_def",
    "disable",
    "enable",
    "export",
    "function",
    "rewrite_concrete_function",
    "rewrite_function",
    "rewrite_graph_def",
]

if TYPE_CHECKING:
    from tfamp.config import AmpConfig
    from tfamp.keras.activation import disable, enable
    from tfamp.keras.calibrate import calibrate_loss_scale
    from tfamp.keras.optimizer_tf_keras import LossScaleOptimizer
    from tfamp.keras.range_monitor import RangeMonitor
    from tfamp.oplists import DEFAULT_OP_LISTS, OpLists
    from tfamp.rewrite.check import GraphCheckError, check_graph_def
    from tfamp.rewrite.pipeline import rewrite_graph_def
    from tfamp.rewrite.report import RewriteReport
    from tfamp.runtime.runner import function, rewrite_concrete_function, rewrite_function
    from tfamp.serving.api import export


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tfamp' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
