"""The public entry points are typed: a type checker on a user's script sees their return
types (``return_lse`` and ``new_k`` select them) and refuses a misspelt option."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]

USER_SCRIPT = '''
import jax.numpy as jnp
from flax import nnx

import fdecode
import fdecode.flax
from fdecode.decoding.serving import Engine
from fdecode.models.base import ModelConfig, Transformer

q = jnp.zeros((2, 8, 64))
k = jnp.zeros((2, 2, 128, 64))
lengths = jnp.array([3, 4])
flag = bool(lengths[0])

out = fdecode.flash_decode(q, k, k, lengths, window=16)
reveal_type(out)
out2, lse = fdecode.flash_decode(q, k, k, lengths, return_lse=True)
reveal_type(lse)
reveal_type(fdecode.flash_decode(q, k, k, lengths, return_lse=flag))
cu = jnp.array([0, 1, 2])
reveal_type(fdecode.ragged_decode(q, k, k, lengths, None, cu, 2))
reveal_type(fdecode.ragged_decode(q, k, k, lengths, None, cu, 2, new_k=q, new_v=q))
reveal_type(fdecode.ragged_decode(q, k, k, lengths, None, cu, 2, new_k=q, new_v=q, return_lse=True))
reveal_type(fdecode.merge_states(out[None], lse[None]))
reveal_type(fdecode.plan(q, k, k, lengths, platform="gpu"))
layer = fdecode.flax.DecodeAttention(64, num_heads=4, num_kv_heads=2, head_dim=16, rngs=nnx.Rngs(0))
reveal_type(layer.decode(jnp.ones((2, 1, 64))))
engine = Engine(Transformer(ModelConfig(vocab=8, dim=8, layers=1, num_heads=1, num_kv_heads=1, head_dim=8,
                                        mlp_dim=8)))
reveal_type(engine.run())
fdecode.flash_decode(q, k, k, lengths, impl="triton")
fdecode.flash_decode(q, k, k, lengths, windw=16)
'''

ARRAY = "jax._src.basearray.Array"
EXPECTED = [
    ARRAY,
    ARRAY,
    f"{ARRAY} | tuple[{ARRAY}, {ARRAY}]",
    ARRAY,
    f"tuple[{ARRAY}, {ARRAY}, {ARRAY}]",
    f"tuple[{ARRAY}, {ARRAY}, {ARRAY}, {ARRAY}]",
    f"tuple[{ARRAY}, {ARRAY}]",
    "fdecode.api.Plans",  # a tuple[Plan, ...] with its refusals
    ARRAY,
    "dict[int, fdecode.decoding.serving.Finished]",
]


def test_a_type_checker_sees_the_public_types(tmp_path):
  script = tmp_path / "user.py"
  script.write_text(USER_SCRIPT)
  env = dict(os.environ, MYPYPATH=str(ROOT))
  result = subprocess.run(
      [sys.executable, "-m", "mypy", "--follow-imports=silent", "--no-error-summary", "--hide-error-context",
       "--cache-dir", str(tmp_path / "cache"), str(script)],
      capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
  lines = result.stdout.splitlines()
  revealed = [line.split('Revealed type is "', 1)[1].rstrip('"') for line in lines if "Revealed type is" in line]
  assert revealed == EXPECTED, result.stdout + result.stderr
  errors = [line for line in lines if ": error:" in line]
  bad_lines = {int(line.split(":")[1]) for line in errors}
  misuse = [i + 1 for i, line in enumerate(USER_SCRIPT.splitlines()) if "triton" in line or "windw" in line]
  assert bad_lines == set(misuse), result.stdout + result.stderr  # the misspelt option and impl, nothing else
  assert any("windw" in line and 'did you mean "window"' in line for line in errors), errors


def test_the_typed_keywords_are_the_declared_options():
  """The typed keyword dicts and `flash_decode`'s signature name what `fdecode.options`
  declares once (`CallArrays`, `StaticOptions`): one added there and not here fails."""
  import dataclasses
  import inspect

  import fdecode
  from fdecode import options
  from fdecode.ragged.decode import RaggedOptions
  keys = lambda typed: typed.__required_keys__ | typed.__optional_keys__
  fields = {f.name for f in dataclasses.fields(options.StaticOptions)}
  assert keys(options.DecodeOptions) == (set(options.ARRAY_ARGS[4:]) | fields)
  assert keys(options.ScoreOptions) | {"return_lse"} == set(options.RAGGED_OPTIONS) == keys(RaggedOptions)
  signature = set(inspect.signature(fdecode.flash_decode).parameters)
  assert signature == set(options.ARRAY_ARGS) | set(options.STATIC_ARGS)
