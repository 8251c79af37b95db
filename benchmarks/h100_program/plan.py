"""What a run compiles: the models, the modes (float32 / Keras's policy / tfamp), their names.

Pure data and small functions (no TensorFlow, no JAX): the command line, the cache and the
tests all read it.
"""

from __future__ import annotations

import dataclasses

#: the five models and the batch each was measured with on the H100
DEFAULT_BATCH = {"resnet50": 64, "mobilenetv2": 64, "efficientnetb0": 64, "bert": 32, "lstm": 64}
MODELS = tuple(DEFAULT_BATCH)
DTYPES = ("float16", "bfloat16")
MODEL_LABELS = {"resnet50": "ResNet-50", "mobilenetv2": "MobileNetV2",
                "efficientnetb0": "EfficientNetB0", "bert": "BERT-base s128", "lstm": "LSTM LM s64"}


@dataclasses.dataclass(frozen=True)
class Mode:
    """One way of running the same model's step.

    Attributes:
      name: the file-name tag (``fp32``, ``keras_mf16``, ``tfamp_bf16``, ...), the same names
        as the team's H100 timing tool, so measured rows are found by it.
      side: ``"float32"``, ``"keras"`` (Keras's own mixed policy) or ``"tfamp"``
        (the unmodified float32 script under ``TFAMP_ENABLE=1``).
      dtype: ``"float16"`` / ``"bfloat16"``, or None for float32.
      placement: for a tfamp mode, whose costs place tfamp's Casts (``TFAMP_RUNTIME``):
        None leaves tfamp's choice (XLA's, as the step is compiled), ``"executor"`` places
        them for TensorFlow's executor instead: the alternative ``--agreement`` compiles to
        see whether tfamp's XLA estimate ranks the two placements as the compiler does.
    """

    name: str
    side: str
    dtype: str | None
    placement: str | None = None

    @property
    def policy(self) -> str | None:
        """Keras's global dtype policy for a ``keras`` mode."""
        if self.side != "keras":
            return None
        return {"float16": "mixed_float16", "bfloat16": "mixed_bfloat16"}[self.dtype]

    @property
    def label(self) -> str:
        if self.side == "float32":
            return "float32"
        if self.side == "keras":
            return f"keras {self.policy}"
        placed = f" (placed for the {self.placement})" if self.placement else ""
        return f"tfamp {self.dtype}{placed}"

    def environment(self, base: dict[str, str]) -> dict[str, str]:
        """The export subprocess's environment: tfamp's variables set for a tfamp mode only."""
        env = {k: v for k, v in base.items() if not k.startswith("TFAMP_")}
        env.pop("TF_USE_LEGACY_KERAS", None)  # Keras 3, whatever the shell says
        env.update(TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="")
        if self.side == "tfamp":
            env.update(TFAMP_ENABLE="1", TFAMP_DTYPE=self.dtype)
            if self.placement:
                env.update(TFAMP_RUNTIME=self.placement)
        return env


FLOAT32 = Mode("fp32", "float32", None)
MODES = {m.name: m for m in (
    FLOAT32,
    Mode("keras_mf16", "keras", "float16"), Mode("tfamp_fp16", "tfamp", "float16"),
    Mode("keras_mbf16", "keras", "bfloat16"), Mode("tfamp_bf16", "tfamp", "bfloat16"),
    Mode("tfamp_fp16_exec", "tfamp", "float16", "executor"),
    Mode("tfamp_bf16_exec", "tfamp", "bfloat16", "executor"),
)}


def modes_for(dtypes: tuple[str, ...], alternatives: bool = False) -> list[Mode]:
    """float32 first, then for each dtype Keras's policy and tfamp (and, with
    `alternatives`, tfamp with its Casts placed for the executor)."""
    out = [FLOAT32]
    for dtype in dtypes:
        out += [m for m in MODES.values()
                if m.dtype == dtype and (alternatives or m.placement is None)]
    return out


def tag(model: str, batch: int, mode: Mode) -> str:
    """File-name stem of one program: ``resnet50_b64_keras_mf16``."""
    return f"{model}_b{batch}_{mode.name}"
