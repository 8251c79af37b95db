"""Does tfamp's own XLA estimate rank programs the way the compiled H100 program does?

tfamp chooses between placements of its Casts by an estimate of what XLA:GPU pays
(``tfamp.rewrite.runtime_cost``): bytes at fusion boundaries plus ``launch_bytes`` per fused
kernel. The compiled program says what XLA really launches and moves, and the benchmark's
fitted time estimate (``estimate.py``, calibrated on measured H100 steps) what that costs.

For each model and dtype this compares the programs of one step -- Keras's policy, tfamp, and
tfamp with its Casts placed for the executor instead (a placement tfamp's XLA estimate
rejects) -- two ways:

* **ranking**: for each pair of those programs, does tfamp's estimate order them as the
  compiled program's estimated time does (and its bytes, and its kernels)? A pair whose
  compiled times are within ``TIE`` of each other agrees whatever the estimate says.
* **share**: tfamp's estimated cost as a share of the float32 step's, against the compiled
  programs' estimated time share.

and it *learns* the one free number of tfamp's estimate, the price of a kernel in bytes:
``fit_launch_bytes`` picks the price at which tfamp's shares best match the compiled ones,
to set against ``runtime_cost.XLA.launch_bytes``. Pure Python, no TensorFlow.
"""

from __future__ import annotations

import itertools
import json
import math
import os

#: compiled estimated times this close count as a tie: the pair agrees whatever the estimate
TIE = 0.005
#: the launch prices (bytes per kernel) the fit tries: 0.25 MB to 64 MB, 2^(1/8) apart
LAUNCH_GRID = tuple(int(0.25e6 * 2 ** (i / 8)) for i in range(8 * 8 + 1))
#: the programs of a group that are compared (float32 is the reference of the shares)
MIXED = ("keras", "tfamp", "tfamp_exec")
#: the last ``--agreement`` run's rows, which ``tests/test_h100_program.py`` fits again to
#: check that ``runtime_cost.XLA`` carries the learned price
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "h100_agreement.json")
#: what a row keeps in that file
_KEPT = ("program", "model", "mode", "label", "estimate_ms", "bytes", "kernels",
         "tfamp_estimate")


def save(rows: list[dict], facts: dict, path: str = DATA) -> None:
    """Writes the rows ``groups`` reads (and where they came from) to `path`."""
    kept = [{k: r[k] for k in _KEPT} for r in rows if "error" not in r and r.get("tfamp_estimate")]
    with open(path, "w") as f:
        json.dump({**facts, "rows": kept}, f, indent=1)
        f.write("\n")


def load(path: str = DATA) -> dict:
    with open(path) as f:
        return json.load(f)


def _role(mode: str) -> str:
    if mode == "fp32":
        return "float32"
    if mode.startswith("keras"):
        return "keras"
    return "tfamp_exec" if mode.endswith("_exec") else "tfamp"


def _dtype(mode: str) -> str | None:
    if mode == "fp32":
        return None
    return "bfloat16" if "bf16" in mode else "float16"


def groups(rows: list[dict]) -> dict[tuple[str, str], dict[str, dict]]:
    """{(model, dtype): {role: row}} of the rows that have both a compiled program and
    tfamp's estimate; float32's row joins every dtype of its model."""
    usable = [r for r in rows if "error" not in r and r.get("tfamp_estimate")]
    out: dict[tuple[str, str], dict[str, dict]] = {}
    for r in usable:
        dtype = _dtype(r["mode"])
        if dtype is not None:
            out.setdefault((r["model"], dtype), {})[_role(r["mode"])] = r
    for r in usable:
        if r["mode"] == "fp32":
            for (model, _), group in out.items():
                if model == r["model"]:
                    group["float32"] = r
    return {k: g for k, g in out.items() if "float32" in g}


def estimated_cost(row: dict, launch_bytes: float) -> float:
    est = row["tfamp_estimate"]
    return est["fused_bytes"] + launch_bytes * est["fused_kernels"]


def _order(a: float, b: float, tie: float = 0.0) -> int:
    if abs(a - b) <= tie * max(abs(a), abs(b)):
        return 0
    return -1 if a < b else 1


def pairs(group: dict[str, dict], launch_bytes: float) -> list[dict]:
    """Each pair of the group's mixed programs: the estimate's order and the compiled ones."""
    out = []
    for a, b in itertools.combinations([m for m in MIXED if m in group], 2):
        ra, rb = group[a], group[b]
        est = _order(estimated_cost(ra, launch_bytes), estimated_cost(rb, launch_bytes))
        compiled = _order(ra["estimate_ms"], rb["estimate_ms"], TIE)
        out.append({
            "pair": (a, b), "estimate": est, "compiled_time": compiled,
            "agrees_time": compiled == 0 or est == compiled,
            "agrees_bytes": _agrees(ra["tfamp_estimate"]["fused_bytes"],
                                    rb["tfamp_estimate"]["fused_bytes"], ra["bytes"], rb["bytes"]),
            "agrees_kernels": _agrees(ra["tfamp_estimate"]["fused_kernels"],
                                      rb["tfamp_estimate"]["fused_kernels"], ra["kernels"],
                                      rb["kernels"]),
        })
    return out


