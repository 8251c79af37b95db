"""How far the 16-bit outputs moved from float32's: per output, the largest and the mean
error relative to the output's own scale, arg-max agreement, non-finite values.

Relative errors are taken against the output's scale, not element by element
(an element near zero would make any rounding look infinite):

* max relative error = max |y16 - y32| / max |y32|
* mean relative error = mean |y16 - y32| / mean |y32|

over every batch checked, finite float32 positions only. An output is within
tolerance when its max relative error is at most the tolerance and it has no
non-finite value where float32 has a finite one. The default tolerance is
``DEFAULT_TOLERANCE``: 16 units of the 16-bit type's rounding (2**-11 for
float16, 2**-8 for bfloat16), i.e. 16 * 2**-11 ~ 0.8% and 16 * 2**-8 ~ 6.3%.
Arg-max agreement (the share of rows whose largest entry is the same) is shown
for classifier-like outputs (last dimension > 1); it is informative, not a
criterion: near-ties of an untrained model flip.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

# unit roundoff of each 16-bit type (half the spacing of numbers near 1)
UNIT_ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}
ROUNDING_UNITS = 16
DEFAULT_TOLERANCE = {name: ROUNDING_UNITS * u for name, u in UNIT_ROUNDOFF.items()}
# The largest finite value of each 16-bit type.
MAX_VALUE = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38}


@dataclasses.dataclass(frozen=True)
class OutputError:
    """One output of one signature against float32."""

    signature: str
    output: str
    shape: tuple[int, ...]
    max_rel: float
    mean_rel: float
    argmax_agreement: float | None    # share of rows; None if not classifier-like
    nonfinite_fp32: int
    nonfinite_new: int                # non-finite where float32 is finite
    within: bool

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def compare(signature: str, names: Sequence[str], reference: Sequence[Sequence[np.ndarray]],
            candidate: Sequence[Sequence[np.ndarray]], tolerance: float) -> list[OutputError]:
    """Per output, the errors of `candidate` against `reference`.

    Args:
      signature: the signature's name (for the rows).
      names: output names, in the order of each batch's arrays.
      reference, candidate: per batch, the outputs (float32 original, 16-bit export).
      tolerance: the largest max relative error accepted.
    """
    rows = []
    for index, name in enumerate(names):
        ref = [np.asarray(batch[index]) for batch in reference]
        new = [np.asarray(batch[index]) for batch in candidate]
        rows.append(_compare_one(signature, name, ref, new, tolerance))
    return rows


def _compare_one(signature: str, name: str, ref: list[np.ndarray], new: list[np.ndarray],
                 tolerance: float) -> OutputError:
    shape = tuple(ref[0].shape)
    if ref[0].dtype.kind not in "fc":  # integer or boolean outputs: equal or not
        differ = sum(int(np.sum(r != n)) for r, n in zip(ref, new, strict=True))
        total = max(sum(r.size for r in ref), 1)
        share = differ / total
        return OutputError(signature, name, shape, share, share, None, 0, 0,
                           share <= tolerance)
    ref64 = [r.astype(np.float64) for r in ref]
    new64 = [n.astype(np.float64) for n in new]
    finite = [np.isfinite(r) for r in ref64]
    nonfinite_fp32 = sum(int(np.sum(~f)) for f in finite)
    nonfinite_new = sum(int(np.sum(f & ~np.isfinite(n)))
                        for f, n in zip(finite, new64, strict=True))
    diffs = np.concatenate([np.abs(n[f] - r[f]).ravel()
                            for r, n, f in zip(ref64, new64, finite, strict=True)])
    scales = np.concatenate([np.abs(r[f]).ravel() for r, f in zip(ref64, finite, strict=True)])
    usable = np.isfinite(diffs)
    if scales.size == 0 or not np.any(scales):
        max_rel = mean_rel = 0.0 if not np.any(diffs[usable]) else float("inf")
    else:
        max_rel = float(np.max(diffs[usable], initial=0.0) / np.max(scales))
        mean_rel = float(np.mean(diffs[usable]) / np.mean(scales)) if usable.any() else 0.0
    agreement = None
    if len(shape) >= 2 and shape[-1] > 1:
        same = sum(int(np.sum(np.argmax(r, -1) == np.argmax(n, -1)))
                   for r, n in zip(ref64, new64, strict=True))
        rows = sum(int(np.prod(r.shape[:-1])) for r in ref64)
        agreement = same / max(rows, 1)
    within = nonfinite_new == 0 and max_rel <= tolerance
    return OutputError(signature, name, shape, max_rel, mean_rel, agreement, nonfinite_fp32,
                       nonfinite_new, within)
