"""Child TensorFlow processes for tests: a clean environment, free loopback
ports, and a MultiWorkerMirroredStrategy cluster of workers on them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def environment(extra: dict | None = None, tf_config: dict | None = None) -> dict:
    """This process's environment without TFAMP_* and TF_CONFIG, the repository
    first on PYTHONPATH, TensorFlow quiet; then `extra` and `tf_config`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TFAMP_") and k != "TF_CONFIG"}
    env.update(TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(
                   os.pathsep))
    env.update(extra or {})
    if tf_config is not None:
        env["TF_CONFIG"] = json.dumps(tf_config)
    return env


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def run_workers(argv: list[str], extra: dict | None, timeout: float,
                count: int = 2) -> list[tuple[int, str, str]]:
    """`argv` in `count` MultiWorkerMirroredStrategy workers on loopback ports:
    each worker's (exit status, stdout, stderr). No worker outlives the call."""
    cluster = {"worker": [f"127.0.0.1:{port}" for port in free_ports(count)]}
    procs, start = [], time.monotonic()
    try:
        for index in range(count):
            tf_config = {"cluster": cluster, "task": {"type": "worker", "index": index}}
            procs.append(subprocess.Popen(argv, env=environment(extra, tf_config),
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                          text=True))
        outputs = [proc.communicate(timeout=max(1.0, start + timeout - time.monotonic()))
                   for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return [(proc.returncode, *out) for proc, out in zip(procs, outputs, strict=True)]
