"""Compile subprocess (JAX 0.11.2's Python): one exported step's HLO compiled for an H100, no GPU.

JAX's compile-only client takes the GPU's description (``data/h100_sxm.txtpb``) and runs
XLA:GPU's whole pipeline (fusion, layout, scheduling, buffer assignment) on a CPU-only host.
Without a device XLA does no autotuning (convolution algorithms and gemm tilings stay at
their defaults); ``cost_analysis`` is not implemented for such executables, so what the
benchmark reports is read from the optimized HLO text this script writes.

Two edits before compiling, the same ones the H100 timing runs made: TensorFlow's
``mhlo.copy`` ops (its XLA return-value copies, which this JAX's pipeline rejects) are
replaced by their operand, and the module's input/output aliasing is dropped (each step
writes new buffers, as in the timed runs).

Runs with the JAX venv's Python, not the project's: it imports only JAX and the standard
library. ``JAX_PLATFORMS=cpu`` must be set before JAX starts (otherwise the CUDA plugin looks
for a driver and the topology call fails): the benchmark sets it, and so does this script when
the variable is unset. ``time_on_gpu.py`` imports ``edit`` from here on a GPU machine.

    python compile_h100.py --hlo STEP.hlo.pb --target h100_sxm.txtpb --out PREFIX
writes PREFIX.opt.hlo.txt and PREFIX.compile.json (memory sizes, times, versions).
"""

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
from jax._src.interpreters import mlir  # noqa: E402
from jax._src.lib import _jax, xla_client  # noqa: E402
from jax._src.lib.mlir import ir  # noqa: E402
from jax.experimental import topologies  # noqa: E402

ALIAS_ATTR = "mhlo.input_output_alias"


def h100(target_text: str):
    """The compile-only device described by a GpuTargetConfigProto text."""
    topology = topologies.get_topology_desc(platform="cuda", target_config=target_text,
                                            topology="1x1x1")
    return topology.devices[0]


def edit(module) -> dict:
    """Drops ``mhlo.copy`` ops (uses read their operand) and the input/output aliasing."""
    copies = []

    def visit(op):
        if op.name == "mhlo.copy":
            copies.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    for op in copies:
        op.results[0].replace_all_uses_with(op.operands[0])
        op.erase()
    attributes = module.operation.attributes
    aliased = ALIAS_ATTR in attributes
    if aliased:
        del attributes[ALIAS_ATTR]
    return {"copies_dropped": len(copies), "aliasing_dropped": aliased}


def compile_step(hlo_path: str, target_path: str, out_prefix: str) -> dict:
    with open(hlo_path, "rb") as f:
        hlo = f.read()
    with open(target_path) as f:
        device = h100(f.read())
    started = time.perf_counter()
    stablehlo = _jax.mlir.hlo_to_stablehlo(hlo)
    with mlir.make_ir_context():
        module = ir.Module.parse(stablehlo)
        edits = edit(module)
        converted = time.perf_counter()
        executable = device.client.compile(
            module, executable_devices=xla_client.DeviceList((device,)),
            compile_options=xla_client.CompileOptions())
    compiled = time.perf_counter()
    modules = executable.hlo_modules()
    with open(out_prefix + ".opt.hlo.txt", "w") as f:
        f.write(modules[0].to_string())
    stats = executable.get_compiled_memory_stats()
    info = {
        "device": str(device),
        "jax": jax.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS"),
        "convert_s": round(converted - started, 2),
        "compile_s": round(compiled - converted, 2),
        "hlo_modules": len(modules),
        "memory": {key: int(getattr(stats, key)) for key in (
            "argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
            "alias_size_in_bytes", "generated_code_size_in_bytes")},
        **edits,
    }
    with open(out_prefix + ".compile.json", "w") as f:
        json.dump(info, f, indent=1)
    return info


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hlo", required=True, help="HloModuleProto of the step (.hlo.pb)")
    parser.add_argument("--target", required=True, help="GpuTargetConfigProto text")
    parser.add_argument("--out", required=True, help="prefix of the files written")
    args = parser.parse_args(argv)
    info = compile_step(args.hlo, args.target, args.out)
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
