"""Where a model's numbers sit against float16's and bfloat16's limits.

Collecting: ``bucket_counts(x)`` runs inside the graph and turns any float
tensor into one small int32 vector: counts of ``floor(log2|x|)`` per exponent
``E_MIN..E_MAX`` (read exactly from the float32 exponent bits; values below
``2**E_MIN`` go to the lowest bin), then zeros, non-finite values and values
below ``2**-126`` (subnormal in float32 and bfloat16). Only these vectors leave
the device. ``tfamp.numerics.keras_probe`` uses it on Keras models (forward
activations, activation gradients and weight gradients per layer);
``tfamp.numerics.graph_probe`` on traced inference graphs such as SavedModel
signatures (forward activations of the ops tfamp converts).

Summarising: ``RangeReport`` holds one ``TensorRange`` per tensor and answers
what share of values would underflow float16 (below its smallest subnormal
``2**-24``, or below its smallest normal ``2**-14``) at a given loss scale,
the overflow head-room, the loss scale tfamp recommends and a sentence saying
so. Loss scales are powers of 2, so scaling shifts exponents exactly and the
shares at any scale come from the same counts. The magnitudes are float32
reference values: what the 16-bit run would have to represent.

JSON schema (``to_dict``): version, model, dtype, steps, loss_scale,
growth_interval, initial_scale, e_min, e_max, notes, tensors (name, layer,
kind, counts, zeros, nonfinite, tiny, max_abs, steps).
"""

from __future__ import annotations

import dataclasses
import json
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


