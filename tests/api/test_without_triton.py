"""fdecode on a JAX without Pallas' Triton backend (``jax.experimental.pallas.triton``,
deprecated in JAX 0.11): simulated in a fresh process by refusing that module's import.
fdecode imports, the CPU default and `ragged_decode` run, GPU plans take the Hopper MLA
kernel where it applies and the XLA path elsewhere, with one warning per process, the
Hopper rows kernel runs (interpreted) with its splits merged by XLA, and ``impl="pallas"``
names the missing module."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import importlib.abc, sys, warnings

    class NoTriton(importlib.abc.MetaPathFinder):
      def find_spec(self, name, path=None, target=None):
        if name == "jax.experimental.pallas.triton":
          raise ImportError("simulated: no Pallas Triton backend")
        return None

    sys.meta_path.insert(0, NoTriton())
    caught = warnings.catch_warnings(record=True)
    log = caught.__enter__()
    warnings.simplefilter("always")
    import jax, jax.numpy as jnp, numpy as np
    import fdecode
    from fdecode.kernels.triton import pallas_triton
    assert not pallas_triton.available() and "simulated" in pallas_triton.MISSING

    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 8, 64)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, 2, 96, 64)), jnp.float32)
    n = jnp.array([96, 40], jnp.int32)
    out = fdecode.flash_decode(q, k, k, n)
    ref = fdecode.flash_decode(q, k, k, n, impl="reference")
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5)

    plans = [fdecode.plan(q, k, k, n, platform="gpu") for _ in range(2)]
    assert all(type(p[0]).__name__ == "XlaPlan" for p in plans), plans

    pool = jnp.asarray(rng.standard_normal((2, 12, 8, 64)), jnp.float32)
    tables = jnp.arange(12, dtype=jnp.int32).reshape(2, 6)
    rows = jnp.asarray(rng.standard_normal((5, 8, 64)), jnp.float32)
    o = fdecode.ragged_decode(rows, pool, pool, jnp.array([20, 30], jnp.int32), tables,
                              jnp.array([0, 4, 5], jnp.int32), jnp.array([2], jnp.int32))
    assert o.shape == (5, 8, 64) and bool(jnp.all(jnp.isfinite(o)))

    # The Hopper kernels still apply: their splits merged by XLA instead of the Triton combine.
    mla = fdecode.plan(jax.ShapeDtypeStruct((2, 16, 576), jnp.bfloat16),
                       jax.ShapeDtypeStruct((2, 1, 256, 576), jnp.bfloat16), None,
                       jax.ShapeDtypeStruct((2,), jnp.int32), v_head_dim=512, platform="gpu")
    assert [type(p).__name__ for p in mla] == ["MlaPlan"] and not mla.refused, mla
    from fdecode.devtools.interpret import compiled_once
    from fdecode.kernels import mosaic_gpu
    qh = jnp.asarray(rng.standard_normal((1, 2, 16, 64)), jnp.bfloat16)
    kh = jnp.asarray(rng.standard_normal((1, 1, 128, 64)), jnp.bfloat16)
    nh = jnp.array([100], jnp.int32)
    with compiled_once():
      rows = fdecode.flash_decode(qh, kh, kh, nh, impl="mosaic_gpu", interpret=mosaic_gpu.InterpretGPUParams())
    f32 = lambda x: x.astype(jnp.float32)
    ref = fdecode.flash_decode(f32(qh), f32(kh), f32(kh), nh, impl="reference")
    np.testing.assert_allclose(np.asarray(f32(rows)), np.asarray(ref), atol=2e-2)  # bf16 operands

    try:
      fdecode.flash_decode(q, k, k, n, impl="pallas")
    except ValueError as e:
      assert "jax.experimental.pallas.triton is not importable" in str(e), e
    else:
      raise AssertionError("impl='pallas' ran without Pallas' Triton backend")
    ours = [w for w in log if "GPU calls take the XLA path" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in log]  # one warning in the whole process
    print("OK")
""")


def test_fdecode_runs_without_pallas_triton():
  run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600,
                       env={"JAX_PLATFORMS": "cpu", **__import__("os").environ})
  assert run.returncode == 0 and run.stdout.strip().endswith("OK"), run.stdout[-2000:] + run.stderr[-4000:]
