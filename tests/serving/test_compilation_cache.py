"""JAX's persistent compilation cache as fdecode turns it on (`fdecode.decoding.compilation_cache`):
an Engine in a fresh process loads every program a first one compiled; off writes nothing;
a folder the user gave JAX is the one used. Subprocesses, each with its own HOME and
XDG_CACHE_HOME under tmp_path, so that nothing reaches the user's ~/.cache."""

import json
import os
import subprocess
import sys

import jax
import pytest

from fdecode.cli import demo
from fdecode.decoding import compilation_cache
from fdecode.decoding.serving import Engine
from fdecode.models.base import ModelConfig, Transformer

# One process: a tiny Engine (two buckets) serving two staggered requests, or (``serve``
# false) only built, then one small program compiled; prints the cache folder JAX ended
# with, the cache lookups / hits of what ran after the engine was built (`Engine.run`: the
# buckets' programs; the small ones that build the pool run before the engine turns the
# cache on) and the tokens.
_ENGINE_RUN = """
import json, sys
import jax, jax.numpy as jnp
from fdecode.decoding import compilation_cache
from fdecode.decoding.serving import Engine, Request
from fdecode.models.base import ModelConfig, Transformer
arg, serve = json.loads(sys.argv[1]), sys.argv[2] == "serve"
cfg = ModelConfig(vocab=64, dim=32, layers=1, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=32)
model = Transformer(cfg, seed=0)
engine = Engine(model, max_seqs=2, token_budget=8, max_len=16, page_size=4, buckets=(4, 8), compilation_cache=arg)
a = engine.submit(Request([1, 2, 3, 4, 5], 4))
b = engine.submit(Request([6, 7], 3, arrival=1))
with compilation_cache.counting() as counts:
  if serve:
    done = engine.run()
    tokens = [done[a].tokens, done[b].tokens]
  else:
    tokens = jax.jit(lambda x: x * 2 + 1)(jnp.arange(3.0)).tolist()
print(json.dumps({"dir": jax.config.jax_compilation_cache_dir, "lookups": counts["lookups"],
                  "hits": counts["hits"], "tokens": tokens}))
"""


