"""scripts/multihost_demo's Python side: 2 processes x 2 CPU devices, gloo collectives."""

import os
import pathlib
import socket
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_sequence_parallel_over_two_processes_matches_reference():
  env = {k: x for k, x in os.environ.items() if k != "XLA_FLAGS"}  # each worker sets its own
  cmd = [sys.executable, "-m", "fdecode.cli.multihost_demo", "2", "2", "--port", str(_free_port()),
         "--new-tokens", "3", "--timeout", "100"]
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  log = proc.stdout + proc.stderr
  assert proc.returncode == 0, log
  assert proc.stdout.strip().splitlines()[-1] == "OK", log
  assert proc.stdout.count(": ok") == 2, log  # both workers checked against the reference
