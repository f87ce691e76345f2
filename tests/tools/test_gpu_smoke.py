"""`fdecode.devtools.gpu_smoke` (the first check of `scripts/gpu_first_call`) under the CPU
interpreters: every family passes, Hopper ones included (under InterpretGPUParams), and
its comparison catches a wrong output, so the smoke can fail. About 130 s on 2 cores (22 cases,
2026-12-02, beside another job)."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np

from fdecode.devtools import gpu_smoke

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_interpreted_smoke_passes_every_family(tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  if "XLA_FLAGS" in os.environ:
    env["XLA_FLAGS"] = os.environ["XLA_FLAGS"]
  proc = subprocess.run([sys.executable, "-m", "fdecode.devtools.gpu_smoke", "--out", str(tmp_path), "--interpret"],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
  report = json.loads((tmp_path / "smoke.json").read_text())
  cases = report["cases"]
  assert report["env"]["interpret"] and report["env"]["jax"]
  assert {c["family"] for c in cases} == set(gpu_smoke.FAMILIES)
  bad = [(c["name"], c["status"], c["error"]) for c in cases if c["status"] != "pass"]
  assert not bad, bad  # the Hopper kernels run under the interpreter: they must pass, not skip
  assert sum(c["family"] == "hopper" for c in cases) == 5


def test_comparison_catches_a_wrong_output():
  rng = np.random.default_rng(0)
  out, lse = rng.standard_normal((2, 4, 8)).astype(np.float32), rng.standard_normal((2, 4)).astype(np.float32)
  lse[0, 0] = -np.inf  # an empty row
  assert gpu_smoke.compare((out, lse), (out, lse), 3e-5)["status"] == "pass"
  tol = gpu_smoke.TOL["bf16"]
  wrong = out.copy()
  wrong[1, 2, 3] += 3 * tol * (1 + abs(out[1, 2, 3]))
  res = gpu_smoke.compare((wrong, lse), (out, lse), tol)
  assert res["status"] == "fail" and res["err_out"] > tol
  assert gpu_smoke.compare((out, np.where(np.isinf(lse), 0.0, lse)), (out, lse), tol)["status"] == "fail"
  nan = out.copy()
  nan[0, 0, 0] = np.nan
  assert gpu_smoke.compare((nan, lse), (out, lse), tol)["status"] == "fail"


def test_gpu_first_call_parses():
  subprocess.run(["bash", "-n", str(ROOT / "scripts" / "gpu_first_call")], check=True)
  assert os.access(ROOT / "scripts" / "gpu_first_call", os.X_OK)