@dataclasses.dataclass
class RangeReport:
    """Ranges of a model's tensors over a few steps, and what they mean for float16.

    Attributes:
      model: the model's name.
      steps: batches collected.
      loss_scale: the loss scale in force while collecting (None: no scaling).
      tensors: one TensorRange per measured tensor.
      notes: facts a reader must know (e.g. "subclassed model: weight
        gradients only").
      growth_interval, initial_scale: the dynamic loss-scale settings used for
        the "dynamic scaling reaches it after N steps" estimate.
    """

    model: str
    steps: int
    loss_scale: float | None
    tensors: list[TensorRange]
    notes: list[str] = dataclasses.field(default_factory=list)
    dtype: str = "float16"
    growth_interval: int = 2000
    initial_scale: float = 2.0**15

    # -- questions -----------------------------------------------------------

    def of_kind(self, kind: str) -> list[TensorRange]:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {list(KINDS)}, received {kind!r}")
        return [t for t in self.tensors if t.kind == kind]

    def tensor(self, name: str, kind: str) -> TensorRange:
        """The entry measuring `name` of `kind`."""
        for entry in self.tensors:
            if entry.name == name and entry.kind == kind:
                return entry
        known = sorted(t.name for t in self.tensors if t.kind == kind)
        raise KeyError(f"no {kind} entry named {name!r}; entries of that kind: {known}")

    def combined(self, kind: str) -> TensorRange:
        """All tensors of `kind` in one histogram (for the picture)."""
        entries = self.of_kind(kind)
        merged = TensorRange(f"all {KIND_LABELS[kind]}", "", kind, [0] * NUM_BINS, steps=0)
        for entry in entries:
            merged.merge(dataclasses.replace(entry, steps=0))
        merged.steps = self.steps
        return merged

    def gradients(self) -> list[TensorRange]:
        return [t for t in self.tensors if t.kind != "activation"]

    def highest_safe_scale(self) -> float:
        """The largest power of 2 that keeps every gradient's max * S below 65504 / 2.

        Capped at 2**MAX_SCALE_EXP; 1 if the gradients already leave no head-room
        (or are all zero).
        """
        tops = [t.max_exponent for t in self.gradients() if t.max_exponent is not None]
        if not tops:
            return 1.0
        k = FP16_OVERFLOW_EXP - 1 - HEADROOM_BITS - max(tops)
        return 2.0 ** min(max(k, 0), MAX_SCALE_EXP)

    def advice(self):
        """The one recommendation (``tfamp.numerics.advice.Advice``): scale, reasons, text."""
        from tfamp.numerics.advice import advise  # advice reads this module

        return advise(self)

    def recommended_scale(self) -> float:
        """The scale the recommendation names (the table's "rec." column); 1 without
        gradients."""
        scale = self.advice().scale
        return 1.0 if scale is None else scale

    def smallest_sufficient_scale(self, threshold: float = NEGLIGIBLE) -> float | None:
        """The smallest power of 2 (up to the highest safe scale) at which no gradient
        counted as evidence (``advice.evidence``) loses more than `threshold` of its
        values; None if even that one does not."""
        from tfamp.numerics.advice import evidence, sufficient_scale

        return sufficient_scale(evidence(self), self.highest_safe_scale(), threshold)

    def dynamic_steps_to(self, scale: float) -> tuple[int, str]:
        """How dynamic loss scaling gets from `initial_scale` to `scale`.

        Returns:
          (steps, "skipped") when it must halve (each overflowing step is
          skipped), (steps, "good") when it must grow (one doubling per
          `growth_interval` good steps), (0, "") when it starts there.
        """
        diff = scale_exponent(scale) - scale_exponent(self.initial_scale)
        if diff < 0:
            return -diff, "skipped"
        if diff > 0:
            return diff * self.growth_interval, "good"
        return 0, ""

    def worst_gradient(self) -> TensorRange | None:
        """The evidence gradient losing the largest share at scale 1 (ties: activation
        gradients); rounding-level and all-zero gradients are not evidence."""
        from tfamp.numerics.advice import evidence

        candidates = evidence(self)
        if not candidates:
            return None
        return max(candidates, key=lambda t: (t.underflow_share(1.0),
                                              t.kind == "activation_gradient", t.nonzero))

    def recommendation(self) -> str:
        """One actionable sentence about loss scaling for this model (``advice()``)."""
        return self.advice().sentence

    # -- rendering -----------------------------------------------------------

    def summary_text(self, advice=None) -> str:
        """The answer, for logs and the CLI: the recommendation first, then a few facts.

        The per-tensor table is ``table_text()`` (ranges.txt holds both).
        """
        advice = advice or self.advice()
        gradients = self.gradients()
        lines = [f"tfamp ranges: {self.model}, {self.steps} step(s), {len(self.tensors)} "
                 f"tensors measured against float16's limits (0 below 2^-24, max 65504)",
                 "  recommendation: " + advice.sentence]
        if gradients:
            counted = [t for t in gradients if t.nonzero and t.name not in advice.ignored]
            rec = advice.scale or 1.0
            losing = {s: sum(t.underflow_share(s) > NEGLIGIBLE for t in counted)
                      for s in (1.0, rec)}
            lines.append(f"  gradients losing more than {format_pct(NEGLIGIBLE)} of their "
                         f"values to 0: {losing[1.0]} of {len(counted)} at scale 1, "
                         f"{losing[rec]} at {format_scale(rec)} (recommended)")
        if advice.ignored:
            names = sorted(advice.ignored)
            shown = ", ".join(repr(n) for n in names[:4]) + (", ..." if len(names) > 4 else "")
            lines.append(f"  not counted: {len(names)} gradient(s) zero or at rounding "
                         f"level, zero in exact arithmetic ({shown})")
        if self.loss_scale is not None:
            lines.append(f"  loss scale while collecting: {format_scale(self.loss_scale)}")
        for note in self.notes:
            lines.append(f"  note: {note}")
        return "\n".join(lines)

    def table_text(self, advice=None) -> str:
        """The per-tensor table (shares lost at scale 1, now and at the recommended scale)."""
        advice = advice or self.advice()
        recommended = advice.scale or 1.0
        current = self.loss_scale
        lines = [f"per-tensor ranges ({self.model}; shares of nonzero values; "
                 f"'*': not counted, see above)"]
        scale_cols = [("scale 1", 1.0)]
        if current is not None and current != 1.0:
            scale_cols.append((f"now {format_scale(current).split(' ')[0]}", current))
        scale_cols.append((f"rec. {format_scale(recommended).split(' ')[0]}", recommended))
        for kind in KINDS:
            entries = self.of_kind(kind)
            if not entries:
                continue
            lines.append(f"  {KIND_LABELS[kind]} (share of nonzero values below 2^-24 "
                         f"{'/ above 65504 ' if kind == 'activation' else ''}in float16):")
            width = max(len(t.name) for t in entries) + 1
            if kind == "activation":
                lines.append(f"    {'tensor':<{width}}  {'underflow':>10}  {'overflow':>10}  "
                             f"{'max |x|':>10}  {'zeros':>6}")
                for t in entries:
                    lines.append(f"    {t.name:<{width}}  {format_pct(t.underflow_share()):>10}  "
                                 f"{format_pct(t.overflow_share()):>10}  {t.max_abs:>10.3g}  "
                                 f"{format_pct(_zero_share(t)):>6}")
                continue
            header = "  ".join(f"{label:>10}" for label, _ in scale_cols)
            lines.append(f"    {'tensor':<{width}}  {header}  {'room@rec.':>10}  "
                         f"{'max |g|':>10}  {'bf16 uf':>7}")
            for t in entries:
                shares = "  ".join(f"{format_pct(t.underflow_share(s)):>10}"
                                   for _, s in scale_cols)
                room = t.headroom_bits(recommended)
                room_text = "-" if room is None else f"2^{room}"
                name = t.name + ("*" if t.name in advice.ignored else "")
                lines.append(f"    {name:<{width}}  {shares}  {room_text:>10}  "
                             f"{t.max_abs:>10.3g}  {format_pct(t.bf16_underflow_share()):>7}")
        if self.gradients():
            lines.append("  room@rec.: doublings of the recommended scale left before the "
                         "largest value overflows float16")
        lines.append(f"  bfloat16: same range as float32 ({BF16_MAX:.3g}), "
                     f"{BF16_MANTISSA_BITS}-bit precision; 'bf16 uf' = values below 2^-126")
        return "\n".join(lines)

    def full_text(self) -> str:
        """Summary, then the table (what ranges.txt holds)."""
        advice = self.advice()
        return self.summary_text(advice) + "\n\n" + self.table_text(advice)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": SCHEMA_VERSION, "model": self.model, "dtype": self.dtype,
            "steps": self.steps, "loss_scale": self.loss_scale,
            "growth_interval": self.growth_interval, "initial_scale": self.initial_scale,
            "e_min": E_MIN, "e_max": E_MAX, "notes": list(self.notes),
            **self._advice_fields(),
            "tensors": [t.to_dict() for t in self.tensors],
        }

    def _advice_fields(self) -> dict[str, Any]:
        advice = self.advice()
        return {"recommended_scale": 1.0 if advice.scale is None else advice.scale,
                "recommendation": advice.sentence, "advice_kind": advice.kind,
                "negligible_share": NEGLIGIBLE, "keep_fp32": list(advice.keep_fp32),
                "not_counted": dict(advice.ignored)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RangeReport:
        """Reads `to_dict` output back (derived fields are recomputed)."""
        if data.get("version") != SCHEMA_VERSION or (data.get("e_min"), data.get("e_max")) \
                != (E_MIN, E_MAX):
            raise ValueError(
                f"expected a tfamp range report version {SCHEMA_VERSION} with exponents "
                f"{E_MIN}..{E_MAX}, received version {data.get('version')!r} with "
                f"{data.get('e_min')!r}..{data.get('e_max')!r}")
        tensors = [TensorRange(**t) for t in data["tensors"]]
        return cls(model=data["model"], steps=data["steps"], loss_scale=data["loss_scale"],
                   tensors=tensors, notes=list(data.get("notes", ())),
                   dtype=data.get("dtype", "float16"),
                   growth_interval=data.get("growth_interval", 2000),
                   initial_scale=data.get("initial_scale", 2.0**15))


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


def _zero_share(t: TensorRange) -> float:
    return t.zeros / t.total if t.total else 0.0


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
