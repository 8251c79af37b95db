"""What an optimized XLA:GPU program launches per step, read from its HLO text (no JAX needed).

``read_program(text)`` parses the module; ``step_features(program)`` walks the entry
computation in schedule order, into what it runs for control flow, and returns ``Features``:

* **kernels**: each fusion (one kernel; a fusion holding a ``dot`` or ``convolution`` is a
  Triton/cuBLAS gemm or a convolution), each cuDNN / cuBLAS custom call (one; cuDNN may
  launch more inside, which no program text shows), each ``copy``, each unfused op;
* **bytes at kernel boundaries**: what each kernel reads and writes in device memory. A fused
  operand only sliced inside the fusion (directly or after a convert, which XLA emits per
  element read) counts its slices; one updated in place by a
  dynamic-update-slice counts nothing read and the update written; a cuDNN workspace
  (the u8 result) is left out;
* **flops** of convolutions and gemms (2 x multiply-adds) by their input dtype;
* **host syncs**: XLA:GPU copies a conditional's predicate to the host and waits for it each
  time the conditional runs, and does the same on every iteration of a while loop whose
  trip count it does not know (a loop with a known count runs without reading its
  condition; see XLA's ``WhileThunk``). TensorFlow's gradient loops have no known count:
  such a loop is taken to run as often as the longest loop whose count is known;
* a conditional contributes the branch that applies the update (the one with the most
  kernels that are not plain copies: a skip branch only passes the variables through).

Categories follow the names of the kernels, as the H100 profile classified them
(``convert-fusion``, ``reduce-fusion``, ``transpose/copy``, ``elementwise-fusion``), plus
``conv/gemm`` for library calls and fusions that compute a dot or a convolution.
"""

from __future__ import annotations

import collections
import dataclasses
import re

DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
               "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
               "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "token": 0}
#: ops that launch nothing: views, tuples, parameters, the ends of asynchronous pairs
NO_KERNEL = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
    "add-dependency", "opt-barrier", "partition-id", "replica-id", "domain", "copy-done",
    "fusion-done", "async-done", "send-done", "recv-done", "all-reduce-done"})
#: inside a fusion: ops that only move or retype (a fusion of these is a pure convert)
CONVERT_ONLY = frozenset({"parameter", "convert", "bitcast", "copy", "tuple", "get-tuple-element",
                          "reshape", "broadcast", "transpose"})
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_DEFINE = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_NAME = re.compile(r"%([\w.\-]+)")


class HloReadError(ValueError):
    """The text is not an optimized HLO module this reader understands."""


def arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """Arrays of a shape: ``'(f16[2,3]{1,0}, u8[0]{0})'`` -> ``[('f16', (2, 3)), ('u8', (0,))]``."""
    out = []
    for dtype, dims in _ARRAY.findall(shape):
        if dtype in DTYPE_BYTES:
            out.append((dtype, tuple(int(d) for d in dims.split(",") if d)))
    return out


def elements(dims) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def size(shape_arrays) -> float:
    return sum(elements(dims) * DTYPE_BYTES[dtype] for dtype, dims in shape_arrays)


def _close(text: str, start: int) -> int:
    """Index just past the bracket matching ``text[start]``; quoted strings are skipped."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    opening, closing = text[start], pairs[text[start]]
    depth, i = 0, start
    while i < len(text):
        c = text[i]
        if c == '"':  # skip a quoted string (backend_config's JSON, metadata)
            i += 1
            while text[i] != '"':
                i += 2 if text[i] == "\\" else 1
        elif c == opening:
            depth += 1
        elif c == closing:
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    raise HloReadError(f"unbalanced {opening!r} in: {text[start:start + 120]}")


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction: its result shape (text), opcode, operand names and attributes (text)."""

    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attributes: str
    root: bool = False

    def attribute(self, pattern: str) -> str | None:
        """First group of ``pattern`` (a regex) searched in the attributes."""
        found = re.search(pattern, self.attributes)
        return found.group(1) if found else None

    def called(self, key: str) -> str | None:
        """The computation named by ``key=%name``."""
        return self.attribute(r"(?:^|[\s,])" + re.escape(key) + r"=%?([\w.\-]+)")


def parse_instruction(line: str) -> Instruction | None:
    head = _DEFINE.match(line)
    if not head:
        return None
    i = head.end()
    if line[i] == "(":
        end = _close(line, i)
    else:
        end = line.index(" ", i)
    shape = line[i:end]
    paren = line.index("(", end)
    opcode = line[end:paren].strip()
    close = _close(line, paren)
    inside = line[paren + 1:close - 1]
    operands = () if opcode == "constant" else tuple(_NAME.findall(inside))
    return Instruction(head.group(2), shape, opcode, operands, line[close:].lstrip(", ").rstrip(),
                       bool(head.group(1)))


