"""Many generated programs in worker processes: the long mode.

``python -m tests.progen --count 1000 --seed 1 --jobs 2 --out DIR`` checks
programs ``program_seed(1, 0..999)``. Each worker is a fresh interpreter that
checks programs one at a time (TensorFlow keeps every function it registers,
so a worker is replaced after ``--per-worker`` programs); a program that runs
past ``--timeout`` or kills its worker counts as a failure. Every failing
program is then shrunk (``shrink``, in a process of its own) and written to
``DIR`` as a regression file; ``DIR/summary.json`` holds the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import selectors
import statistics
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[2]


def program_seed(run_seed: int, index: int) -> int:
    """The seed of program `index` of a run (stable across versions and machines)."""
    return (run_seed * 1_000_003 + index) % (2 ** 31 - 1)


@dataclasses.dataclass
class Result:
    seed: int
    ok: bool
    seconds: float
    failures: list[str]
    signatures: list[list[str]]
    compared: int = 0
    skipped: int = 0
    max_ratio: float = 0.0
    size: int = 0
    features: dict = dataclasses.field(default_factory=dict)
    errors: list = dataclasses.field(default_factory=list)  # see invariants.Outcome
    unjudged_nonfinite: int = 0
    retried: int = 0  # checked again after a transient oneDNN error (TRANSIENT_ERRORS)
    compiled: int = 0  # XLA configurations run compiled by XLA (see invariants.Outcome)
    not_compiled: int = 0  # ... and run on the executor (XLA does not compile float32's)
    refused: str = ""  # TensorFlow's own float32 run failed (see invariants.Outcome)


# TensorFlow's oneDNN CPU convolutions (mkl_conv_ops.cc) now and then fail to
# make a primitive: an AbortedError saying "could not create a primitive
# descriptor for the reorder primitive", in the float32 runs too, so not the
# rewrite's. Mostly it passes when checked again (13000717, 13000724, 14000461,
# 15000135, 17000273); it depends on what the process ran before (17000224 fails
# in every full check, and passes with TF_ENABLE_ONEDNN_OPTS=0 or shrunk to its
# depthwise convolution alone). A program whose only failures are such errors is
# checked once more, and its result says so (``retried``).
TRANSIENT_ERRORS = ("could not create a primitive descriptor",)


def is_transient(failures, refused: str = "") -> bool:
    """True if every failure (and TensorFlow's own refusal, if any) is one of
    TensorFlow's transient oneDNN errors."""
    texts = [str(f) for f in failures] + ([refused] if refused else [])
    return bool(texts) and all("AbortedError" in t and any(e in t for e in TRANSIENT_ERRORS)
                               for t in texts)


def check_seed(seed: int, compiled_reference: bool = True) -> Result:
    """Generates and checks one program (in this process). Without
    `compiled_reference` its XLA configurations run on the executor, and the
    result says why (``COMPILE_KILLS``)."""
    from tests.progen import grammar, invariants, source

    program = grammar.generate(seed)
    text = source.render(program, f"generated program {seed}")
    outcome = invariants.check(source.load(text), compiled_reference=compiled_reference)
    retried = 0
    if is_transient(outcome.failures, outcome.refused):
        retried = 1
        outcome = invariants.check(source.load(text),  # (a fresh build of the program)
                                   compiled_reference=compiled_reference)
    if not compiled_reference:
        outcome.refused = "; ".join(filter(None, [COMPILE_KILLS, outcome.refused]))
    return Result(seed, outcome.ok, outcome.seconds, [str(f) for f in outcome.failures],
                  [list(f.signature()) for f in outcome.failures], outcome.compared,
                  outcome.skipped, max(outcome.ratios, default=0.0), program.size(),
                  program.features(), [[round(a, 3), round(b, 3)] for a, b in outcome.errors],
                  outcome.unjudged_nonfinite, retried, outcome.compiled,
                  outcome.not_compiled, outcome.refused)


COMPILE_KILLS = ("XLA's compile of the float32 step kills the process (inside "
                 "TensorFlow): the XLA configurations ran on the executor")


def _worker() -> int:
    """Reads seeds (one per line; "SEED executor": without the compiled float32
    reference) from stdin, writes one JSON Result per line."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # (anything else printing goes to stderr)
    for line in sys.stdin:
        seed, *mode = line.split()
        seed = int(seed)
        try:
            result = check_seed(seed, compiled_reference=mode != ["executor"])
        except Exception as err:  # (a harness error: reported, the worker goes on)
            result = Result(seed, False, 0.0, [f"[harness] {type(err).__name__}: {err}"],
                            [["harness", "", type(err).__name__]])
        out.write(json.dumps(dataclasses.asdict(result)) + "\n")
    return 0


def _float32_compiled(seed: int) -> int:
    """Runs program `seed`'s float32 step compiled by XLA, nothing else."""
    from tests.progen import grammar, invariants, source

    module = source.load(source.render(grammar.generate(seed), f"generated program {seed}"))
    invariants.run_compiled_float32(module)
    return 0


def _child(args: list[str], nice: int, **kwargs) -> subprocess.CompletedProcess:
    """This module run in a child process (as a worker is), to completion."""
    return subprocess.run(
        [sys.executable, "-m", "tests.progen.longrun", *args], cwd=REPO, text=True,
        env=_env(), stderr=subprocess.DEVNULL, check=False,
        preexec_fn=(lambda: os.nice(nice)) if nice else None, **kwargs)


def _env() -> dict:
    """The environment of the worker processes."""
    return {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(REPO)}


def after_crash(seed: int, seconds: float, nice: int = 0, timeout: float = 900.0) -> Result:
    """The result of program `seed`, whose worker died.

    A process that only compiles the float32 step with XLA is run first: where
    it dies too, the crash is TensorFlow's own, not the rewrite's (53000581: a
    segmentation fault in XLA's compile of a float32 step, session 38), and the
    program is checked again with its XLA configurations on the executor (its
    ``refused`` says so). Any other death is a crash failure."""
    crashed = Result(seed, False, seconds, ["[crash] the worker process died"],
                     [["crash", "", ""]])
    try:
        alone = _child(["--float32-compiled", str(seed)], nice, timeout=timeout,
                       stdout=subprocess.DEVNULL)
        if alone.returncode >= 0:  # (it survives: the worker died elsewhere)
            return crashed
        again = _child(["--worker"], nice, input=f"{seed} executor\n", timeout=timeout,
                       stdout=subprocess.PIPE)
    except subprocess.TimeoutExpired:
        return crashed
    lines = again.stdout.splitlines()
    if again.returncode != 0 or not lines:
        return crashed
    return Result(**json.loads(lines[-1]))


class _Worker:
    def __init__(self, nice: int):
        cmd = [sys.executable, "-m", "tests.progen.longrun", "--worker"]
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True, env=_env(),
            preexec_fn=(lambda: os.nice(nice)) if nice else None)
        self.done = 0
        self.seed: int | None = None
        self.started = 0.0

    def give(self, seed: int) -> None:
        self.seed, self.started = seed, time.monotonic()
        self.proc.stdin.write(f"{seed}\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()  # (our own child, by its handle)
        self.proc.wait()


def run(count: int, seed: int, jobs: int = 1, timeout: float = 900.0, per_worker: int = 40,
        nice: int = 0, progress=None) -> list[Result]:
    """Checks `count` programs of run `seed` in `jobs` worker processes."""
    pending = [program_seed(seed, i) for i in range(count)]
    pending.reverse()
    results: list[Result] = []
    workers: list[_Worker] = []
    selector = selectors.DefaultSelector()

    def start() -> None:
        worker = _Worker(nice)
        workers.append(worker)
        selector.register(worker.proc.stdout, selectors.EVENT_READ, worker)
        worker.give(pending.pop())

    def retire(worker: _Worker) -> None:
        selector.unregister(worker.proc.stdout)
        worker.stop()
        workers.remove(worker)

    while pending or workers:
        while pending and len(workers) < jobs:
            start()
        events = selector.select(timeout=5.0)
        for key, _ in events:
            worker = key.data
            line = worker.proc.stdout.readline()
            if not line:  # (the worker died)
                seed, seconds = worker.seed, time.monotonic() - worker.started
                retire(worker)
                results.append(after_crash(seed, seconds, nice, timeout))
            else:
                results.append(Result(**json.loads(line)))
                worker.done += 1
                if worker.done >= per_worker or not pending:
                    retire(worker)
                else:
                    worker.give(pending.pop())
            if progress:
                progress(results[-1], len(results), count)
        now = time.monotonic()
        for worker in [w for w in workers if now - w.started > timeout]:
            results.append(Result(worker.seed, False, now - worker.started,
                                  [f"[timeout] over {timeout:.0f} s"], [["timeout", "", ""]]))
            retire(worker)
    return results


def summary(results: list[Result], seconds: float) -> dict:
    failed = [r for r in results if not r.ok]
    times = sorted(r.seconds for r in results)
    features: dict[str, int] = {}
    for r in results:
        for name in r.features:
            features[name] = features.get(name, 0) + 1
    return {
        "programs": len(results), "failed": len(failed), "wall_seconds": round(seconds, 1),
        "program_seconds": {"median": round(statistics.median(times), 2) if times else None,
                            "p90": round(times[int(0.9 * (len(times) - 1))], 2) if times else None,
                            "max": round(times[-1], 2) if times else None,
                            "total": round(sum(times), 1)},
        "outputs_compared": sum(r.compared for r in results),
        "outputs_ill_conditioned": sum(r.skipped for r in results),
        "unjudged_outputs_not_finite": sum(r.unjudged_nonfinite for r in results),
        "programs_with_unjudged_not_finite": sorted(r.seed for r in results
                                                    if r.unjudged_nonfinite),
        "max_error_to_bound": round(max((r.max_ratio for r in results), default=0.0), 4),
        "retried_after_transient_errors": sorted(r.seed for r in results if r.retried),
        # (programs TensorFlow's own float32 run fails: rewrite checked, runs not)
        "tensorflow_refuses": {r.seed: r.refused for r in results if r.refused},
        "xla_runs_compiled": sum(r.compiled for r in results),
        "xla_runs_on_the_executor": sum(r.not_compiled for r in results),
        "statements": sum(r.size for r in results),
        "programs_with_feature": dict(sorted(features.items())),
        "failures": {r.seed: r.failures for r in failed},
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.progen", description="Check many generated programs.")
    parser.add_argument("--count", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds one program may take")
    parser.add_argument("--per-worker", type=int, default=40)
    parser.add_argument("--nice", type=int, default=0, help="run the workers niced")
    parser.add_argument("--out", type=pathlib.Path, default=pathlib.Path("progen_out"))
    parser.add_argument("--no-shrink", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--float32-compiled", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _worker()
    if args.float32_compiled is not None:
        return _float32_compiled(args.float32_compiled)
    args.out.mkdir(parents=True, exist_ok=True)
    log_file = (args.out / "results.jsonl").open("a")  # noqa: SIM115 (open for the run)

    def progress(result: Result, done: int, total: int) -> None:
        log_file.write(json.dumps(dataclasses.asdict(result)) + "\n")
        log_file.flush()
        mark = "ok" if result.ok else "FAILED " + "; ".join(result.failures)[:300]
        if result.refused:
            mark += f" (TensorFlow's float32 run fails: {result.refused[:200]})"
        print(f"[{done}/{total}] program {result.seed}: {mark} ({result.seconds:.1f} s)",
              flush=True)

    start = time.monotonic()
    results = run(args.count, args.seed, args.jobs, args.timeout, args.per_worker, args.nice,
                  progress)
    figures = summary(results, time.monotonic() - start)
    if not args.no_shrink:
        for result in (r for r in results if not r.ok and r.signatures[0][0] not in
                       ("timeout", "crash", "harness")):
            subprocess.run([sys.executable, "-m", "tests.progen.shrink", "--seed",
                            str(result.seed), "--out", str(args.out / "shrunk")],
                           cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, check=False)
    (args.out / "summary.json").write_text(json.dumps(figures, indent=1))
    print(json.dumps({k: v for k, v in figures.items() if k != "failures"}, indent=1))
    print(f"{figures['failed']} of {figures['programs']} programs failed")
    return 1 if figures["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
