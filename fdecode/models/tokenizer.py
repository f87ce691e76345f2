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
      raise ImportError("GGUFTokenizer needs 'sentencepiece' and 'protobuf': "
                        "pip install 'fdecode[demo]'") from e
    model = metadata.get("tokenizer.ggml.model")
    if model != "llama":
      raise ValueError(f"GGUFTokenizer: only SentencePiece vocabularies (tokenizer.ggml.model "
                       f"'llama') are supported, got {model!r}")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not tokens:
      raise ValueError("GGUFTokenizer: the metadata has no tokenizer.ggml.tokens")
    n = len(tokens)
    scores = np.asarray(metadata.get("tokenizer.ggml.scores", np.zeros(n)), np.float32)
    types = np.asarray(metadata.get("tokenizer.ggml.token_type", np.ones(n)), np.int64)
    if scores.shape != (n,) or types.shape != (n,):
      raise ValueError(f"GGUFTokenizer: tokenizer.ggml.scores {scores.shape} and token_type "
                       f"{types.shape} must both have one entry per token ({n},)")
    proto = pb.ModelProto()
    proto.trainer_spec.model_type = pb.TrainerSpec.BPE
    proto.trainer_spec.vocab_size = n
    proto.trainer_spec.byte_fallback = bool((types == 6).any())
    self.bos_id = int(metadata.get("tokenizer.ggml.bos_token_id", 1))
    self.eos_id = int(metadata.get("tokenizer.ggml.eos_token_id", 2))
    unk = int(metadata.get("tokenizer.ggml.unknown_token_id", 0))
    pad = metadata.get("tokenizer.ggml.padding_token_id")
    spec = proto.trainer_spec
    spec.unk_id, spec.bos_id, spec.eos_id = unk, self.bos_id, self.eos_id
    spec.pad_id = -1 if pad is None else int(pad)
    norm = proto.normalizer_spec
    norm.name = "identity"
    norm.add_dummy_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
    norm.remove_extra_whitespaces = False
    norm.escape_whitespaces = True
    for i, (piece, score, kind) in enumerate(zip(tokens, scores.tolist(), types.tolist())):
      p = proto.pieces.add()
      p.piece, p.score = piece, score
      # The unknown token must carry type UNKNOWN; types outside 1..6 count as normal.
      p.type = 2 if i == unk else (kind if 1 <= kind <= 6 else 1)
    self._sp = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
    self.add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", True))
    self.vocab_size = n

  def encode(self, text: str) -> list[int]:
    """``text`` -> token ids, with ``bos_id`` first if `add_bos`."""
    ids = list(self._sp.encode(text))
    return [self.bos_id] + ids if self.add_bos else ids

  def decode(self, ids: Sequence[int]) -> str:
    """Token ids -> text (control tokens such as BOS / EOS drop out)."""
    return self._sp.decode([int(i) for i in ids])
