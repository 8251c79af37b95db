"""Short display names for the functions of a graph (``tfamp inspect``, text and HTML).

TensorFlow names traced functions ``__inference_<python name>_<trace number>``
(SavedModels: ``__inference__wrapped_model_1428``; gradients:
``__inference___backward_step_120_161``), and tfamp's rewrite appends
``_tfamp<N>`` to the library functions it registers. The rule, applied to
function names only (node names inside a function are already scoped by
their layers and stay as they are):

1. drop the ``__inference_`` prefix;
2. drop trailing ``_tfamp<N>`` / ``_<digits>`` groups (tracing counters);
3. if the result is empty, or two functions of the graph would get the same
   short name, those functions keep their full names.

So ``__inference__wrapped_model_1428/sequential/dense/MatMul`` shows as
``_wrapped_model/sequential/dense/MatMul``. ``--full-names`` shows the names
as the graph has them; either form is accepted by ``--why``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

_PREFIX = "__inference_"
_COUNTERS = re.compile(r"(?:_tfamp\d*|_\d+)+$")


def short_function_name(name: str) -> str:
    """`name` without TensorFlow's tracing prefix and counters ("" stays "")."""
    short = _COUNTERS.sub("", name.removeprefix(_PREFIX))
    return short or name


def short_function_names(names: Iterable[str]) -> dict[str, str]:
    """Full name -> display name for every function of one graph, collision-free.

    Example:
      >>> short_function_names(["__inference_f_12", "__inference_f_30", "g_7"])
      {'__inference_f_12': '__inference_f_12', '__inference_f_30': '__inference_f_30', 'g_7': 'g'}
    """
    names = list(dict.fromkeys(names))
    short = {name: short_function_name(name) for name in names}
    taken: dict[str, int] = {}
    for value in short.values():
        taken[value] = taken.get(value, 0) + 1
    for name in names:
        if taken[short[name]] > 1 or (short[name] in short and short[name] != name):
            short[name] = name  # ambiguous: the full name is the only honest label
    return short


def shorten_quoted(text: str, shown: dict[str, str]) -> str:
    """`text` with each quoted full function name ('__inference_f_12') shown short."""
    for full, short in shown.items():
        if full and short != full:
            text = text.replace(f"'{full}'", f"'{short}'")
    return text