@dataclasses.dataclass
class Program:
    """A parsed HLO module: computations (instructions in schedule order) and the entry's name."""

    computations: dict[str, list[Instruction]]
    entry: str

    def table(self, computation: str) -> dict[str, Instruction]:
        return {ins.name: ins for ins in self.computations[computation]}


def read_program(text: str) -> Program:
    """Parses the text of an HLO module (``HloModule.to_string()``)."""
    computations: dict[str, list[Instruction]] = {}
    entry, current = None, None
    for line in text.splitlines():
        if current is None:
            header = _HEADER.match(line) if line and not line[0].isspace() else None
            if header:
                current = header.group(2)
                computations[current] = []
                if header.group(1):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        instruction = parse_instruction(line)
        if instruction is not None:
            computations[current].append(instruction)
    if entry is None:
        raise HloReadError("no ENTRY computation found; expected the text of an HLO module "
                           "(the .opt.hlo.txt a compile writes)")
    return Program(computations, entry)


# -- one kernel ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Kernel:
    """One launch site. ``times`` is how often one step runs it (loops multiply)."""

    name: str
    kind: str  # fusion, gemm, conv, copy, custom, other
    category: str
    bytes: float
    flops: int
    dtype: str | None  # input dtype of a conv/gemm
    times: int
    branch: str | None  # "conditional:index" when inside a conditional's branch
    convert_only: bool = False
    in_loop: bool = False  # launched by a while loop's iterations


def category_of(name: str) -> str:
    """The category the H100 profile gave a kernel of this name."""
    n = name.lower()
    if "fusion" in n:
        for word, category in (("convert", "convert-fusion"), ("reduce", "reduce-fusion"),
                               ("transpose", "transpose/copy"), ("copy", "transpose/copy")):
            if word in n:
                return category
        return "elementwise-fusion"
    if any(word in n for word in ("conv", "gemm", "cudnn", "cublas")):
        return "conv/gemm"
    for word, category in (("convert", "convert-fusion"), ("reduce", "reduce-fusion"),
                           ("transpose", "transpose/copy"), ("copy", "transpose/copy"),
                           ("loop", "elementwise-fusion")):
        if word in n:
            return category
    return "other"


def _operand_arrays(ins: Instruction, table) -> list[list]:
    return [arrays(table[o].shape) if o in table else [] for o in ins.operands]


def conv_flops(ins: Instruction, table) -> tuple[int, str | None]:
    """2 x |forward output| x |filter| / output features, for any of the three conv kinds."""
    labels = ins.attribute(r"dim_labels=(\w+_\w+->\w+)")
    target = ins.attribute(r'custom_call_target="([^"]+)"') or ""
    result = [a for a in arrays(ins.shape) if a[0] != "u8"]
    operands = [a[0] if a else None for a in _operand_arrays(ins, table)]
    if not labels or not result or len(operands) < 2 or None in operands[:2]:
        return 0, None
    kernel_labels = labels.split("_")[1].split("->")[0]
    if "BackwardInput" in target:
        output, weights = operands[0], operands[1]
    elif "BackwardFilter" in target:
        output, weights = operands[1], result[0]
    else:
        output, weights = result[0], operands[1]
    features = weights[1][kernel_labels.index("o")] if "o" in kernel_labels else 1
    return 2 * elements(output[1]) * elements(weights[1]) // max(features, 1), operands[0][0]


def dot_flops(ins: Instruction, table) -> tuple[int, str | None]:
    result = arrays(ins.shape)
    lhs = arrays(table[ins.operands[0]].shape) if ins.operands[0] in table else []
    if not result or not lhs:
        return 0, None
    dims = ins.attribute(r"lhs_contracting_dims=\{([\d,]*)\}") or ""
    k = elements(lhs[0][1][int(d)] for d in dims.split(",") if d)
    return 2 * elements(result[0][1]) * k, lhs[0][0]


def _fused_computations(program: Program, fusion: Instruction):
    todo, seen = [fusion.called("calls")], set()
    while todo:
        name = todo.pop()
        if not name or name in seen or name not in program.computations:
            continue
        seen.add(name)
        yield name
        todo.extend(ins.called("calls") for ins in program.computations[name]
                    if ins.opcode == "fusion")


