"""AmpConfig: what a rewrite should do (target dtype, op-list changes, overrides).

A frozen value, validated when built, so a bad setting fails before any graph
is touched. Environment variables are read elsewhere (activation); this module
never looks at ``os.environ``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import warnings
from collections.abc import Iterable

from tensorflow.core.framework import op_def_pb2, types_pb2
from tensorflow.python.client import pywrap_tf_session
from tensorflow.python.framework import op_def_registry

from tfamp.choices import RUNTIME_WORDS
from tfamp.oplists import DATA_BOUND_OPS, DEFAULT_OP_LISTS, LIST_NAMES, OpLists

# Target name -> DataType enum. Accepts tf.DType too (by its .name).
TARGET_DTYPES = {"float16": types_pb2.DT_HALF, "bfloat16": types_pb2.DT_BFLOAT16}
DEVICE_TYPES = ("auto", "CPU", "GPU")
# What a rewritten step runs on (see tfamp.rewrite.runtime_cost).
RUNTIMES = RUNTIME_WORDS

_CHANGE_FIELDS = tuple(f"{n}_{verb}" for n in LIST_NAMES for verb in ("add", "remove"))


@dataclasses.dataclass(frozen=True)
class AmpConfig:
    """Settings for one mixed-precision rewrite.

    Args:
      dtype: the 16-bit type the allowed region computes in: "float16"
        (default) or "bfloat16" (a ``tf.DType`` works too).
      allow_add, allow_remove, infer_add, infer_remove, deny_add, deny_remove,
        clear_add, clear_remove: op names added to or removed from the default
        lists for `dtype` (see ``tfamp.oplists``). Each is a sequence of
        registered TensorFlow op names.
      keep_fp32: regular expressions; a node whose name matches any of them
        (``re.search``) stays float32.
      device_type: "CPU", "GPU" or "auto" (default: GPU if TensorFlow sees
        one, else CPU): the device whose registered kernels decide whether an
        op can run in 16-bit at all.
      runtime: what the rewritten step runs on, which decides what a Cast
        costs (``tfamp.rewrite.runtime_cost``): "executor" (TensorFlow's:
        every op a kernel, so a Cast costs its bytes and a launch), "xla"
        (``jit_compile``: a Cast next to an element-wise op fuses away) or
        "auto" (default: "xla" for a function compiled with XLA, else
        "executor"). The report gives the estimate for both either way.

    Example:
      >>> config = AmpConfig(dtype="bfloat16", deny_add=["Tanh"])
      >>> config.op_lists.list_of("Tanh")
      'deny'
    """

    dtype: str = "float16"
    allow_add: tuple[str, ...] = ()
    allow_remove: tuple[str, ...] = ()
    infer_add: tuple[str, ...] = ()
    infer_remove: tuple[str, ...] = ()
    deny_add: tuple[str, ...] = ()
    deny_remove: tuple[str, ...] = ()
    clear_add: tuple[str, ...] = ()
    clear_remove: tuple[str, ...] = ()
    keep_fp32: tuple[str, ...] = ()
    device_type: str = "auto"
    runtime: str = "auto"

    def __post_init__(self) -> None:
        set_field = functools.partial(object.__setattr__, self)
        set_field("dtype", _normalize_dtype(self.dtype))
        for name in _CHANGE_FIELDS:
            ops = _as_tuple(getattr(self, name), name)
            _check_op_names(ops, name)
            _warn_data_bound(ops, name)
            set_field(name, ops)
        patterns = _as_tuple(self.keep_fp32, "keep_fp32")
        for pattern in patterns:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(
                    f"keep_fp32 expects regular expressions; {pattern!r} is "
                    f"not one ({err}). Escape special characters, e.g. "
                    f"{re.escape(pattern)!r}.") from err
        set_field("keep_fp32", patterns)
        if self.device_type not in DEVICE_TYPES:
            raise ValueError(
                f"device_type must be one of {list(DEVICE_TYPES)}, received "
                f"{self.device_type!r}.")
        if self.runtime not in RUNTIMES:
            raise ValueError(
                f"runtime must be one of {list(RUNTIMES)}, received {self.runtime!r}: "
                f"'xla' for a step compiled with jit_compile, 'executor' for "
                f"TensorFlow's own, 'auto' to follow the function.")
        # Building the lists now surfaces conflicts (an op on two lists) here.
        set_field("_op_lists", DEFAULT_OP_LISTS[self.dtype].with_changes(
            **{name: getattr(self, name) for name in _CHANGE_FIELDS}))

    @property
    def op_lists(self) -> OpLists:
        """The default lists for `dtype` with this config's changes applied."""
        return self._op_lists  # set in __post_init__

    @property
    def target_enum(self) -> int:
        """The DataType enum of `dtype` (types_pb2.DT_HALF or DT_BFLOAT16)."""
        return TARGET_DTYPES[self.dtype]

    def replace(self, **changes) -> AmpConfig:
        """Returns a copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def _normalize_dtype(dtype) -> str:
    name = getattr(dtype, "name", dtype)
    if name not in TARGET_DTYPES:
        raise ValueError(
            f"dtype must be one of {list(TARGET_DTYPES)}, received {dtype!r}. "
            f"float16 needs loss scaling; bfloat16 keeps float32's range.")
    return name


def _as_tuple(value: Iterable[str], field: str) -> tuple[str, ...]:
    if isinstance(value, str):
        raise TypeError(
            f"{field} expects a sequence of strings, received the string "
            f"{value!r}; pass ({value!r},) or a list.")
    values = tuple(value)
    for item in values:
        if not isinstance(item, str) or not item:
            raise TypeError(f"{field} expects non-empty strings, received {item!r}.")
    return values


def _check_op_names(ops: tuple[str, ...], field: str) -> None:
    for op in ops:
        if op_def_registry.get(op) is None:
            hint = difflib.get_close_matches(op, _registered_op_names(), n=1)
            fix = f"did you mean {hint[0]!r}?" if hint else (
                "check the spelling (op names are CamelCase, e.g. 'MatMul').")
            raise ValueError(
                f"{field}: {op!r} is not a registered TensorFlow op; {fix}")


def _warn_data_bound(ops: tuple[str, ...], field: str) -> None:
    """Warns that adding an op whose dtype is bound to its data changes nothing."""
    if field.endswith("_remove") or field.startswith("deny"):
        return  # keeping an op float32 is always allowed
    for op in ops:
        if op in DATA_BOUND_OPS:
            warnings.warn(
                f"{field}: {op!r} is ignored: its dtype is bound to its data "
                f"({DATA_BOUND_OPS[op]}), so tfamp leaves {op} nodes as they are "
                f"whatever the lists say. Remove it from {field}.",
                UserWarning, stacklevel=4)


@functools.cache
def _registered_op_names() -> tuple[str, ...]:
    buffer = pywrap_tf_session.TF_GetAllOpList()
    try:
        op_list = op_def_pb2.OpList.FromString(pywrap_tf_session.TF_GetBuffer(buffer))
    finally:
        pywrap_tf_session.TF_DeleteBuffer(buffer)
    return tuple(op.name for op in op_list.op)
