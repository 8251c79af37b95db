"""What the TFAMP_* environment variables ask for: the only reader of os.environ.

``settings_from_env()`` parses and validates every variable at once and returns
an ``EnvSettings`` value; a bad value raises ``EnvError`` whose message is one
line naming the variable, the value received and the values accepted.

Variables:
  TFAMP_ENABLE        1/true/yes/on or 0/false/no/off (unset or empty: off)
  TFAMP_DTYPE         float16 | bfloat16                      (float16)
  TFAMP_LOSS_SCALE    dynamic | a positive number | none      (dynamic for float16,
                                                               none for bfloat16)
  TFAMP_INITIAL_SCALE auto | a positive number: where a dynamic scale starts; auto
                      sets it from the first batch's gradients at the first fit (auto)
  TFAMP_{ALLOW,INFER,DENY,CLEAR}LIST_{ADD,REMOVE}   comma-separated op names
  TFAMP_KEEP_FP32     comma-separated regular expressions on node names
  TFAMP_REPORT_DIR    write each rewritten function's JSON report there
  TFAMP_VERBOSITY     0/quiet | 1/info | 2/debug                  (1)
  TFAMP_RANGES        off | on (writes to ./tfamp_ranges) | a directory: Keras fit
                      also shows where gradients sit against 16-bit limits (off)
  TFAMP_RUNTIME       auto | executor | xla: whose costs place the Casts (auto: xla
                      for a step compiled with jit_compile, else executor)
  TFAMP_DEVICE_TYPE   auto | GPU | CPU: whose kernels the rewrite targets (auto: GPU
                      if TensorFlow sees one); GPU on a machine without one traces
                      the step a GPU would run (e.g. to compile it ahead of time)
"""

from __future__ import annotations

import os
from collections.abc import Mapping

TRUE_WORDS = ("1", "true", "yes", "on")
# tfamp_startup.pth repeats these words so that "off" imports nothing at all.
FALSE_WORDS = ("0", "false", "no", "off")
# Whose kernels the rewrite targets (AmpConfig.device_type), as TFAMP_DEVICE_TYPE spells them.
DEVICE_WORDS = {"auto": "auto", "gpu": "GPU", "cpu": "CPU"}
VERBOSITY_WORDS = {"0": 0, "quiet": 0, "1": 1, "info": 1, "2": 2, "debug": 2}
LIST_VARIABLES = {
    f"TFAMP_{name.upper()}LIST_{verb.upper()}": f"{name}_{verb}"
    for name in ("allow", "infer", "deny", "clear") for verb in ("add", "remove")
}
KNOWN_VARIABLES = frozenset({
    "TFAMP_ENABLE", "TFAMP_DTYPE", "TFAMP_LOSS_SCALE", "TFAMP_INITIAL_SCALE", "TFAMP_KEEP_FP32",
    "TFAMP_REPORT_DIR", "TFAMP_VERBOSITY", "TFAMP_RANGES", "TFAMP_RUNTIME", "TFAMP_DEVICE_TYPE",
    *LIST_VARIABLES,
})


class EnvError(ValueError):
    """A TFAMP_* variable has a value tfamp cannot use."""


class EnvSettings:
    """Everything the environment asks of tfamp (read-only).

    A plain class, not a dataclass: the start-up hook builds one in every
    process with a TFAMP_* variable, and ``dataclasses`` costs milliseconds to import.
    """

    __slots__ = ("enabled", "config", "loss_scale", "report_dir", "verbosity", "ranges_dir",
                 "initial_scale")

    def __init__(self, *, enabled: bool, config, loss_scale, report_dir: str | None,
                 verbosity: int, ranges_dir: str | None = None, initial_scale="auto"):
        values = dict(enabled=enabled, config=config, loss_scale=loss_scale,
                      report_dir=report_dir, verbosity=verbosity, ranges_dir=ranges_dir,
                      initial_scale=initial_scale)
        for name, value in values.items():
            object.__setattr__(self, name, value)
        # config: tfamp.AmpConfig (imports TensorFlow), or None when not built;
        # loss_scale: "dynamic", a float, or None; ranges_dir: None = off;
        # initial_scale: "auto" or a float.

    def __setattr__(self, name, value):
        raise AttributeError("EnvSettings is read-only")

    def __eq__(self, other):
        return isinstance(other, EnvSettings) and all(
            getattr(self, n) == getattr(other, n) for n in self.__slots__)

    def __repr__(self):
        fields = ", ".join(f"{n}={getattr(self, n)!r}" for n in self.__slots__)
        return f"EnvSettings({fields})"


