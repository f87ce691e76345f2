"""A steady decode never recompiles: every decode loop fdecode ships (`generate` on one
device and on a 2x2 mesh, Explicit and Auto axes, contiguous and paged caches; beam
search; parallel sampling; the demos) compiles its step function exactly once.

Compilations are counted from JAX's own "Compiling <name> ..." log record (emitted once
per trace-and-lower, before any compilation cache), at DEBUG level so nothing is
printed. Each test uses a model shape no other test uses, so its first step really
compiles and the count is exactly 1, not "at most 1". Before the fix the sharded
`generate` compiled its step twice: the first step handed back the weights, block tables
and token ids laid out otherwise than they came in (weights split over "heads", block
tables over "seq"), so step 2 saw new input types.
"""

import functools

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import fdecode
from fdecode.decoding.beam import beam_search, sample_n
from fdecode.decoding.generate import generate
from fdecode.models.base import ModelConfig, Transformer
from helpers import counting_compiles

# Shapes used by no other test module (a cached compile would hide the first one).
CFG = ModelConfig(vocab=40, dim=24, layers=2, num_heads=4, num_kv_heads=2, head_dim=6, mlp_dim=40)


def _prompts(b, seed=0):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(2, 7, b).astype(np.int32)
  return rng.integers(0, CFG.vocab, (b, 6)).astype(np.int32), lengths


def _mesh_setup(axis_types, paged):
  mesh = jax.make_mesh((2, 2), ("heads", "seq"), devices=jax.devices()[:4], axis_types=axis_types)
  decode_fn = functools.partial(fdecode.sharded_flash_decode, mesh=mesh, head_axis="heads",
                                seq_axis="seq")
  spec = P("heads", "seq", None, None) if paged else P(None, "heads", "seq", None)
  return decode_fn, NamedSharding(mesh, spec)


@pytest.mark.parametrize("where", ["1 device", "2x2 explicit paged", "2x2 auto"])  # contiguous
# Explicit: the demo test below
def test_generate_compiles_its_step_once(where):
  """5 decode steps (steps=6): the step compiles in the first one, never again."""
  decode_fn, cache_sharding = fdecode.flash_decode, None
  if where != "1 device":
    axis_types = (AxisType.Auto,) * 2 if "auto" in where else (AxisType.Explicit,) * 2
    decode_fn, cache_sharding = _mesh_setup(axis_types, "paged" in where)
  b = {"1 device": 2, "2x2 explicit paged": 5, "2x2 auto": 6}[where]  # fresh shapes
  model = Transformer(CFG, decode_fn=decode_fn, seed=1)
  model.init_cache(b, 32, page_size=4 if "paged" in where else None)
  prompts, lengths = _prompts(b)
  per_step = []
  with counting_compiles() as compiles:
    out = generate(model, prompts, lengths, 6, cache_sharding=cache_sharding,
                   on_step=lambda done, _: per_step.append(compiles.count("_decode_step")))
  assert out.tokens.shape == (b, 6)
  # per_step[0]: after the prefill; per_step[i]: after decode step i.
  assert np.diff(per_step).tolist() == [1, 0, 0, 0, 0], (where, per_step)


def test_beam_search_and_sampling_compile_their_steps_once():
  prompt = np.arange(3, 12, dtype=np.int32)
  model = Transformer(CFG, seed=1)
  model.init_cache(batch=3, max_len=24, page_size=4)
  with counting_compiles() as compiles:
    beam_search(model, prompt, beams=3, steps=6)
  assert compiles.count("_decode_logp") == 1, compiles.names
  assert compiles.count("_prefill_logp") == 1 and compiles.count("_copy_all") <= 1, compiles.names
  model = Transformer(CFG, seed=1)
  model.init_cache(batch=3, max_len=24, page_size=4)
  with counting_compiles() as compiles:
    sample_n(model, prompt, 3, 6, jax.random.key(0), 0.5)
  assert compiles.count("_draw") == 1 and compiles.count("_decode_logp") <= 1, compiles.names


def test_demo_steps_compile_once(capsys, monkeypatch):
  """The synthetic demo on a 2x2 mesh (its fdecode and reference runs): no step after the
  first decode step compiles anything named _decode_step."""
  from fdecode.cli import synthetic as demo
  seen = {}
  progress = demo.progress_bar

  def recording(label):
    bar = progress(label)
    def on_step(done, total):
      seen.setdefault(label, []).append(compiles.count("_decode_step"))
      bar(done, total)
    return on_step

  monkeypatch.setattr(demo, "progress_bar", recording)
  with counting_compiles() as compiles:
    rc = demo.main(["--context", "32", "--batch", "3", "--steps", "5", "--layers", "1", "--dim", "24",
                    "--heads", "4", "--kv-heads", "2", "--vocab", "40", "--mesh", "2x2"])
  out = capsys.readouterr().out
  assert rc == 0 and "mesh heads=2 x seq=2" in out, out
  for label, counts in seen.items():
    assert counts[-1] == counts[1], (label, counts)  # nothing compiled after decode step 1
