"""Helpers shared by test files (tests/ is on sys.path under pytest's default import mode)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_child_json(code: str, timeout: float, **env: str) -> dict:
    """Run `code` in a fresh interpreter (so env such as NUMBA_ENABLE_CUDASIM cannot leak into this process) and
    return the JSON object it prints on its last line."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1", **env),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
