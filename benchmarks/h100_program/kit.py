"""A kit for a lent GPU machine: the run's mixed programs and the script that times them.

A lent machine has JAX but no TensorFlow, receives the checkout (and the git-ignored folders
a call names in the device tool's ``carry``), and is lent for minutes. ``--kit DIR`` (a
folder inside the checkout that git ignores) writes there what one call needs:

- ``hlo/TAG.hlo.pb.gz``: every Keras and tfamp program of the run, gzipped (3-5 MB for a
  model's four; the exports before XLA's optimisations, as ``time_on_gpu.py`` reads them);
- ``go.sh``: run from the checkout's root there, ``bash DIR/go.sh NAME [MODEL ...]`` times
  each named model's programs with ``time_on_gpu.py`` in alternating rounds and writes
  ``$OUT/NAME.json``. Keras's program of each dtype comes first: tfamp's programs of the
  same model then reuse its autotuning and compile in seconds.

Plan the calls by the Keras programs' compiles (``COMPILE_SECONDS``, measured with
autotuning on lent H100s): one call may run 10 minutes.
"""

from __future__ import annotations

import gzip
import os
import shlex
import shutil

from benchmarks.h100_program import plan

#: seconds to compile one Keras program of a model with autotuning on a lent H100
#: (sessions 21, 22, 28); tfamp's programs compile in 4-16 s after it
COMPILE_SECONDS = {"resnet50": 17, "mobilenetv2": 90, "efficientnetb0": 120, "bert": 22,
                   "lstm": 7}

_GO = """#!/bin/bash
# Times this kit's programs on a lent GPU machine (JAX, no TensorFlow). From the checkout's
# root there: bash {kit}/go.sh NAME [MODEL ...]  -> $OUT/NAME.json (default: every model).
# Keras's programs compile with autotuning for about {plan}; one call may run 10 minutes.
kit=$(cd "$(dirname "$0")" && pwd)
name=${{1:?usage: bash go.sh NAME [MODEL ...]}}; shift
declare -A programs=(
{table})
models=("$@"); [ ${{#models[@]}} -gt 0 ] || models=({models})
list=""
for m in "${{models[@]}}"; do
  [ -n "${{programs[$m]:-}}" ] || {{ echo "go.sh: no programs of $m in this kit" >&2; exit 2; }}
  list="$list${{list:+,}}${{programs[$m]}}"
done
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu \\
  --format=csv,noheader
cd benchmarks/h100_program || exit 1
PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda TF_CPP_MIN_LOG_LEVEL=2 python3 time_on_gpu.py \\
  --hlo "$kit/hlo" --programs "$list" --rounds 4 --steps 15 --out "${{OUT:-.}}/$name.json" \\
  2>&1 | grep --line-buffered -v "^[WI][0-9]\\{{4\\}} "
status=${{PIPESTATUS[0]}}  # (time_on_gpu.py's; the filter's is 1 when it passes no line)
nvidia-smi --query-gpu=clocks.sm,temperature.gpu,clocks_throttle_reasons.active \\
  --format=csv,noheader
exit $status
"""


def ordered(rows: list[dict]) -> dict[str, list[dict]]:
    """Each model's mixed programs (Keras's and tfamp's) in the run's order, which is
    Keras's of a dtype before tfamp's (``plan.modes_for``). Rows that failed, and
    float32's, are left out."""
    by_model: dict[str, list[dict]] = {}
    for row in rows:
        if "error" not in row and "hlo" in row and plan.MODES[row["mode"]].side != "float32":
            by_model.setdefault(row["model"], []).append(row)
    return by_model


class KitError(ValueError):
    """No kit can be made from the run; the message says why."""


def write(folder: str, rows: list[dict]) -> list[str]:
    """Writes the kit for `rows` (``cli.measure``'s, each with its ``hlo`` path) into
    `folder`, replacing a previous kit there; returns the programs' tags in order.

    The folder gets a ``.gitignore`` of ``*``: git ignores the kit, and the device
    tool's ``carry`` takes it along."""
    by_model = ordered(rows)
    if not by_model:
        raise KitError("--kit: the run compiled no Keras or tfamp program to put in it "
                         "(every row failed, or only float32 was asked for)")
    hlo_dir = os.path.join(folder, "hlo")
    shutil.rmtree(hlo_dir, ignore_errors=True)
    os.makedirs(hlo_dir)
    with open(os.path.join(folder, ".gitignore"), "w") as f:
        f.write("# a GPU kit (benchmarks/h100_program/kit.py): not for the repository\n*\n")
    tags = []
    for model_rows in by_model.values():
        for row in model_rows:
            with open(row["hlo"], "rb") as src, \
                    gzip.open(os.path.join(hlo_dir, row["program"] + ".hlo.pb.gz"), "wb") as dst:
                shutil.copyfileobj(src, dst)
            tags.append(row["program"])
    table = "".join(f"  [{model}]={shlex.quote(','.join(r['program'] for r in model_rows))}\n"
                    for model, model_rows in by_model.items())
    plan = ", ".join(f"{m} {COMPILE_SECONDS.get(m, 60)} s each" for m in by_model)
    with open(os.path.join(folder, "go.sh"), "w") as f:
        f.write(_GO.format(kit=os.path.basename(os.path.abspath(folder)), plan=plan,
                           table=table, models=" ".join(by_model)))
    return tags
