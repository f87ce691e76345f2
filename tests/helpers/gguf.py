"""A tiny random Gemma-3-shaped model written to a GGUF file with gguf's writer (the real file's
tensor names and metadata keys, some Q8_0 tensors). Skips the importing module without gguf."""

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")


Q8 = gguf.GGMLQuantizationType.Q8_0


# Tiny Gemma 3: 7 layers (layer 5 global), MQA 4 x 1 heads, window 8 < the prompts.
CFG = dict(vocab=300, dim=32, layers=7, heads=4, kv_heads=1, head_dim=16, mlp=64, window=8,
           rope_global=100.0, eps=1e-6)


QUANTIZED = ("token_embd.weight", "blk.0.attn_v.weight", "blk.1.ffn_down.weight", "blk.5.attn_q.weight")


def tiny_vocab():
  """<pad> <eos> <bos> <unk>, 256 byte pieces, then a few words (SentencePiece types)."""
  tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{i:02X}>" for i in range(256)]
  types = [3, 3, 3, 2] + [6] * 256
  words = ["▁", "a", "b", "c", "d", "e", "t", "h", "▁t", "▁th", "▁the", "he", "▁a", "ab", "▁c", "ed"]
  tokens += words + [f"<unused{i}>" for i in range(CFG["vocab"] - len(tokens) - len(words))]
  types += [1] * len(words) + [5] * (CFG["vocab"] - len(types) - len(words))
  scores = [0.0] * 260 + [-float(i) for i in range(CFG["vocab"] - 260)]
  return tokens, scores, types


def tiny_weights(seed=0):
  rng = np.random.default_rng(seed)
  e, f, d, hq, hkv = CFG["dim"], CFG["mlp"], CFG["head_dim"], CFG["heads"], CFG["kv_heads"]
  lin = lambda o, i: (rng.standard_normal((o, i)) / np.sqrt(i)).astype(np.float32)
  norm = lambda n: (1 + 0.2 * rng.standard_normal(n)).astype(np.float32)  # "+1" already in
  w = {"token_embd.weight": rng.standard_normal((CFG["vocab"], e)).astype(np.float32),
       "output_norm.weight": norm(e)}
  for i in range(CFG["layers"]):
    w.update({f"blk.{i}.{k}.weight": v for k, v in dict(
        attn_norm=norm(e), attn_q=lin(hq * d, e), attn_k=lin(hkv * d, e), attn_v=lin(hkv * d, e),
        attn_output=lin(e, hq * d), attn_q_norm=norm(d), attn_k_norm=norm(d),
        post_attention_norm=norm(e), ffn_norm=norm(e), ffn_gate=lin(f, e), ffn_up=lin(f, e),
        ffn_down=lin(e, f), post_ffw_norm=norm(e)).items()})
  return w


def write_gguf(path, weights, *, arch="gemma3", raw=None, meta=None, vocab=None):
  """A Gemma 3 GGUF as llama.cpp's converter writes it; ``raw``: {name: (bytes array, type)};
  ``meta``: {key: (value, GGUFValueType)} added or overriding; ``vocab``: (tokens, scores,
  types) instead of `tiny_vocab`."""
  w = gguf.GGUFWriter(str(path), arch)
  w.add_context_length(128)
  w.add_embedding_length(CFG["dim"])
  w.add_block_count(CFG["layers"])
  w.add_feed_forward_length(CFG["mlp"])
  w.add_head_count(CFG["heads"])
  w.add_head_count_kv(CFG["kv_heads"])
  w.add_key_length(CFG["head_dim"])
  w.add_value_length(CFG["head_dim"])
  w.add_rope_freq_base(CFG["rope_global"])
  w.add_layer_norm_rms_eps(CFG["eps"])
  w.add_sliding_window(CFG["window"])
  tokens, scores, types = vocab or tiny_vocab()
  w.add_tokenizer_model("llama")
  w.add_token_list(tokens)
  w.add_token_scores(scores)
  w.add_token_types(types)
  w.add_bos_token_id(2)
  w.add_eos_token_id(1)
  w.add_unk_token_id(3)
  w.add_pad_token_id(0)
  w.add_add_bos_token(True)
  w.add_add_space_prefix(False)
  for key, (value, kind) in (meta or {}).items():
    w.add_key_value(key, value, kind)
  for name, x in weights.items():
    if name in QUANTIZED:
      w.add_tensor(name, gguf.quants.quantize(x, Q8), raw_dtype=Q8)
    else:
      w.add_tensor(name, x)
  for name, (data, kind) in (raw or {}).items():
    w.add_tensor(name, data, raw_dtype=kind)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path
