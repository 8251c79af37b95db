"""What a node's name says about where TensorFlow's gradient machinery put it.

``tf.GradientTape`` names each gradient op ``gradient_tape/<forward op>/<op>``
(``gradient_tape/functional_1/dense/BiasAdd/BiasAddGrad``), and
``tf.gradients`` names them ``gradients/<forward op>/<op>`` (``gradients_1/``
on a second call, ``<scope>/gradients/...`` inside a name scope). Both are
TensorFlow's own naming, the only record a GraphDef keeps of which ops are
the backward pass; the colouring, the overflow locator and the per-layer
overview read it here, in one place.

Names inside a library function (a ``tf.function``'s gradient function) do not
carry the prefix: there a node is not known to be a gradient op.
"""

from __future__ import annotations

import re

GRADIENT_PREFIXES = ("gradient_tape/", "gradients/")
_GRADIENT_SCOPE = re.compile(r"(?:^|/)(?:gradient_tape|gradients)(?:_\d+)?/")


def is_gradient(name: str) -> bool:
    """Did TensorFlow's gradient machinery write the node called `name`?"""
    return _GRADIENT_SCOPE.search(name) is not None


def forward_scope(name: str) -> tuple[str, bool]:
    """(the name scope of the forward op a gradient op belongs to, is it one).

    A forward op's own name comes back as it is, with False."""
    match = _GRADIENT_SCOPE.match(name)
    if match is None:
        return name, False
    rest = name[match.end():]
    return (rest.rsplit("/", 1)[0] if "/" in rest else rest), True
