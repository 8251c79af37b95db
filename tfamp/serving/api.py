"""``tfamp.export``: a SavedModel or Keras file -> a mixed-precision SavedModel for serving.

The order: refuse a DST that may not be written; load the source; make the
check's inputs and run the float32 signatures on them; rewrite every signature,
store in 16-bit the weights that only 16-bit ops read (in every signature), run
the result and compare (one *evaluation*); if an output is out of tolerance,
keep float32 what the float32 ranges show overflowing, then what a ranked
bisection finds (``locate``); write the SavedModel only once every output is
within tolerance, check the written copy, move it into place.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tfamp.config import AmpConfig
from tfamp.serving import locate
from tfamp.serving.accuracy import DEFAULT_TOLERANCE, OutputError, compare
from tfamp.serving.build import Rewritten, build_function, new_16bit_variable, rewrite_signature
from tfamp.serving.errors import ExportError
from tfamp.serving.inputs import DEFAULT_BATCH, DEFAULT_LENGTH, CheckInputs, check_inputs
from tfamp.serving.report import ExportReport, SignatureReport
from tfamp.serving.source import Signature, Source, folder_bytes, open_source
from tfamp.serving.weights import weight_casts
from tfamp.serving.write import check_destination, write_saved_model

log = logging.getLogger("tfamp")

# How many times the range step may keep more layers and rewrite again.
_MAX_RANGE_ROUNDS = 8


def export(source: str | Path, destination: str | Path, *, config: AmpConfig | None = None,
           signatures: Sequence[str] | None = None, inputs: Sequence[str | Path] = (),
           tolerance: float | None = None, overwrite: bool = False,
           batch_size: int = DEFAULT_BATCH, length: int = DEFAULT_LENGTH) -> ExportReport:
    """Exports `source` as a mixed-precision SavedModel at `destination`, checked first.

    Args:
      source: a SavedModel directory or a Keras model file (.keras, .h5).
      destination: the SavedModel folder to write.
      config: the rewrite settings (dtype, op lists, keep_fp32, runtime);
        ``AmpConfig()`` (float16) if None.
      signatures: the signatures to export (default: all).
      inputs: .npz files, one batch each, keyed by input name; none: random inputs.
      tolerance: the largest relative error accepted per output (default per
        dtype, ``accuracy.DEFAULT_TOLERANCE``).
      overwrite: replace an existing SavedModel at `destination`.
      batch_size, length: the sizes of open dimensions of random inputs.

    Returns:
      the ExportReport (``report.render_text()``, ``report.to_json()``).

    Raises:
      ExportError: nothing was written; the message says why and what to do.
        ``err.report`` holds the report when the check failed.

    Example:
      >>> report = tfamp.export("model.keras", "served_fp16")
      >>> print(report.render_text())
    """
    config = config or AmpConfig()
    if tolerance is None:
        tolerance = DEFAULT_TOLERANCE[config.dtype]
    if not tolerance > 0:
        raise ExportError(f"tolerance must be a positive relative error (e.g. 0.01), "
                          f"received {tolerance!r}")
    destination = Path(destination)
    check_destination(destination, overwrite)
    with open_source(Path(source), list(signatures) if signatures else None) as src:
        exporter = _Exporter(src, float(tolerance), [Path(p) for p in inputs],
                             batch_size, length)
        attempt, kept = exporter.run(config)
        report = exporter.report(attempt, kept, destination)
        if not report.within_tolerance:
            error = ExportError(_failure_message(report, attempt))
            error.report = report
            raise error
        write_saved_model(destination, attempt.functions, exporter.tracked(attempt),
                          exporter.verifier(attempt))
        report.written = True
        report.variables_bytes_after = folder_bytes(destination / "variables")
        log.info("%s", report.verdict())
        return report


@dataclasses.dataclass
class _Attempt:
    """One candidate export: its settings, graphs, functions and errors."""

    config: AmpConfig
    rewritten: dict[str, Rewritten]
    stored: dict[str, set[str]]            # signature -> placeholders stored 16-bit
    functions: dict[str, Any]
    graph_defs: dict[str, Any]
    outputs: dict[str, list[list[np.ndarray]]]
    errors: dict[str, list[OutputError]]

    @property
    def within(self) -> bool:
        return all(row.within for rows in self.errors.values() for row in rows)


class _Exporter:
    """The steps of one export, sharing the source, the inputs and the float32 outputs."""

    def __init__(self, source: Source, tolerance: float, npz: list[Path], batch_size: int,
                 length: int):
        self.source = source
        self.tolerance = tolerance
        self.checks: dict[str, CheckInputs] = {
            s.name: check_inputs(s, npz, batch_size=batch_size, length=length)
            for s in source.signatures}
        self.reference = {s.name: [_outputs(s.function, b) for b in self.checks[s.name].batches]
                          for s in source.signatures}
        self._new_variables: dict[tuple[int, str], Any] = {}
        self.search = {"range_runs": 0, "evaluations": 0, "rewrites": 0}
        self._attempts: dict[str, _Attempt] = {}

    # -- the search ------------------------------------------------------------

    def run(self, config: AmpConfig) -> tuple[_Attempt, list[locate.Kept]]:
        attempt = self.attempt(config)
        kept: list[locate.Kept] = []
        if not attempt.within:
            attempt, kept = self._keep_out_of_range(attempt)
        if not attempt.within:
            attempt, more = self._bisect(attempt)
            kept.extend(more)
        return attempt, kept

    def _keep_out_of_range(self, attempt: _Attempt) -> tuple[_Attempt, list[locate.Kept]]:
        """Step 1 (``locate``): layers whose float32 values exceed the 16-bit range."""
        from tfamp.rewrite.graph import build_view

        config = attempt.config
        rewritten = dict(attempt.rewritten)
        kept: list[locate.Kept] = []
        bodies = {}
        maxima = {}
        for signature in self.source.signatures:
            body = locate.model_body(signature.function.graph.as_graph_def())
            bodies[signature.name] = body
            maxima[signature.name] = locate.float32_maxima(
                signature.function, body, self._flat_batches(signature))
            self.search["range_runs"] += 1
        for _ in range(_MAX_RANGE_ROUNDS):
            found = []
            for signature in self.source.signatures:
                entry = rewritten[signature.name]
                view = build_view(entry.graph_def)
                found.extend(k for k in locate.out_of_range(
                    entry.report, bodies[signature.name], view, maxima[signature.name])
                    if k.pattern not in config.keep_fp32 and k.pattern not in
                    {p.pattern for p in found})
            if not found:
                break
            kept.extend(found)
            config = config.replace(keep_fp32=(*config.keep_fp32, *(k.pattern for k in found)))
            rewritten = {s.name: self._rewrite(s, config) for s in self.source.signatures}
        if not kept:
            return attempt, []
        return self.attempt(config), kept

    def _bisect(self, attempt: _Attempt) -> tuple[_Attempt, list[locate.Kept]]:
        """Step 2 (``locate``): rank the converted layers by the error each adds, bisect."""
        failing = next(s for s in self.source.signatures
                       if not all(row.within for row in attempt.errors[s.name]))
        entry = attempt.rewritten[failing.name]
        body = locate.model_body(failing.function.graph.as_graph_def())
        ranking = locate.error_ranking(failing.function, entry.graph_def, entry.report, body,
                                       self._flat_batches(failing))
        self.search["evaluations"] += 1  # the instrumented 16-bit run
        if not ranking:
            return attempt, []
        base = attempt.config.keep_fp32

        def passes(patterns: list[str]) -> bool:
            return self.attempt(attempt.config.replace(
                keep_fp32=(*base, *patterns))).within

        count, _ = locate.bisect(ranking, passes)
        if count is None:
            return attempt, []
        chosen = ranking[:count]
        final = self.attempt(attempt.config.replace(keep_fp32=(
            *base, *(locate.keep_pattern(layer, node) for layer, node, _ in chosen))))
        allow = final.config.op_lists.allow
        if not any(op in allow for entry in final.rewritten.values()
                   for op in entry.report.converted):
            return attempt, []  # no matrix op left in 16-bit: nothing worth exporting
        kept = [locate.Kept(locate.keep_pattern(layer, node), layer,
                            f"adds {gain:.2%} relative error in {attempt.config.dtype} "
                            f"(ranked {rank + 1} of {len(ranking)} converted layers)",
                            "bisection")
                for rank, (layer, node, gain) in enumerate(chosen)]
        return final, kept

    # -- one evaluation ----------------------------------------------------------

    def _rewrite(self, signature: Signature, config: AmpConfig) -> Rewritten:
        self.search["rewrites"] += 1
        return rewrite_signature(signature, config)

    def attempt(self, config: AmpConfig) -> _Attempt:
        """Rewrites, stores weights, builds and runs every signature with `config`."""
        key = repr(config)
        if key in self._attempts:
            return self._attempts[key]
        self.search["evaluations"] += 1
        rewritten = {s.name: self._rewrite(s, config) for s in self.source.signatures}
        stored = self._stored(rewritten)
        functions, graph_defs, outputs, errors = {}, {}, {}, {}
        import tensorflow as tf

        dtype = tf.as_dtype(config.dtype)
        for signature in self.source.signatures:
            new_variables = {}
            for capture in signature.captures:
                if capture.placeholder.split(":")[0] in stored[signature.name]:
                    key_v = (id(capture.variable), config.dtype)
                    if key_v not in self._new_variables:
                        self._new_variables[key_v] = new_16bit_variable(capture.variable, dtype)
                    new_variables[id(capture.variable)] = self._new_variables[key_v]
            function, graph_def = build_function(rewritten[signature.name],
                                                 stored[signature.name], config.target_enum,
                                                 new_variables)
            functions[signature.name] = function
            graph_defs[signature.name] = graph_def
            outputs[signature.name] = [_outputs(function, b)
                                       for b in self.checks[signature.name].batches]
            errors[signature.name] = compare(signature.name, signature.output_names,
                                             self.reference[signature.name],
                                             outputs[signature.name], self.tolerance)
        attempt = _Attempt(config, rewritten, stored, functions, graph_defs, outputs, errors)
        self._attempts[key] = attempt
        return attempt

    def _stored(self, rewritten: dict[str, Rewritten]) -> dict[str, set[str]]:
        """Placeholders stored 16-bit per signature: a variable only if every signature
        capturing it reads it through 16-bit Casts only."""
        votes: dict[int, bool] = {}
        for signature in self.source.signatures:
            plans = rewritten[signature.name].plans
            for capture in signature.captures:
                plan = plans.get(capture.placeholder.split(":")[0])
                if plan is not None:
                    votes[id(capture.variable)] = votes.get(id(capture.variable), True) and (
                        plan.to_16bit)
        return {s.name: {c.placeholder.split(":")[0] for c in s.captures
                         if c.variable is not None and votes.get(id(c.variable))}
                for s in self.source.signatures}

    def _flat_batches(self, signature: Signature) -> list[list]:
        order = list(getattr(signature.function, "_arg_keywords", None) or
                     sorted(signature.input_specs))
        return [[batch[name] for name in order] for batch in self.checks[signature.name].batches]

    # -- the result --------------------------------------------------------------

    def tracked(self, attempt: _Attempt) -> dict[str, list]:
        """What the saved module must hold: 16-bit and float32 variables, other resources."""
        weights16, weights32, owners = {}, {}, {}
        for signature in self.source.signatures:
            stored = attempt.stored[signature.name]
            for capture in signature.captures:
                if capture.variable is not None:
                    if capture.placeholder.split(":")[0] in stored:
                        new = self._new_variables[(id(capture.variable), attempt.config.dtype)]
                        weights16[id(new)] = new
                    else:
                        weights32[id(capture.variable)] = capture.variable
                elif capture.owner is not None:
                    owners[id(capture.owner)] = capture.owner
        return {"weights_16bit": list(weights16.values()),
                "weights_float32": list(weights32.values()),
                "resources": list(owners.values())}

    def verifier(self, attempt: _Attempt):
        def verify(folder: Path) -> None:
            import tensorflow as tf

            loaded = tf.saved_model.load(str(folder))
            for signature in self.source.signatures:
                function = loaded.signatures[signature.name]
                for batch, expected in zip(self.checks[signature.name].batches,
                                           attempt.outputs[signature.name], strict=True):
                    got = _outputs(function, batch)
                    if not all(np.array_equal(a, b, equal_nan=a.dtype.kind == "f")
                               for a, b in zip(got, expected, strict=True)):
                        raise ExportError(
                            f"the written SavedModel's signature {signature.name!r} does not "
                            f"reproduce the checked outputs; nothing was written (report "
                            f"this to tfamp)")
        return verify

    def report(self, attempt: _Attempt, kept: list[locate.Kept],
               destination: Path) -> ExportReport:
        rows = []
        dtype_bytes = 2
        unique: dict[int, tuple[int, int]] = {}
        for signature in self.source.signatures:
            entry = attempt.rewritten[signature.name]
            stored = attempt.stored[signature.name]
            removed = sum(len(p.casts) for name, p in entry.plans.items() if name in stored)
            before = after = 0
            float32 = []
            for capture in signature.captures:
                variable = capture.variable
                if variable is None:
                    continue
                size = variable.shape.num_elements() or 0
                width = variable.dtype.size
                before += size * width
                name = capture.placeholder.split(":")[0]
                unique[id(variable)] = (size * width,
                                        size * (dtype_bytes if name in stored else width))
                if name in stored:
                    after += size * dtype_bytes
                else:
                    after += size * width
                    plan = entry.plans.get(name)
                    float32.append((_variable_name(variable, plan),
                                    plan.reason if plan else "not a weight tfamp reads"))
            graph_def = attempt.graph_defs[signature.name]
            rows.append(SignatureReport(
                name=signature.name, inputs=self.checks[signature.name].note,
                rewrite=entry.report, weight_casts_removed=removed,
                casts_remaining=entry.report.casts_inserted - removed,
                weight_casts_remaining=len(weight_casts(graph_def)),
                weights_16bit=sum(1 for c in signature.captures if c.variable is not None
                                  and c.placeholder.split(":")[0] in stored),
                weights_float32=float32, weight_bytes_before=before, weight_bytes_after=after,
                accuracy=attempt.errors[signature.name]))
        return ExportReport(
            source=str(self.source.path), source_kind=self.source.kind,
            destination=str(destination), dtype=attempt.config.dtype,
            tolerance=self.tolerance, signatures=rows, kept_fp32=kept,
            search=dict(self.search),
            weight_bytes_before=sum(b for b, _ in unique.values()),
            weight_bytes_after=sum(a for _, a in unique.values()),
            variables_bytes_before=self.source.variables_bytes_on_disk(),
            source_note=self.source.note)


def _outputs(function, batch: dict[str, Any]) -> list[np.ndarray]:
    import tensorflow as tf

    return [np.asarray(t) for t in tf.nest.flatten(function(**batch))]


def _variable_name(variable, plan) -> str:
    name = variable.name.split(":")[0]
    if plan is not None and plan.read_by and (not name or name.startswith("Variable")):
        return plan.read_by
    return name


def _failure_message(report: ExportReport, attempt: _Attempt) -> str:
    bad = [row for s in report.signatures for row in s.accuracy if not row.within]
    row = bad[0]
    what = (f"{row.nonfinite_new} non-finite values where float32 has none" if
            row.nonfinite_new else f"max relative error {row.max_rel:.2%} > tolerance "
            f"{report.tolerance:.2%}")
    kept = (f" even with {len(report.kept_fp32)} layer(s) kept float32 "
            f"({', '.join(k.layer for k in report.kept_fp32[:3])})" if report.kept_fp32 else "")
    other = "bfloat16 (--dtype bfloat16), " if report.dtype == "float16" else ""
    return (f"output {row.output!r} of signature {row.signature!r} is not within tolerance"
            f"{kept}: {what}; nothing was written. Try {other}a larger --tolerance if this "
            f"error is acceptable, --keep-fp32 REGEX for the layers you know are sensitive, "
            f"or --inputs FILE.npz with real data (random inputs can exaggerate errors)")
