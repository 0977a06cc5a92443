"""Running a peer library's side of a benchmark in its own interpreter: the benchmark script re-run with
``--peer-worker`` under the peer's Python (its own virtualenv, e.g. jax_privacy's), a JSON request on stdin and the
JSON answer on stdout, so that neither side imports the other's packages.  Standard library only: the peer's
interpreter imports this module too."""

from __future__ import annotations

import json
import os
import subprocess


def call_peer(python: str, script: str, request: dict) -> dict:
    """``script --peer-worker`` under ``python`` (jax on CPU) with ``request``; its answer, or ``RuntimeError`` with
    the end of its stderr."""
    proc = subprocess.run([python, os.path.abspath(script), "--peer-worker"], input=json.dumps(request),
                          capture_output=True, text=True, check=False, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    if proc.returncode != 0:
        raise RuntimeError(f"peer failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout)