def _files(root) -> list[str]:
  return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def _run(tmp_path, arg=True, serve=False, **env_vars):
  """`_ENGINE_RUN` in a fresh process, with HOME and XDG_CACHE_HOME under ``tmp_path``
  and no cache setting of the caller's; programs kept whatever their compile time (the
  tiny model's take well under JAX's 1 s threshold)."""
  env = {k: v for k, v in os.environ.items()
         if k not in ("JAX_COMPILATION_CACHE_DIR", compilation_cache.ENV_VAR, "XDG_CACHE_HOME")}
  env.update(HOME=str(tmp_path / "home"), XDG_CACHE_HOME=str(tmp_path / "xdg"),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0", **env_vars)
  run = subprocess.run([sys.executable, "-c", _ENGINE_RUN, json.dumps(arg), "serve" if serve else "build"],
                       env=env, capture_output=True, text=True, timeout=300, check=False)
  assert run.returncode == 0, run.stderr
  return json.loads(run.stdout.strip().splitlines()[-1])


def test_second_engine_process_compiles_nothing(tmp_path):
  """The default folder ($XDG_CACHE_HOME/fdecode/jax): the first process writes its
  buckets' programs there; a second one loads every one of them (each compile request of
  its steps a hit) and writes no new file."""
  where = tmp_path / "xdg" / "fdecode" / "jax"
  first = _run(tmp_path, serve=True)
  written = _files(where)
  assert first["dir"] == str(where) and first["lookups"] > 0 and first["hits"] == 0, first
  assert len(written) == first["lookups"] and all(f.startswith("jit__serve_step") for f in written), written
  second = _run(tmp_path, serve=True)
  assert second["hits"] == second["lookups"] == first["lookups"], (first, second)
  assert _files(where) == written
  assert second["tokens"] == first["tokens"]
  assert not (tmp_path / "home").exists()


@pytest.mark.parametrize("arg, env", [(False, {}), ("{tmp}/mine", {compilation_cache.ENV_VAR: "0"})],
                         ids=["engine-false", "env-0-over-a-path"])
def test_off_writes_nothing(tmp_path, arg, env):
  arg = arg.format(tmp=tmp_path) if isinstance(arg, str) else arg
  out = _run(tmp_path, arg, **env)
  assert out["dir"] is None and out["lookups"] > 0 and out["hits"] == 0, out
  assert _files(tmp_path) == []


def test_a_folder_configured_in_jax_is_used(tmp_path):
  """JAX_COMPILATION_CACHE_DIR wins over the default folder and over the engine's own path."""
  mine = tmp_path / "user-cache"
  out = _run(tmp_path, str(tmp_path / "engine-path"), JAX_COMPILATION_CACHE_DIR=str(mine))
  assert out["dir"] == str(mine), out
  assert _files(mine) and os.listdir(tmp_path) == ["user-cache"]


def test_a_given_folder_is_used_when_jax_has_none(tmp_path):
  out = _run(tmp_path, str(tmp_path / "engine-path"))
  assert out["dir"] == str(tmp_path / "engine-path") and _files(tmp_path / "engine-path"), out
  assert not (tmp_path / "xdg").exists()


@pytest.fixture
def jax_cache_config(monkeypatch):
  """No cache folder and the cache enabled, restored afterwards; nothing may compile in
  between (a compile would open the cache at the folder set, for the whole process)."""
  saved = jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache
  for name in ("JAX_COMPILATION_CACHE_DIR", compilation_cache.ENV_VAR, "XDG_CACHE_HOME"):
    monkeypatch.delenv(name, raising=False)
  jax.config.update("jax_compilation_cache_dir", None)
  jax.config.update("jax_enable_compilation_cache", True)
  yield
  jax.config.update("jax_compilation_cache_dir", saved[0])
  jax.config.update("jax_enable_compilation_cache", saved[1])


def test_enable_decides_the_folder(jax_cache_config, tmp_path, monkeypatch):
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert compilation_cache.default_dir() == str(tmp_path / "home" / ".cache" / "fdecode" / "jax")
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert compilation_cache.default_dir() == str(tmp_path / "xdg" / "fdecode" / "jax")
  monkeypatch.setenv(compilation_cache.ENV_VAR, "False")
  assert compilation_cache.enable() is None and jax.config.jax_compilation_cache_dir is None
  monkeypatch.delenv(compilation_cache.ENV_VAR)
  # JAX_COMPILATION_CACHE_DIR set after jax was imported: handed to JAX, the path ignored.
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path / "env"))
  assert compilation_cache.enable(tmp_path / "p") == str(tmp_path / "env") == jax.config.jax_compilation_cache_dir
  monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
  jax.config.update("jax_compilation_cache_dir", None)
  assert compilation_cache.enable() == str(tmp_path / "xdg" / "fdecode" / "jax")
  assert (tmp_path / "xdg" / "fdecode" / "jax").stat().st_mode & 0o777 == 0o700
  assert compilation_cache.enable(tmp_path / "other") == str(tmp_path / "xdg" / "fdecode" / "jax")  # first set wins
  jax.config.update("jax_compilation_cache_dir", None)
  jax.config.update("jax_enable_compilation_cache", False)
  assert compilation_cache.enable() is None and jax.config.jax_compilation_cache_dir is None
  jax.config.update("jax_enable_compilation_cache", True)
  (tmp_path / "file").write_text("")
  with pytest.warns(UserWarning, match="no persistent compilation cache, cannot create"):
    assert compilation_cache.enable(tmp_path / "file" / "jax") is None
  assert jax.config.jax_compilation_cache_dir is None
  assert not (tmp_path / "home").exists()


@pytest.mark.parametrize("flag", [[], ["--no-compilation-cache"]])
def test_demo_turns_the_cache_on_unless_told(jax_cache_config, tmp_path, monkeypatch, flag):
  """The demo sets the cache up before anything compiles (here: before it would load)."""
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  seen = {}

  def stop(p, a, mesh_shape, cache_note):
    seen.update(note=cache_note(), enabled=jax.config.jax_enable_compilation_cache,
                folder=jax.config.jax_compilation_cache_dir)
    return 0

  monkeypatch.setattr(demo, "_gemma", stop)
  assert demo.main(flag) == 0
  if flag:
    assert seen == dict(note="  compilation cache: off", enabled=False, folder=None)
  else:
    where = str(tmp_path / "fdecode" / "jax")
    assert seen == dict(note=f"  compilation cache ({where}): 0 of 0 programs loaded from it, the rest compiled "
                             f"(kept there when that took >= {jax.config.jax_persistent_cache_min_compile_time_secs}s)",
                        enabled=True, folder=where)


def test_engine_rejects_a_compilation_cache_that_is_no_bool_or_path():
  model = Transformer(ModelConfig(vocab=64, dim=32, layers=1, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=32))
  with pytest.raises(ValueError, match="compilation_cache must be a bool or a folder path"):
    Engine(model, max_seqs=2, token_budget=8, max_len=16, page_size=4, compilation_cache=1)
