"""Shrinking a failing program: delta debugging over its statements and features.

The edits (each keeps a program valid, see ``grammar``): remove a statement
(what read it reads its first input), replace a block by its body, and drop a
feature of the step (the tape, the optimizer, extra outputs, the unknown
batch dimension). ``shrink`` first removes chunks of statements (halves,
quarters, ... as ddmin does), then applies single edits until none keeps the
failure: the result is 1-minimal. A candidate "keeps the failure" when it
shows a failure with the same signature (invariant, dtype, and for an
exception its type and the tfamp function it came from).

Run as ``python -m tests.progen.shrink --seed N --out DIR`` (or ``--file F``)
to shrink a program and write it as a regression file.
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import sys
import time
from collections.abc import Callable, Iterator

from tests.progen.grammar import Program, generate

log = logging.getLogger("tests.progen")

Predicate = Callable[[Program], bool]


def shrink(program: Program, fails: Predicate, budget_s: float = 1800.0) -> Program:
    """The smallest program found that still `fails` (`program` itself fails).

    Args:
      program: a failing program.
      fails: whether a candidate shows the same failure.
      budget_s: stop looking after this many seconds (the best so far is kept).
    """
    deadline = time.monotonic() + budget_s
    best = program
    tried: set[str] = {program.to_json()}

    def attempt(candidate: Program | None) -> bool:
        nonlocal best
        if candidate is None or time.monotonic() > deadline:
            return False
        text = candidate.to_json()
        if text in tried:
            return False
        tried.add(text)
        if fails(candidate):
            log.info("shrink: %d -> %d statements", best.size(), candidate.size())
            best = candidate
            return True
        return False

    # ddmin: remove chunks of statements, coarse to fine.
    chunks = 2
    while best.size() >= 1 and time.monotonic() < deadline:
        count = best.size()
        size = max(1, count // chunks)
        removed = False
        for start in range(0, count, size):
            if attempt(remove_statements(best, range(start, min(count, start + size)))):
                removed = True
                break
        if removed:
            chunks = max(2, chunks - 1)
        elif size == 1:
            break
        else:
            chunks = min(count, chunks * 2)
    # 1-minimal: single edits until none keeps the failure.
    changed = True
    while changed and time.monotonic() < deadline:
        changed = any(attempt(candidate) for candidate in edits(best))
    return best


def edits(program: Program) -> Iterator[Program]:
    """Every single simplification of `program`, smallest result first."""
    for index in range(program.size()):
        yield remove_statements(program, [index])
    for index, (stmt, _) in enumerate(program.walk()):
        if stmt.body is not None:
            yield unwrap(program, index)
    yield from _feature_edits(program)


def _feature_edits(program: Program) -> Iterator[Program]:
    def changed(**fields) -> Program:
        copy = program.copy()
        for key, value in fields.items():
            setattr(copy, key, value)
        return copy

    if program.tape:
        yield changed(tape=False, optimizer="none", loss="mse", aux="")
    if program.optimizer not in ("none",):
        yield changed(optimizer="none")
    if program.optimizer not in ("none", "manual_sgd", "sgd"):
        yield changed(optimizer="sgd")
    if program.outputs:
        yield changed(outputs=[])
    if program.int_output:
        yield changed(int_output=False)
    if program.dynamic_batch:
        yield changed(dynamic_batch=False)
    if program.loss != "mse":
        yield changed(loss="mse", aux="")


def remove_statements(program: Program, indices) -> Program | None:
    """A copy without the statements at walk positions `indices` (and their bodies)."""
    copy = program.copy()
    found = list(copy.walk())
    targets = [found[i] for i in sorted(set(indices), reverse=True) if i < len(found)]
    if not targets:
        return None
    for stmt, holder in targets:
        if not any(s is stmt for s in holder):
            continue  # (inside a block removed already)
        holder[:] = [s for s in holder if s is not stmt]
        _rename(copy, stmt.out, stmt.args[0])
    return copy


def unwrap(program: Program, index: int) -> Program | None:
    """A copy in which the block at walk position `index` is replaced by its body."""
    copy = program.copy()
    stmt, holder = list(copy.walk())[index]
    if stmt.body is None:
        return None
    inner = stmt.body
    for s in inner:
        s.args = [stmt.args[0] if a == "@in" else a for a in s.args]
    position = next(i for i, s in enumerate(holder) if s is stmt)
    holder[position:position + 1] = inner
    _rename(copy, stmt.out, inner[-1].out if inner else stmt.args[0])
    return copy


def _rename(program: Program, old: str, new: str) -> None:
    """Every read of value `old` reads `new` instead."""
    for stmt, _ in program.walk():
        stmt.args = [new if a == old else a for a in stmt.args]
    program.outputs = list(dict.fromkeys(new if o == old else o for o in program.outputs))
    if program.aux == old:
        program.aux = new


# -- with the invariants: what a failure is, and the command line ---------------------

def failures_of(program: Program, configs=None, numerics: bool = True) -> dict[tuple, object]:
    """Signature -> the first ``invariants.Failure`` with it, of `program`."""
    from tests.progen import invariants, source

    module = source.load(source.render(program, "candidate"))
    outcome = invariants.check(module, configs or invariants.CONFIGS, numerics=numerics)
    found: dict[tuple, object] = {}
    for failure in outcome.failures:
        found.setdefault(failure.signature(), failure)
    return found


def shrink_failure(program: Program, failure,
                   budget_s: float = 1800.0) -> tuple[Program, object]:
    """(`program` shrunk while it shows `failure`, the failure the small one shows)."""
    from tests.progen import invariants

    signature = failure.signature()
    configs = [c for c in invariants.CONFIGS if str(c) == failure.config] or None
    numerics = failure.invariant in ("numerics", "nonfinite", "runs", "output_dtype")
    shown = {program.to_json(): failure}

    def fails(candidate: Program) -> bool:
        try:
            found = failures_of(candidate, configs, numerics).get(signature)
        except Exception:  # (a candidate the harness cannot even build)
            log.exception("shrink: candidate failed to build")
            return False
        if found is not None:
            shown[candidate.to_json()] = found
        return found is not None

    small = shrink(program, fails, budget_s)
    return small, shown[small.to_json()]


def regression_source(program: Program, failure, original_size: int, note: str = "") -> str:
    """The shrunk program as a regression file (`failure`: what it showed)."""
    from tests.progen import source

    doc = (f"Shrunk by tests/progen from generated program {program.seed} "
           f"({original_size} statements -> {program.size()}).{note}\n\n"
           f"Failed: {failure}\n\n"
           f"Run: python <this file>   (checks the invariants; exit status 1 on a failure)")
    return source.render(program, doc)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--seed", type=int, help="a generated program's seed")
    where.add_argument("--file", type=pathlib.Path, help="a program file (its SPEC)")
    parser.add_argument("--out", type=pathlib.Path, required=True,
                        help="folder for the shrunk program")
    parser.add_argument("--budget", type=float, default=1800.0, help="seconds at most")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from tests.progen import invariants, source

    if args.file:
        program = Program.from_json(source.load(args.file.read_text()).SPEC)
    else:
        program = generate(args.seed)
    outcome = invariants.check(source.load(source.render(program, "original")))
    if outcome.ok:
        print(f"program {program.seed} passes: nothing to shrink")
        return 0
    failure = outcome.failures[0]
    print(f"shrinking program {program.seed} ({program.size()} statements): {failure}")
    small, shown = shrink_failure(program, failure, args.budget)
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"{failure.invariant}_{failure.config.split('/')[0]}_{program.seed}.py"
    path = args.out / name
    path.write_text(regression_source(small, shown, program.size()))
    print(f"wrote {path} ({small.size()} statements)")
    return 1


if __name__ == "__main__":
    sys.exit(main())
