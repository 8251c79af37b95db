"""The one line a slow first call gets, and none on a quick one (runtime/progress.py)."""

import logging
import time

from tfamp.runtime import progress


def named(name):
    def fn():
        pass
    fn.__name__ = name
    return fn


def test_a_slow_call_is_announced_once_and_a_quick_one_not(monkeypatch, caplog):
    monkeypatch.setattr(progress, "NOTICE_AFTER_S", 0.3)
    monkeypatch.setattr(progress, "_POLL_S", 0.05)
    caplog.set_level(logging.INFO, logger="tfamp")
    with progress.phase(named("quick_step")):
        pass
    with progress.phase(named("slow_step")):
        with progress.phase(named("inner")):  # nested: only the outermost counts
            time.sleep(1.0)
    time.sleep(0.2)
    lines = [r.getMessage() for r in caplog.records if r.name == "tfamp"]
    assert len(lines) == 1, lines
    assert lines[0].startswith("tfamp: first call of slow_step: tracing, rewriting")


def test_only_the_first_call_is_announced_however_slow_later_calls_are(monkeypatch, caplog):
    # Issue 28.5: a step whose every call took over the threshold (a GAN step of the
    # keras.io guide) got "first call of ...: tracing" on every call.
    monkeypatch.setattr(progress, "NOTICE_AFTER_S", 0.2)
    monkeypatch.setattr(progress, "_POLL_S", 0.05)
    caplog.set_level(logging.INFO, logger="tfamp")
    step = named("gan_step")
    for _ in range(3):
        with progress.phase(step):
            time.sleep(0.5)
    time.sleep(0.2)
    lines = [r.getMessage() for r in caplog.records if r.name == "tfamp"]
    assert len(lines) == 1, lines
    assert lines[0].startswith("tfamp: first call of gan_step")
