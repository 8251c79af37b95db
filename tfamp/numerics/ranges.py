"""Where a model's numbers sit against float16's and bfloat16's limits.

Collecting: ``bucket_counts(x)`` runs inside the graph and turns any float
tensor into one small int32 vector: counts of ``floor(log2|x|)`` per exponent
``E_MIN..E_MAX`` (read exactly from the float32 exponent bits; values below
``2**E_MIN`` go to the lowest bin), then zeros, non-finite values and values
below ``2**-126`` (subnormal in float32 and bfloat16). Only these vectors leave
the device. ``tfamp.keras.range_probe`` uses it on Keras models (forward
activations, activation gradients and weight gradients per layer);
``tfamp.numerics.graph_probe`` on traced inference graphs such as SavedModel
signatures (forward activations of the ops tfamp converts).

Summarising: a ``TensorRange`` per tensor answers what share of its values
would underflow float16 (below its smallest subnormal ``2**-24``, or below its
smallest normal ``2**-14``) at a given loss scale, and its overflow head-room.
Loss scales are powers of 2, so scaling shifts exponents exactly and the
shares at any scale come from the same counts. The magnitudes are float32
reference values: what the 16-bit run would have to represent. A run's
tensors together, with the recommendation, are a ``RangeReport``
(``tfamp.numerics.range_report``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterable, Sequence
from typing import Any

log = logging.getLogger("tfamp")

SCHEMA_VERSION = 1
# Exponent range of the histogram. 2**-64 is far below anything a loss scale up
# to 2**MAX_SCALE_EXP can lift into float16 (2**-24 / 2**24 = 2**-48).
E_MIN, E_MAX = -64, 20
NUM_BINS = E_MAX - E_MIN + 1
# Columns of a bucket_counts vector after the exponent bins.
ZEROS_COL, NONFINITE_COL, TINY_COL = NUM_BINS, NUM_BINS + 1, NUM_BINS + 2
NUM_COLUMNS = NUM_BINS + 3

FP16_MAX = 65504.0
FP16_SUBNORMAL_EXP = -24  # smallest positive float16: 2**-24; below it rounds to 0
FP16_NORMAL_EXP = -14     # smallest normal float16: 2**-14; below it precision drops
FP16_OVERFLOW_EXP = 16    # 2**16 > 65504: from this exponent on, float16 gives inf
BF16_NORMAL_EXP = -126    # bfloat16 keeps float32's exponent range
BF16_MAX = 3.3895313892515355e38
BF16_MANTISSA_BITS = 8    # (7 stored + 1 implicit): relative rounding error 2**-8

MAX_SCALE_EXP = 24        # largest scale tfamp recommends: 2**24
HEADROOM_BITS = 1         # recommended scale keeps max|g| * S below 65504 / 2
NEGLIGIBLE = 0.001        # the one threshold: losing at most 0.1% of values is "no loss"

KINDS = ("activation_gradient", "weight_gradient", "activation")
KIND_LABELS = {"activation_gradient": "activation gradients",
               "weight_gradient": "weight gradients", "activation": "forward activations"}


def bucket_counts(x):
    """On-device log2 histogram of |x|: an int32 vector of NUM_COLUMNS counts.

    Args:
      x: a float tensor (any shape, float16 / bfloat16 / float32 / float64).

    Returns:
      [bins E_MIN..E_MAX, zeros, non-finite, below 2**-126 (nonzero)].
      TensorFlow's CPU kernels flush float32 subnormals to zero, so there they
      count as zeros.

    Example:
      >>> counts = bucket_counts(tf.constant([0.0, 1.0, 3.0, 2.0**-30]))
      >>> int(counts[0 - E_MIN]), int(counts[1 - E_MIN]), int(counts[ZEROS_COL])
      (1, 1, 1)
    """
    counts, _ = bucket_counts_many([x])
    return counts[0]


# Raw key of a float32 |x|: its biased exponent field (0: subnormal, 255: inf or
# nan), or _ZERO_KEY for an exact zero.
_ZERO_KEY = 256
_RAW_KEYS = 257


def _fold_index() -> list[int]:
    """Column of each raw key in a bucket_counts vector."""
    index = []
    for key in range(_RAW_KEYS):
        if key == _ZERO_KEY:
            index.append(ZEROS_COL)
        elif key == 255:
            index.append(NONFINITE_COL)
        else:  # subnormals (key 0) land in the lowest bin
            index.append(min(max(key - 127, E_MIN), E_MAX) - E_MIN)
    return index


def bucket_counts_many(tensors):
    """``bucket_counts`` and the largest finite |x| of many tensors, in one pass.

    Each tensor's values get a key: its float32 exponent field, or _ZERO_KEY
    for an exact zero, plus ``257 * (its position)``. One bincount over all
    keys counts every tensor at once; the small [tensors, 257] count matrix is
    then folded into the histogram columns.

    The offset is added to each tensor's own keys, never built as a separate
    vector (``tf.repeat`` of the tensor sizes): that vector depends on static
    shapes only, so grappler constant-folded it at the first call -- hundreds
    of MB for a conv net (MobileNetV2 96x96, batch 8: the first probe call took
    28-34 s, now 9-12 s; later calls 1.0 s, now 0.2 s; see BUILD_NOTES
    session 8).

    Returns:
      (int32 counts [len(tensors), NUM_COLUMNS], float32 max |x| [len(tensors)];
      a max is inf or nan when the tensor holds one).
    """
    import tensorflow as tf

    n = len(tensors)
    flat = [tf.abs(tf.reshape(tf.cast(t, tf.float32), [-1])) for t in tensors]
    # One pass per tensor; inf or nan if the tensor has one (the counts say so).
    maxes = tf.stack([tf.reduce_max(tf.concat([a, [0.0]], 0)) for a in flat])
    keys = []
    for index, values in enumerate(flat):
        bits = tf.bitcast(values, tf.int32)  # sign bit is 0 after abs
        key = tf.where(tf.equal(bits, 0), _ZERO_KEY, tf.bitwise.right_shift(bits, 23))
        keys.append(key + index * _RAW_KEYS if index else key)
    raw = tf.reshape(tf.math.bincount(tf.concat(keys, 0), minlength=n * _RAW_KEYS,
                                      maxlength=n * _RAW_KEYS), [n, _RAW_KEYS])
    folded = tf.transpose(tf.math.unsorted_segment_sum(
        tf.transpose(raw), tf.constant(_fold_index()), TINY_COL))
    return tf.concat([folded, raw[:, :1]], 1), maxes


@dataclasses.dataclass
class TensorRange:
    """Accumulated log2 histogram of one tensor (or one layer's tensors).

    Attributes:
      name: what was measured, e.g. "dense_3" or "dense_3/kernel".
      layer: the layer / name scope it belongs to.
      kind: "activation_gradient", "weight_gradient" or "activation".
      counts: NUM_BINS counts; counts[i] holds values with floor(log2|x|) ==
        E_MIN + i (the first bin also holds everything smaller).
      zeros, nonfinite: exact zeros; inf / nan values.
      tiny: nonzero values below 2**-126 (they are in counts[0] too).
      max_abs: the largest |x| seen (inf or nan when the tensor held one).
      steps: batches accumulated.
    """

    name: str
    layer: str
    kind: str
    counts: list[int]
    zeros: int = 0
    nonfinite: int = 0
    tiny: int = 0
    max_abs: float = 0.0
    steps: int = 1

    @classmethod
    def from_vector(cls, name: str, layer: str, kind: str, vector: Sequence[int],
                    max_abs: float) -> TensorRange:
        """Builds one from a ``bucket_counts`` vector (host copy)."""
        vector = [int(v) for v in vector]
        if len(vector) != NUM_COLUMNS:
            raise ValueError(f"expected a bucket_counts vector of {NUM_COLUMNS} counts, "
                             f"received {len(vector)}")
        return cls(name, layer, kind, vector[:NUM_BINS], zeros=vector[ZEROS_COL],
                   nonfinite=vector[NONFINITE_COL], tiny=vector[TINY_COL],
                   max_abs=float(max_abs))

    def merge(self, other: TensorRange) -> None:
        """Adds `other`'s counts (another step of the same tensor) to this one."""
        self.counts = [a + b for a, b in zip(self.counts, other.counts, strict=True)]
        self.zeros += other.zeros
        self.nonfinite += other.nonfinite
        self.tiny += other.tiny
        self.max_abs = max(self.max_abs, other.max_abs)
        self.steps += other.steps

    @property
    def nonzero(self) -> int:
        """Finite nonzero values counted."""
        return sum(self.counts)

    @property
    def total(self) -> int:
        return self.nonzero + self.zeros + self.nonfinite

    @property
    def max_exponent(self) -> int | None:
        """floor(log2) of the largest finite nonzero value, None if there is none."""
        for index in range(NUM_BINS - 1, -1, -1):
            if self.counts[index]:
                return E_MIN + index
        return None

    def share_below(self, exponent: int, scale: float = 1.0) -> float:
        """Share of nonzero finite values with |x| * scale below 2**exponent."""
        if not self.nonzero:
            return 0.0
        k = scale_exponent(scale)
        below = sum(c for i, c in enumerate(self.counts) if E_MIN + i + 1 + k <= exponent)
        return below / self.nonzero

    def underflow_share(self, scale: float = 1.0) -> float:
        """Share of nonzero values float16 turns into 0 at this loss scale."""
        return self.share_below(FP16_SUBNORMAL_EXP, scale)

    def subnormal_share(self, scale: float = 1.0) -> float:
        """Share of nonzero values below float16's smallest normal (incl. those lost)."""
        return self.share_below(FP16_NORMAL_EXP, scale)

    def overflow_share(self, scale: float = 1.0) -> float:
        """Share of nonzero values float16 turns into inf at this loss scale."""
        if not self.nonzero:
            return 0.0
        k = scale_exponent(scale)
        over = sum(c for i, c in enumerate(self.counts) if E_MIN + i + k >= FP16_OVERFLOW_EXP)
        return over / self.nonzero

    def headroom_bits(self, scale: float = 1.0) -> int | None:
        """How many doublings of `scale` are left before the largest value overflows."""
        top = self.max_exponent
        if top is None:
            return None
        return FP16_OVERFLOW_EXP - 1 - (top + scale_exponent(scale))

    def bf16_underflow_share(self) -> float:
        """Share of nonzero values below bfloat16's (= float32's) smallest normal."""
        return self.tiny / self.nonzero if self.nonzero else 0.0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def scale_exponent(scale: float) -> int:
    """floor(log2(scale)): loss scales are powers of two, others are rounded down."""
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"a loss scale must be a positive finite number, received {scale!r}")
    return math.floor(math.log2(scale) + 1e-12)


def format_scale(scale: float) -> str:
    """'2^12 (4096)' style text for a power-of-two scale."""
    k = scale_exponent(scale)
    if 2.0**k != scale:
        return f"{scale:g}"
    return f"2^{k} ({int(scale)})" if k > 0 else f"2^{k}" if k else "1"


def format_pct(share: float) -> str:
    """'0%', '<0.01%', '0.12%', '3.4%', '>99.5%': two decimals below 1%, so a share
    just above the 0.1% threshold never reads as "0.1%" next to "<0.1%"."""
    if share == 0:
        return "0%"
    if share < 0.0001:
        return "<0.01%"
    if share < 0.01:
        return f"{100 * share:.2f}%"
    return f"{100 * share:.1f}%" if share < 0.995 or share == 1 else ">99.5%"


def accumulate(report_tensors: list[TensorRange], step: Iterable[TensorRange]) -> None:
    """Merges one step's entries into `report_tensors` (matched by kind and name)."""
    index = {(t.kind, t.name): t for t in report_tensors}
    for entry in step:
        existing = index.get((entry.kind, entry.name))
        if existing is None:
            report_tensors.append(entry)
            index[(entry.kind, entry.name)] = entry
        else:
            existing.merge(entry)
