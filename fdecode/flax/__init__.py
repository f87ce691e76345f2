"""Flax integration: a drop-in ``attention_fn`` and a decode-ready GQA attention layer.

Legend: B batch, T new tokens per sequence, L Flax cache length (keys visible to the
query), E model width, Hq query heads, Hkv kv heads, G = Hq // Hkv, S cache capacity of
`DecodeAttention`, Dk / Dv head dims.

Two entry points, for two cache layouts:

* `attention_fn` plugs into ``flax.nnx.MultiHeadAttention(attention_fn=...)`` and
  ``flax.linen.MultiHeadDotProductAttention(attention_fn=...)``. Flax owns the cache
  there, token-major ``[B, L, Hkv, D]``, with one shared ``cache_index`` for the whole
  batch and a boolean ``[B, 1, 1, L]`` mask. Decode steps run a split-KV FlashDecode
  pass that honours the mask exactly, so masks with holes (left padding, packed prompts)
  are correct too: `fdecode.flash_decode` with ``kv_layout="NHD"``, which reads the
  token-major cache in place (`fdecode.cache.layout`). Everything else (prefill,
  training, dropout, bias, sown weights) goes to Flax's own ``dot_product_attention``
  unchanged.
* `DecodeAttention` owns its cache, head-major ``[B, Hkv, S, D]`` with per-sequence
  lengths (continuous batching), and attends with `fdecode.flash_decode` directly, so it
  gets the Pallas kernel on GPU/TPU. Per layer it takes the score modifiers (sliding
  ``window``, ``logits_soft_cap``, learned ``sinks``, ``alibi``), QK-norm and its own
  RoPE base, so a Gemma-3-like stack of local and global layers is a list of them.

`RMSNorm`, `Linear` and `Embed` are Flax's with a batch-invariant mode (each row's bits
depend on that row alone: `fdecode.flax.invariant`), what the models here are built from.

Import as ``import fdecode.flax`` (this package is not re-exported by ``fdecode``).
They live in `fdecode.flax.token_major`, `fdecode.flax.decode_attention` and
`fdecode.flax.invariant`.
"""

from fdecode.flax.invariant import Embed, Linear, RMSNorm
from fdecode.flax.token_major import attention_fn
from fdecode.flax.decode_attention import DecodeAttention, alibi_slopes, apply_rope
from fdecode.flax.mla import MLADecodeAttention

__all__ = ["DecodeAttention", "Embed", "Linear", "MLADecodeAttention", "RMSNorm", "alibi_slopes", "apply_rope",
           "attention_fn"]