def fusion_compute(program: Program, fusion: Instruction) -> tuple[int, str | None, bool, bool]:
    """(flops, dtype, computes a dot/convolution?, only moves/retypes?) of a fusion's body."""
    flops, dtype, matrix, opcodes = 0, None, False, set()
    for name in _fused_computations(program, fusion):
        table = program.table(name)
        for ins in program.computations[name]:
            opcodes.add(ins.opcode)
            if ins.opcode in ("dot", "convolution"):
                f, dt = (dot_flops if ins.opcode == "dot" else conv_flops)(ins, table)
                flops, dtype, matrix = flops + f, dtype or dt, True
    convert_only = "convert" in opcodes and opcodes <= CONVERT_ONLY | {"fusion"}
    return flops, dtype, matrix, convert_only


def fusion_bytes(program: Program, fusion: Instruction, table) -> float:
    """Bytes a fusion reads and writes (the module docstring: slices, in-place updates)."""
    body_name = fusion.called("calls")
    if body_name not in program.computations:
        return sum(size(a) for a in _operand_arrays(fusion, table)) + size(arrays(fusion.shape))
    body = program.computations[body_name]
    inner = {ins.name: ins for ins in body}
    users = collections.defaultdict(list)
    for ins in body:
        for position, operand in enumerate(ins.operands):
            users[operand].append((ins, position))

    def read(parameter: Instruction) -> float:
        whole = size(arrays(parameter.shape))
        sliced, frontier = 0.0, [parameter.name]
        while frontier:
            name = frontier.pop()
            if not users.get(name) and name != parameter.name:
                return whole  # (a view or convert of it is the fusion's result)
            for user, position in users.get(name, []):
                if user.opcode in ("bitcast", "convert"):
                    frontier.append(user.name)
                elif user.opcode in ("slice", "dynamic-slice", "gather") and position == 0:
                    sliced += size(arrays(user.shape))
                elif not (user.opcode == "dynamic-update-slice" and position == 0):
                    return whole
        return min(sliced, whole)

    def written(ins: Instruction) -> float:
        while ins.opcode == "bitcast" and ins.operands and ins.operands[0] in inner:
            ins = inner[ins.operands[0]]
        if ins.opcode == "dynamic-update-slice" and ins.operands[1] in inner:
            return size(arrays(inner[ins.operands[1]].shape))
        if ins.opcode == "tuple":
            return sum(written(inner[o]) for o in ins.operands if o in inner)
        return size(arrays(ins.shape))

    root = next((ins for ins in body if ins.root), body[-1])
    return sum(read(ins) for ins in body if ins.opcode == "parameter") + written(root)


def kernel_of(program: Program, ins: Instruction, table, times: int, branch) -> Kernel:
    """The Kernel an instruction that launches GPU work stands for."""
    if ins.opcode in ("fusion", "fusion-start"):
        flops, dtype, matrix, convert_only = fusion_compute(program, ins)
        return Kernel(ins.name, "gemm" if matrix else "fusion",
                      "conv/gemm" if matrix else category_of(ins.name),
                      fusion_bytes(program, ins, table), flops, dtype, times, branch,
                      convert_only and not matrix)
    moved = sum(size(a) for a in _operand_arrays(ins, table))
    if ins.opcode == "custom-call":
        target = ins.attribute(r'custom_call_target="([^"]+)"') or ""
        moved += size([a for a in arrays(ins.shape) if a[0] != "u8"])  # not the workspace
        if target.startswith("__cudnn$conv"):
            flops, dtype = conv_flops(ins, table)
            return Kernel(ins.name, "conv", "conv/gemm", moved, flops, dtype, times, branch)
        if "gemm" in target or "matmul" in target or target.startswith("__cublas"):
            flops, dtype = dot_flops(ins, table)
            return Kernel(ins.name, "gemm", "conv/gemm", moved, flops, dtype, times, branch)
        return Kernel(ins.name, "custom", category_of(ins.name), moved, 0, None, times, branch)
    moved += size(arrays(ins.shape))
    kind = "copy" if ins.opcode in ("copy", "copy-start") else "other"
    return Kernel(ins.name, kind, "transpose/copy" if kind == "copy" else category_of(ins.name),
                  moved, 0, None, times, branch)


# -- one step -----------------------------------------------------------------------------------

@dataclasses.dataclass
class Walk:
    """Everything a step may run: kernels of every branch, conditionals, loops."""

    kernels: list[Kernel]
    conditionals: list[dict]
    loops: list[dict]
    unfused: collections.Counter


def trip_count(ins: Instruction) -> int | None:
    found = ins.attribute(r'"known_trip_count":\{"n":"(\d+)"\}')
    return int(found) if found else None


