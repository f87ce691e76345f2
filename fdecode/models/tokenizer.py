"""A SentencePiece tokenizer rebuilt from the vocabulary a GGUF file carries.

llama.cpp's ``tokenizer.ggml.model == "llama"`` means a SentencePiece model: the file
holds its pieces (``tokenizer.ggml.tokens``), their scores and their types (the
SentencePiece enum: 1 normal, 2 unknown, 3 control, 4 user defined, 5 unused, 6 byte).
`GGUFTokenizer` writes them back into a SentencePiece ``ModelProto`` (BPE, byte
fallback, whitespace as U+2581, no dummy prefix unless ``add_space_prefix``) and lets the
``sentencepiece`` library encode and decode, rather than a tokenizer of our own.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["GGUFTokenizer"]


class GGUFTokenizer:
  """Encode / decode with the vocabulary of a GGUF file's metadata.

  Attributes:
    bos_id, eos_id: ``tokenizer.ggml.bos_token_id`` / ``eos_token_id``.
    add_bos: whether `encode` prepends ``bos_id`` (``tokenizer.ggml.add_bos_token``).
    vocab_size: V.
  """

  def __init__(self, metadata: dict):
    try:
      import sentencepiece as spm  # pylint: disable=import-outside-toplevel
      from sentencepiece import sentencepiece_model_pb2 as pb  # pylint: disable=import-outside-toplevel
    except ImportError as e:  # pragma: no cover - depends on the environment
      raise ImportError("GGUFTokenizer needs 'sentencepiece' and 'protobuf': pip install sentencepiece "
                        "protobuf") from e
    model = metadata.get("tokenizer.ggml.model")
    if model != "llama":
      raise ValueError(f"GGUFTokenizer: only SentencePiece vocabularies (tokenizer.ggml.model "
                       f"'llama') are supported, got {model!r}")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
      raise ValueError("GGUFTokenizer: the metadata has no tokenizer.ggml.tokens")
    _check_pieces(tokens)
    n = len(tokens)
    try:
      scores = np.asarray(metadata.get("tokenizer.ggml.scores", np.zeros(n)), np.float32)
      types = np.asarray(metadata.get("tokenizer.ggml.token_type", np.ones(n)), np.int64)
    except (TypeError, ValueError, OverflowError) as e:
      raise ValueError(f"GGUFTokenizer: tokenizer.ggml.scores and token_type must be numbers ({e})") from None
    if scores.shape != (n,) or types.shape != (n,):
      raise ValueError(f"GGUFTokenizer: tokenizer.ggml.scores {scores.shape} and token_type "
                       f"{types.shape} must both have one entry per token ({n},)")
    proto = pb.ModelProto()
    proto.trainer_spec.model_type = pb.TrainerSpec.BPE
    proto.trainer_spec.vocab_size = n
    proto.trainer_spec.byte_fallback = bool((types == 6).any())
    if np.isnan(scores).any():
      raise ValueError(f"GGUFTokenizer: tokenizer.ggml.scores[{int(np.argmax(np.isnan(scores)))}] is NaN; "
                       "merge scores must be numbers")
    token_id = lambda name, default: _token_id(metadata, f"tokenizer.ggml.{name}", default, n)
    self.bos_id, self.eos_id = token_id("bos_token_id", 1), token_id("eos_token_id", 2)
    unk, pad = token_id("unknown_token_id", 0), token_id("padding_token_id", None)
    # The unknown token must carry type UNKNOWN; types outside 1..6 count as normal.
    kinds = [2 if i == unk else (kind if 1 <= kind <= 6 else 1) for i, kind in enumerate(types.tolist())]
    spec = proto.trainer_spec
    spec.unk_id, spec.bos_id, spec.eos_id = unk, self.bos_id, self.eos_id
    spec.pad_id = -1 if pad is None else pad
    norm = proto.normalizer_spec
    norm.name = "identity"
    norm.add_dummy_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    norm.remove_extra_whitespaces = False
    norm.escape_whitespaces = True
    for piece, score, kind in zip(tokens, scores.tolist(), kinds):
      p = proto.pieces.add()
      p.piece, p.score, p.type = piece, score, kind
    try:
      self._sp = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
    except RuntimeError as e:  # anything the checks above missed: still a ValueError
      raise ValueError(f"GGUFTokenizer: sentencepiece rejects this vocabulary: {e}") from e
    self.add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", True))
    self.vocab_size = n

  def encode(self, text: str) -> list[int]:
    """``text`` -> token ids, with ``bos_id`` first if `add_bos`.

    Raises:
      TypeError: ``text`` is not a str.
      ValueError: ``text`` is not valid Unicode text (a lone surrogate, e.g. an undecodable
        byte of a command line, which Python keeps as U+DC80..U+DCFF): names where.
    """
    if not isinstance(text, str):
      raise TypeError(f"GGUFTokenizer.encode: text must be a str, got {type(text).__name__}")
    try:
      text.encode("utf-8")
    except UnicodeEncodeError as e:
      raise ValueError(f"GGUFTokenizer.encode: text is not valid Unicode: "
                       f"{describe_bad_text(text, e)}") from None
    ids = list(self._sp.encode(text))
    return [self.bos_id] + ids if self.add_bos else ids

  def decode(self, ids: Sequence[int]) -> str:
    """Token ids in ``[0, vocab_size)`` -> text (control tokens such as BOS / EOS drop out).

    Raises:
      ValueError: an id outside ``[0, vocab_size)`` (names the first and its index).
    """
    ids = [int(i) for i in ids]
    bad = [(k, i) for k, i in enumerate(ids) if not 0 <= i < self.vocab_size]
    if bad:
      raise ValueError(f"GGUFTokenizer.decode: ids must lie in [0, {self.vocab_size}); got "
                       f"ids[{bad[0][0]}] = {bad[0][1]} ({len(bad)} out of range)")
    return self._sp.decode(ids)


def describe_bad_text(text: str, e: UnicodeEncodeError) -> str:
  """Where ``text`` stops being UTF-8 encodable: the surrogate code point and its index,
  and for U+DC80..U+DCFF (Python's stand-in for an undecodable byte) that byte."""
  char = text[e.start]
  what = f"U+{ord(char):04X} at index {e.start} (a lone surrogate)"
  if 0xDC80 <= ord(char) <= 0xDCFF:
    what += f", which stands for the byte 0x{ord(char) - 0xDC00:02x} that is not UTF-8"
  return what


def _check_pieces(tokens) -> None:
  """Every piece a non-empty str, none repeated (whatever its type), as sentencepiece
  requires: it fails with "INTERNAL: ... is already defined" otherwise."""
  if not isinstance(tokens, list):
    raise ValueError(f"GGUFTokenizer: tokenizer.ggml.tokens must be a list of strings, got "
                     f"{type(tokens).__name__}")
  first: dict = {}
  for i, piece in enumerate(tokens):
    if not isinstance(piece, str) or not piece:
      raise ValueError(f"GGUFTokenizer: tokenizer.ggml.tokens[{i}] is {piece!r}; every piece must "
                       "be a non-empty string")
    if piece in first:
      raise ValueError(f"GGUFTokenizer: tokenizer.ggml.tokens[{i}] = {piece[:40]!r} repeats "
                       f"tokens[{first[piece]}]; pieces must be distinct")
    first[piece] = i


def _token_id(metadata: dict, key: str, default, n: int):
  """The token id under ``key`` (``default`` when absent), an int in ``[0, n)``."""
  value = metadata.get(key, default)
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < n:
    raise ValueError(f"GGUFTokenizer: {key} must be a token id in [0, {n}) (the vocabulary); got "
                     f"{value!r}")
  return int(value)