def _agrees(est_a, est_b, compiled_a, compiled_b) -> bool:
    compiled = _order(compiled_a, compiled_b, TIE)
    return compiled == 0 or _order(est_a, est_b) == compiled


def shares(group: dict[str, dict], launch_bytes: float) -> dict[str, tuple[float, float]]:
    """{role: (tfamp's estimated share of float32's cost, the compiled time share)}."""
    base = group["float32"]
    base_cost = estimated_cost(base, launch_bytes)
    return {m: (estimated_cost(group[m], launch_bytes) / base_cost,
                group[m]["estimate_ms"] / base["estimate_ms"]) for m in MIXED if m in group}


def share_error(all_groups, launch_bytes: float) -> float:
    """Mean |log(estimated share / compiled time share)| over every mixed program."""
    logs = [abs(math.log(e / c)) for g in all_groups.values()
            for e, c in shares(g, launch_bytes).values()]
    return sum(logs) / len(logs) if logs else math.nan


def fit_launch_bytes(all_groups) -> int:
    """The price of a kernel (bytes) at which tfamp's shares best match the compiled ones."""
    return min(LAUNCH_GRID, key=lambda price: share_error(all_groups, price))


def summary(all_groups, launch_bytes: float) -> dict:
    """Agreement and share error at one price."""
    every = [p for g in all_groups.values() for p in pairs(g, launch_bytes)]
    err = share_error(all_groups, launch_bytes)
    return {"launch_bytes": int(launch_bytes), "pairs": len(every),
            "agree_time": sum(p["agrees_time"] for p in every),
            "agree_bytes": sum(p["agrees_bytes"] for p in every),
            "agree_kernels": sum(p["agrees_kernels"] for p in every),
            "share_error": math.expm1(err)}  # (the mean |log ratio| as a factor - 1)


def report(rows: list[dict], tfamp_launch_bytes: int) -> dict:
    all_groups = groups(rows)
    fitted = fit_launch_bytes(all_groups) if all_groups else None
    table = []
    for (model, dtype), g in sorted(all_groups.items()):
        for role, (est, compiled) in shares(g, tfamp_launch_bytes).items():
            r = g[role]
            table.append({"model": model, "dtype": dtype, "program": r["program"],
                          "label": r["label"], "estimated_share": est,
                          "compiled_time_share": compiled,
                          "bytes_share": r["bytes"] / g["float32"]["bytes"],
                          "estimated_bytes_share": (r["tfamp_estimate"]["fused_bytes"] /
                                                    g["float32"]["tfamp_estimate"]["fused_bytes"]),
                          "kernels": r["kernels"],
                          "estimated_kernels": r["tfamp_estimate"]["fused_kernels"]})
    return {"table": table, "at_tfamp_price": summary(all_groups, tfamp_launch_bytes),
            "fitted_launch_bytes": fitted,
            "at_fitted_price": summary(all_groups, fitted) if fitted else None,
            "disagreements": [
                {"model": k[0], "dtype": k[1], **p} for k, g in sorted(all_groups.items())
                for p in pairs(g, tfamp_launch_bytes) if not p["agrees_time"]]}


def render(rep: dict) -> str:
    lines = ["tfamp's own XLA estimate against the compiled programs (share of float32's step):",
             "",
             "| program | est. cost share | compiled est-ms share | est. bytes share | "
             "compiled bytes share | est. kernels | compiled kernels |",
             "|---|---|---|---|---|---|---|"]
    for r in rep["table"]:
        lines.append(f"| {r['program']} | {r['estimated_share']:.3f} | "
                     f"{r['compiled_time_share']:.3f} | {r['estimated_bytes_share']:.3f} | "
                     f"{r['bytes_share']:.3f} | {r['estimated_kernels']} | {r['kernels']} |")
    lines.append("")
    for key, label in (("at_tfamp_price", "tfamp's price"), ("at_fitted_price", "fitted price")):
        s = rep.get(key)
        if not s:
            continue
        lines.append(
            f"At {label} ({s['launch_bytes'] / 1e6:.2f} MB per kernel): {s['agree_time']} of "
            f"{s['pairs']} pairs ranked as the compiled time (bytes {s['agree_bytes']}, kernels "
            f"{s['agree_kernels']}); share error mean {s['share_error']:.1%}")
    for d in rep["disagreements"]:
        lines.append(f"  disagrees: {d['model']} {d['dtype']} {d['pair'][0]} vs {d['pair'][1]}: "
                     f"estimate {d['estimate']:+d}, compiled {d['compiled_time']:+d}")
    return "\n".join(lines)