def walk(program: Program) -> Walk:
    """Every kernel of the entry computation and what it calls for control flow."""
    known = [trip_count(ins) for body in program.computations.values() for ins in body
             if ins.opcode == "while"]
    assumed = max([n for n in known if n] or [1])
    out = Walk([], [], [], collections.Counter())

    def visit(computation: str, times: int, branch: str | None, in_loop: bool = False) -> None:
        table = program.table(computation)
        for ins in program.computations[computation]:
            if ins.opcode in NO_KERNEL:
                continue
            if ins.opcode == "call":
                visit(ins.called("to_apply"), times, branch, in_loop)
            elif ins.opcode == "conditional":
                names = ins.attribute(r"branch_computations=\{([^}]*)\}")
                branches = (_NAME.findall(names) if names else
                            [ins.called("true_computation"), ins.called("false_computation")])
                info = {"name": ins.name, "in_branch": branch, "times": times, "branches": []}
                out.conditionals.append(info)
                for index, name in enumerate(branches):
                    start = len(out.kernels)
                    visit(name, times, f"{ins.name}:{index}", in_loop)
                    own = [k for k in out.kernels[start:] if k.branch == f"{ins.name}:{index}"]
                    info["branches"].append({
                        "computation": name, "kernels": len(own),
                        "copies": sum(k.kind == "copy" for k in own)})
                info["apply_branch"] = max(
                    range(len(branches)),
                    key=lambda i: info["branches"][i]["kernels"] - info["branches"][i]["copies"])
            elif ins.opcode == "while":
                count = trip_count(ins)
                runs = times * (count or assumed)
                out.loops.append({"name": ins.name, "trip_count": count,
                                  "assumed": None if count else assumed, "times": times,
                                  "in_branch": branch})
                if count is None:  # the condition runs (and syncs) once more than the body
                    visit(ins.called("condition"), times * (assumed + 1), branch, True)
                visit(ins.called("body"), runs, branch, True)
            else:
                kernel = kernel_of(program, ins, table, times, branch)
                if in_loop:
                    kernel = dataclasses.replace(kernel, in_loop=True)
                if kernel.kind == "other":
                    out.unfused[ins.opcode] += 1
                out.kernels.append(kernel)

    visit(program.entry, 1, None)
    return out


@dataclasses.dataclass
class Features:
    """What one step of the program launches and moves; the reader's answer."""

    kernels: int
    bytes: float
    host_syncs: int
    top_level_conditionals: int
    convert_fusions: int
    kernels_by_category: dict[str, int]
    bytes_by_category: dict[str, float]
    matrix_flops: dict[str, int]  # conv/gemm flops by input dtype
    loops: list[dict]
    unfused_ops: dict[str, int]
    step_kernels: list[Kernel] = dataclasses.field(repr=False, default_factory=list)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.pop("step_kernels")
        return out


def _in_step(kernel: Kernel, chosen: dict[str, int], parent: dict[str, str | None]) -> bool:
    branch = kernel.branch
    while branch is not None:
        name, index = branch.rsplit(":", 1)
        if chosen.get(name) != int(index):
            return False
        branch = parent.get(name)
    return True


def step_features(program: Program) -> Features:
    """Features of one executed step: each conditional runs its applying branch."""
    w = walk(program)
    chosen = {c["name"]: c["apply_branch"] for c in w.conditionals}
    parent = {c["name"]: c["in_branch"] for c in w.conditionals}
    ks = [k for k in w.kernels if _in_step(k, chosen, parent)]
    by_count, by_bytes, flops = (collections.Counter(), collections.Counter(),
                                 collections.Counter())
    for k in ks:
        by_count[k.category] += k.times
        by_bytes[k.category] += k.bytes * k.times
        if k.flops:
            flops[k.dtype or "?"] += k.flops * k.times

    def runs(item) -> bool:
        return item["in_branch"] is None or _in_step(
            Kernel("", "", "", 0, 0, None, 1, item["in_branch"]), chosen, parent)

    syncs = sum(c["times"] for c in w.conditionals if runs(c))
    syncs += sum(loop["times"] * (loop["assumed"] + 1) for loop in w.loops
                 if loop["trip_count"] is None and runs(loop))
    return Features(
        kernels=sum(k.times for k in ks),
        bytes=sum(by_bytes.values()),
        host_syncs=syncs,
        top_level_conditionals=sum(1 for c in w.conditionals if c["in_branch"] is None),
        convert_fusions=by_count.get("convert-fusion", 0),
        kernels_by_category=dict(by_count),
        bytes_by_category=dict(by_bytes),
        matrix_flops=dict(flops),
        loops=w.loops,
        unfused_ops=dict(w.unfused),
        step_kernels=ks,
    )
