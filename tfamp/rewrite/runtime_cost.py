"""What a GPU pays for a step, per runtime: bytes moved plus a cost per kernel.

Two runtimes run a TensorFlow step on a GPU, and they pay for different things:

* **executor** (TensorFlow's own; tf_keras, custom loops without
  ``jit_compile``): every op is a kernel. A step costs every float tensor
  written and read (``traffic.py``'s unfused bytes) plus one launch per kernel;
  an inserted Cast is one more kernel and its bytes.
* **xla** (``jit_compile=True``; Keras 3's ``fit`` on a GPU by default): XLA
  fuses element-wise ops into their neighbours. What costs is the tensors
  *materialised* at the boundaries of its kernels: the inputs and outputs of
  library kernels (matmul, convolution: ``oplists.LIBRARY_KERNEL_OPS``), the
  outputs of reductions (``oplists.REDUCTION_KERNEL_OPS``, which fuse their
  element-wise producers), weights and arguments as they are read, results that
  leave the step. A Cast next to an element-wise op fuses into it; a Cast
  between two boundaries (a convolution and a reduction, a weight and a matmul)
  is a kernel of its own that reads its input and writes its result.

A launch is counted in byte-equivalents (``CostModel.launch_bytes``: launch
time x memory bandwidth), so one number compares a Cast's bytes with its launch.
It is an estimate, not a measurement: the figures below are round numbers for
a current data-centre GPU, and the fusion rules are a sketch of XLA's, not its
heuristics (BUILD_NOTES.md, Session 8, says what was checked against a
profile and what was not).
"""

from __future__ import annotations

import dataclasses

from tfamp.oplists import LIBRARY_KERNEL_OPS, NO_KERNEL_OPS, REDUCTION_KERNEL_OPS

# Op kinds for the fused model.
ELEMENTWISE = 0  # fuses with its element-wise neighbours (and into reductions)
REDUCTION = 1  # fuses its element-wise producers; writes its result
LIBRARY = 2  # a kernel of its own: reads and writes memory on both sides
PARAMETER = 3  # already in memory (weights, constants, arguments): read, never written
# (A reader of kind LIBRARY or PARAMETER -- a variable assignment, a call --
# needs its input in memory.)


@dataclasses.dataclass(frozen=True)
class CostModel:
    """What one kernel launch costs on a runtime, in bytes of memory traffic.

    Attributes:
      name: "executor" or "xla".
      launch_us: time a kernel costs beyond its memory traffic (launch, the
        executor's own work per op, the gap until the next kernel starts).
      bandwidth: memory bandwidth in bytes per second.
    """

    name: str
    launch_us: float
    bandwidth: float

    @property
    def launch_bytes(self) -> int:
        """Bytes the GPU could have moved in one launch's time."""
        return round(self.launch_us * 1e-6 * self.bandwidth)


# TensorFlow's executor spends a few microseconds of host time per op and the
# GPU waits when a step has many small ones (a round figure: BUILD_NOTES.md,
# Session 8). 2 TB/s: between an A100's 1.6-2.0 and an H100's 3.35 TB/s peak,
# about what large element-wise kernels reach on either.
BANDWIDTH = 2.0e12
EXECUTOR = CostModel("executor", launch_us=5.0, bandwidth=BANDWIDTH)
# XLA's price of a kernel is learned from compiled programs: the one at which
# this module's estimate of 35 H100 programs (five Keras 3 models, float32,
# Keras's policies, tfamp placed for XLA and for the executor) best matches
# their compiled step time (``python -m benchmarks.h100_program --agreement``,
# which rewrites its data/h100_agreement.json; tests/test_h100_program.py fits
# it again). 4.36 us x 2 TB/s = 8.72 MB per kernel (session 27, on the
# programs of the BatchNorm statistics edit; session 26 fitted 7.34 MB; before
# it 1 us, 2 MB, a guess, which ranked 26 of 30 pairs of programs as the
# compiler does where the fitted prices rank 28 and 27). No choice on the five
# models moves between 7.34 and 8.72 MB.
XLA = CostModel("xla", launch_us=4.36, bandwidth=BANDWIDTH)
MODELS = {"executor": EXECUTOR, "xla": XLA}


def op_kind(op: str, calls: bool = False, sink: bool = False) -> int:
    """The fused model's kind of an op (ELEMENTWISE, REDUCTION, LIBRARY, PARAMETER).

    Args:
      op: the op type.
      calls: whether the node calls a function (a call, a loop, a branch):
        its arguments and results are materialised.
      sink: whether the node has no outputs (a variable assignment, an
        optimizer's apply op): what it reads is written to memory.
    """
    if calls or sink or op in LIBRARY_KERNEL_OPS:
        return LIBRARY
    if op in REDUCTION_KERNEL_OPS:
        return REDUCTION
    if op in NO_KERNEL_OPS:
        return PARAMETER
    return ELEMENTWISE


def resolve_runtime(runtime: str, jit_compile: bool | None = None) -> str:
    """"executor" or "xla" for an AmpConfig ``runtime`` setting.

    Args:
      runtime: "auto", "executor" or "xla".
      jit_compile: whether the function runs compiled by XLA (its
        ``_XlaMustCompile`` attribute), if known. "auto" follows it; a bare
        GraphDef does not say, and "auto" then means the executor.
    """
    if runtime != "auto":
        return runtime
    return "xla" if jit_compile else "executor"


def cost(total_bytes: int | None, kernels: int | None, model: CostModel) -> int | None:
    """Bytes plus kernels x launch_bytes, or None when either is unknown."""
    if total_bytes is None or kernels is None:
        return None
    return total_bytes + kernels * model.launch_bytes