def is_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Cheap check of TFAMP_ENABLE alone (no TensorFlow import); validates it."""
    environ = os.environ if environ is None else environ
    return _parse_enable(environ.get("TFAMP_ENABLE", ""))


def settings_from_env(environ: Mapping[str, str] | None = None, *,
                      with_config: bool = True) -> EnvSettings:
    """Reads and validates every TFAMP_* variable.

    Args:
      environ: the environment to read; ``os.environ`` if None.
      with_config: build the AmpConfig, which checks op-list names against
        TensorFlow's op registry (so it imports TensorFlow). False: every other
        check, no TensorFlow import, and ``config`` is None (the start-up hook).

    Raises:
      EnvError: naming the variable, its value and the accepted values.
    """
    environ = os.environ if environ is None else environ
    _check_unknown_variables(environ)
    enabled = _parse_enable(environ.get("TFAMP_ENABLE", ""))
    dtype = environ.get("TFAMP_DTYPE", "").strip().lower() or "float16"
    if dtype not in ("float16", "bfloat16"):
        raise EnvError(f"TFAMP_DTYPE={environ['TFAMP_DTYPE']!r} is not valid; "
                       f"accepted values: float16, bfloat16")
    loss_scale = _parse_loss_scale(environ.get("TFAMP_LOSS_SCALE", ""), dtype)
    initial_scale = _parse_initial_scale(environ.get("TFAMP_INITIAL_SCALE", ""))
    changes = {field: _parse_op_names(variable, environ.get(variable, ""))
               for variable, field in LIST_VARIABLES.items()}
    keep = _parse_patterns(environ.get("TFAMP_KEEP_FP32", ""))
    verbosity_text = environ.get("TFAMP_VERBOSITY", "").strip().lower() or "1"
    if verbosity_text not in VERBOSITY_WORDS:
        raise EnvError(f"TFAMP_VERBOSITY={environ['TFAMP_VERBOSITY']!r} is not valid; "
                       f"accepted values: 0/quiet, 1/info, 2/debug")
    report_dir = environ.get("TFAMP_REPORT_DIR", "").strip() or None
    if report_dir is not None and os.path.exists(report_dir) and not os.path.isdir(report_dir):
        raise EnvError(f"TFAMP_REPORT_DIR={report_dir!r} is a file; accepted values: a "
                       f"directory path (created if missing)")

    ranges_dir = _parse_ranges(environ.get("TFAMP_RANGES", ""))
    runtime = environ.get("TFAMP_RUNTIME", "").strip().lower() or "auto"
    if runtime != "auto" and runtime not in _runtime_words():
        raise EnvError(f"TFAMP_RUNTIME={environ['TFAMP_RUNTIME']!r} is not valid; accepted "
                       f"values: auto (xla for a jit_compile step, else executor), executor "
                       f"(TensorFlow's, every op a kernel), xla (fused)")
    device_text = environ.get("TFAMP_DEVICE_TYPE", "").strip().lower() or "auto"
    if device_text not in DEVICE_WORDS:
        raise EnvError(f"TFAMP_DEVICE_TYPE={environ['TFAMP_DEVICE_TYPE']!r} is not valid; "
                       f"accepted values: auto (GPU if TensorFlow sees one), GPU, CPU")

    config = None
    if with_config:
        from tfamp.config import AmpConfig

        try:
            config = AmpConfig(dtype=dtype, keep_fp32=keep, runtime=runtime,
                               device_type=DEVICE_WORDS[device_text], **changes)
        except (ValueError, TypeError) as err:
            raise EnvError(_env_message(str(err))) from err
    return EnvSettings(enabled=enabled, config=config, loss_scale=loss_scale,
                       report_dir=report_dir, verbosity=VERBOSITY_WORDS[verbosity_text],
                       ranges_dir=ranges_dir, initial_scale=initial_scale)


def _parse_enable(text: str) -> bool:
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS or word == "":
        return False
    raise EnvError(f"TFAMP_ENABLE={text!r} is not valid; accepted values: "
                   f"{'/'.join(TRUE_WORDS)} to enable, {'/'.join(FALSE_WORDS)} to disable")


DEFAULT_RANGES_DIR = "tfamp_ranges"


def _parse_ranges(text: str) -> str | None:
    word = text.strip()
    if word.lower() in FALSE_WORDS or word == "":
        return None
    if word.lower() in TRUE_WORDS:
        return DEFAULT_RANGES_DIR
    if os.path.exists(word) and not os.path.isdir(word):
        raise EnvError(f"TFAMP_RANGES={text!r} is a file; accepted values: "
                       f"{'/'.join(TRUE_WORDS)} (write to ./{DEFAULT_RANGES_DIR}), "
                       f"{'/'.join(FALSE_WORDS)}, or a directory path (created if missing)")
    return word


def _parse_loss_scale(text: str, dtype: str):
    word = text.strip().lower()
    if word == "":
        return "dynamic" if dtype == "float16" else None
    if word == "dynamic":
        return "dynamic"
    if word == "none":
        return None
    return _positive_number(word, f"TFAMP_LOSS_SCALE={text!r} is not valid; accepted values: "
                                  f"dynamic, a positive number (fixed scale, e.g. 1024), none")


def _parse_initial_scale(text: str):
    word = text.strip().lower()
    if word in ("", "auto"):
        return "auto"
    return _positive_number(word, f"TFAMP_INITIAL_SCALE={text!r} is not valid; accepted "
                                  f"values: auto (from the first batch's gradients), a "
                                  f"positive number (e.g. 32768)")


def _positive_number(word: str, error: str) -> float:
    """`word` as a finite positive float, else EnvError(`error`)."""
    try:
        value = float(word)
    except ValueError:
        value = -1.0
    if not (value > 0 and value != float("inf")):
        raise EnvError(error)
    return value


def _parse_op_names(variable: str, text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    if names:
        import re  # only when the variable is set: the start-up hook stays cheap
    for name in names:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise EnvError(f"{variable}={text!r} is not valid: {name!r} is not an op name; "
                           f"accepted values: op names separated by commas, e.g. "
                           f"'BiasAdd,Softmax'")
    return names


def _parse_patterns(text: str) -> tuple[str, ...]:
    patterns = tuple(part.strip() for part in text.split(",") if part.strip())
    if patterns:
        import re
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as err:
            raise EnvError(f"TFAMP_KEEP_FP32={text!r} is not valid: {pattern!r} is not a "
                           f"regular expression ({err}); accepted values: regular "
                           f"expressions separated by commas") from err
    return patterns


def _env_message(config_message: str) -> str:
    """Rewords an AmpConfig error in terms of the variable that caused it."""
    for variable, field in LIST_VARIABLES.items():
        if config_message.startswith(f"{field}:"):
            return (f"{variable}: {config_message.split(':', 1)[1].strip()} "
                    f"(accepted values: registered TensorFlow op names)")
    for variable, field in LIST_VARIABLES.items():
        config_message = config_message.replace(f"{field}=", f"{variable}=")
    return config_message


def user_cache_dir(environ: Mapping[str, str] | None = None) -> str:
    """Where tfamp keeps per-user state (notices already shown): $XDG_CACHE_HOME/tfamp,
    else ~/.cache/tfamp."""
    environ = os.environ if environ is None else environ
    base = environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(
        environ.get("HOME", "").strip() or os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tfamp")


def unknown_variable_message(environ: Mapping[str, str]) -> str | None:
    """"NAME is not a tfamp setting; did you mean ...?" for the first unknown TFAMP_*."""
    for name in sorted(environ):
        if name.startswith("TFAMP_") and name not in KNOWN_VARIABLES:
            import difflib

            hint = difflib.get_close_matches(name, sorted(KNOWN_VARIABLES), n=1)
            fix = f"did you mean {hint[0]}?" if hint else "see tfamp's README for the list"
            return f"{name} is not a tfamp setting; {fix}"
    return None


def _check_unknown_variables(environ: Mapping[str, str]) -> None:
    message = unknown_variable_message(environ)
    if message is not None:
        raise EnvError(message)


def _runtime_words() -> tuple[str, ...]:
    # Only when TFAMP_RUNTIME is set: the start-up hook imports no more than it needs.
    from tfamp.choices import RUNTIME_WORDS

    return RUNTIME_WORDS
