"""A step-time estimate for the H100, fitted to step times measured on a real H100.

The compiled program says what runs, not how long it takes (no autotuning, no clocks). The
estimate is a small linear model of five terms read from the program:

    ms = a * launches                (kernels outside loops: one launch each per step)
       + b * loop_launches           (kernel runs inside while loops: each iteration's)
       + c * memory_ms               (bytes of the kernels that are not conv/gemm / bandwidth)
       + d * matrix_ms               (each conv/gemm at its roofline: max(bytes / bandwidth,
                                      flops / peak rate of its input dtype))
       + e * host_syncs              (predicate copies the host waits for)

with bandwidth and peak rates from the target description (``data/h100_sxm.txtpb``) and
a..e >= 0 fitted by least squares on relative error (``fit``) to the rows of
``data/h100_calibration.json``: programs compiled here whose step times were measured on
an H100. ``leave_one_out`` says how well it predicts a row it was not fitted on.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
CALIBRATION = os.path.join(HERE, "data", "h100_calibration.json")
TERMS = ("launches", "loop_launches", "memory_ms", "matrix_ms", "host_syncs")
TERM_UNITS = {"launches": "us per kernel", "loop_launches": "us per kernel run in a loop",
              "memory_ms": "x bytes/bandwidth", "matrix_ms": "x roofline",
              "host_syncs": "us per host sync"}
#: XLA PrimitiveType numbers of the target description's rate tables
PRIMITIVE_TYPES = {"f16": 10, "bf16": 16, "f32": 11, "f64": 12}


class CalibrationError(ValueError):
    """The calibration rows cannot be fitted; the message says why."""


@dataclasses.dataclass(frozen=True)
class Device:
    """What the estimate needs of the target: bandwidth and peak matrix rates."""

    bandwidth: float  # bytes per second
    matrix_flops: dict[str, float]  # dtype -> flops per second

    def peak(self, dtype: str | None) -> float:
        return self.matrix_flops.get(dtype or "f32", self.matrix_flops["f32"])


def read_device(target_text: str) -> Device:
    """Bandwidth and peak matrix rates from a GpuTargetConfigProto text.

    A rate table entry gives multiply-adds per clock per unit: flops/s = 2 x ops x units x
    clock x cores.
    """
    def number(key: str, text: str) -> float:
        found = re.search(rf"\b{key}:\s*([0-9.eE+]+)", text)
        if not found:
            raise ValueError(f"target description has no {key}")
        return float(found.group(1))

    cores = number("core_count", target_text)
    matrix = target_text[target_text.index("matrix_unit_description"):]
    rates = {}
    for entry in re.finditer(r"rate_infos\s*\{\s*key:\s*(\d+)\s*value\s*\{([^}]*)\}", matrix):
        body = entry.group(2)
        rates[int(entry.group(1))] = (2 * number("ops_per_clock", body) *
                                      number("units_per_core", body) * cores *
                                      number("clock_rate_ghz", body) * 1e9)
    flops = {dtype: rates[key] for dtype, key in PRIMITIVE_TYPES.items() if key in rates}
    if "f32" not in flops:
        raise ValueError("target description has no F32 matrix rate")
    return Device(number("memory_bandwidth", target_text), flops)


def terms(kernels, device: Device) -> dict[str, float]:
    """The four kernel terms of a step's kernels (``hlo_reader.Kernel``s)."""
    launches, loop_launches, memory, matrix = 0, 0, 0.0, 0.0
    for k in kernels:
        if k.in_loop:
            loop_launches += k.times
        else:
            launches += k.times
        if k.category == "conv/gemm":
            seconds = max(k.bytes / device.bandwidth, k.flops / device.peak(k.dtype))
            matrix += seconds * k.times
        else:
            memory += k.bytes / device.bandwidth * k.times
    return {"launches": launches, "loop_launches": loop_launches, "memory_ms": memory * 1e3,
            "matrix_ms": matrix * 1e3}


def program_terms(features, device: Device) -> dict[str, float]:
    """All five terms of a program's ``hlo_reader.Features``."""
    return dict(terms(features.step_kernels, device), host_syncs=features.host_syncs)


@dataclasses.dataclass(frozen=True)
class Fit:
    """Fitted coefficients (ms per unit of each term) and what they were fitted on."""

    coefficients: dict[str, float]
    rows: int

    def predict(self, row_terms: dict[str, float]) -> float:
        return sum(self.coefficients[t] * row_terms[t] for t in self.coefficients)

    def describe(self) -> str:
        c = self.coefficients
        parts = []
        for t in TERMS:
            if t not in c:
                continue
            scale = 1e3 if TERM_UNITS[t].startswith("us") else 1.0
            parts.append(f"{c[t] * scale:.3g} {TERM_UNITS[t]}")
        return ", ".join(parts)


def _matrix(rows, names) -> tuple[np.ndarray, np.ndarray]:
    design = np.array([[float(r["terms"][t]) for t in names] for r in rows])
    measured = np.array([float(r["measured_ms"]) for r in rows])
    return design, measured


def fit(rows: list[dict], names=TERMS) -> Fit:
    """Non-negative least squares on relative error, by trying every subset of the terms.

    Args:
      rows: dicts with ``terms`` (each of ``names``) and ``measured_ms``.
      names: the terms to use.

    With five terms there are 31 subsets; the best one whose unconstrained solution is
    non-negative is the non-negative optimum.
    """
    if len(rows) < len(names):
        raise CalibrationError(f"{len(rows)} measured rows cannot fit {len(names)} terms; "
                               f"expected at least {len(names)}")
    design, measured = _matrix(rows, names)
    if np.any(measured <= 0):
        raise CalibrationError("every measured step time must be positive")
    weighted, target = design / measured[:, None], np.ones(len(rows))
    best, best_error = None, np.inf
    for k in range(1, len(names) + 1):
        for subset in itertools.combinations(range(len(names)), k):
            solution = np.linalg.lstsq(weighted[:, subset], target, rcond=None)[0]
            if np.any(solution < 0):
                continue
            error = float(np.sum((weighted[:, subset] @ solution - target) ** 2))
            if error < best_error - 1e-15:
                best, best_error = dict(zip(subset, solution, strict=True)), error
    if best is None:
        raise CalibrationError("no non-negative fit exists for these rows")
    return Fit({names[i]: float(best.get(i, 0.0)) for i in range(len(names))}, len(rows))


def relative_errors(model: Fit, rows: list[dict]) -> list[float]:
    """(estimate - measured) / measured of each row, by an already fitted model."""
    return [model.predict(r["terms"]) / r["measured_ms"] - 1 for r in rows]


def leave_one_out(rows: list[dict], names=TERMS) -> list[float]:
    """Each row's relative error when the model is fitted on the other programs' rows.

    A program measured twice (two sources) is left out whole, so its other measurement
    cannot stand in for it.
    """
    errors = []
    for row in rows:
        others = [r for r in rows if r["program"] != row["program"]]
        errors.append(fit(others, names).predict(row["terms"]) / row["measured_ms"] - 1)
    return errors


def load_calibration(path: str = CALIBRATION) -> dict:
    """The calibration file: measured rows with their programs' terms, and where they came from."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as err:
        raise CalibrationError(f"cannot read the calibration file {path} ({err}); regenerate "
                               "it with --calibrate") from err
    for row in data["rows"]:
        missing = [t for t in TERMS if t not in row.get("terms", {})]
        if missing:
            raise CalibrationError(f"{path}: row {row.get('program')} lacks {missing}; "
                                   "regenerate it with --calibrate")
    return data
