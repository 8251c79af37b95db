"""Estimate subprocess (the project's Python): tfamp's own XLA cost estimate of one program.

tfamp places its Casts by an estimate of what XLA:GPU will pay (``tfamp.rewrite.runtime_cost``:
bytes at fusion boundaries plus a price per fused kernel). To see whether that estimate agrees
with the compiled program, this builds the same step as ``export_step`` (same model, same
mode, same environment: a tfamp mode runs under ``TFAMP_ENABLE=1``) and, instead of exporting
HLO, measures the step's graph with tfamp's estimate: ``fused_bytes`` and ``fused_kernels``
(``tfamp.rewrite.traffic.estimate_traffic``). Nothing runs.

    python -m benchmarks.h100_program.step_estimate --model resnet50 --mode fp32 \
        --batch 64 --out DIR/resnet50_b64_fp32.estimate.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import keras  # noqa: E402

from benchmarks.h100_program import models  # noqa: E402
from benchmarks.h100_program.export_step import build_step  # noqa: E402
from benchmarks.h100_program.plan import MODES  # noqa: E402
from tfamp.rewrite.graph import build_view  # noqa: E402
from tfamp.rewrite.shapes import tensor_shapes  # noqa: E402
from tfamp.rewrite.traffic import body_weights, estimate_traffic  # noqa: E402

#: the trip count of a loop whose count the graph does not say (the LSTM's 64 steps)
LOOP_TRIPS = {"lstm": 64}
#: a dimension the shapes leave open (an embedding gradient's rows): at most the batch's tokens
UNKNOWN_DIM = 32 * 128


def estimate(model_name: str, mode_name: str, batch: int) -> dict:
    started = time.perf_counter()
    _, step, data = build_step(model_name, mode_name, batch)
    concrete = step.get_concrete_function(data)
    graph_def = concrete.graph.as_graph_def(add_shapes=True)
    fetches = list(dict.fromkeys(t.op.name for t in concrete.graph.outputs))
    view = build_view(graph_def)
    shapes = tensor_shapes(graph_def, view)
    traffic = estimate_traffic(
        view, shapes, body_weights(view, default_trips=LOOP_TRIPS.get(model_name, 1),
                                   shapes=shapes), outputs=fetches)
    if traffic.fused is None:
        raise SystemExit(f"step_estimate: tfamp cannot size every tensor of {model_name} "
                         f"{mode_name}: {traffic.unknown_tensors}")
    return {"model": model_name, "mode": mode_name, "batch": batch,
            "fused_bytes": traffic.fused.at(UNKNOWN_DIM), "fused_kernels": traffic.fused_kernels,
            "keras": keras.__version__, "seconds": round(time.perf_counter() - started, 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, choices=sorted(models.DEFAULT_BATCH))
    parser.add_argument("--mode", required=True, choices=sorted(MODES))
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--out", required=True, help="the JSON file written")
    args = parser.parse_args(argv)
    result = estimate(args.model, args.mode, args.batch)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
