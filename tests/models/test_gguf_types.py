"""GGUFFile's tensor types and metadata: tiny GGUF files written by gguf's own writer (tensors
quantized by ``gguf.quants.quantize``, or Q4_K blocks packed here by the ggml layout, which gguf
cannot quantize), loaded back through `GGUFFile.tensor` and compared with the float data they
came from within the quantization's error, and with gguf's own dequantization; types gguf cannot
dequantize, values float32 cannot hold and unknown type ids rejected with a readable ValueError;
metadata read through ``ReaderField.contents()`` as str / int / float / bool / list."""

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from fdecode.models.gguf import GGUFFile, supported_types  # noqa: E402

Q = gguf.GGMLQuantizationType
V = gguf.GGUFValueType


def _write(path, tensors=(), meta=(), endianess=gguf.GGUFEndian.LITTLE):
  """A GGUF file (architecture "test") of ``tensors``: (name, array, raw ggml type or None)."""
  w = gguf.GGUFWriter(str(path), "test", endianess=endianess)
  for key, value, kind in meta:
    w.add_key_value(key, value, kind)
  for name, data, kind in tensors:
    w.add_tensor(name, data, raw_dtype=kind)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


def _x(shape, seed=0):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_supported_types_come_from_gguf():
  """Every type gguf.quants.dequantize decodes is supported, the rest are not."""
  names = supported_types()
  for name in ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F64", "I8", "I32"):
    assert name in names, names
  registry = getattr(gguf.quants, "_type_traits", None)  # gguf's quant classes, where this version keeps them
  if registry is not None:
    assert {t.name for t in registry} <= set(names), names
  for kind in Q:
    if kind.name in names or kind not in gguf.GGML_QUANT_SIZES:
      continue
    with pytest.raises(NotImplementedError):  # the types left out are the ones gguf cannot decode
      gguf.quants.dequantize(np.zeros((1, gguf.GGML_QUANT_SIZES[kind][1]), np.uint8), kind)


@pytest.mark.parametrize("kind", ["F32", "F16", "BF16", "F64"])
def test_float_types_load(tmp_path, kind):
  x = _x((3, 5, 8))
  data, raw = {"F32": (x, None), "F16": (x.astype(np.float16), None), "F64": (x.astype(np.float64), None),
               "BF16": (gguf.quants.quantize(x, Q.BF16), Q.BF16)}[kind]
  f = GGUFFile(_write(tmp_path / "f.gguf", [("w", data, raw)]))
  assert f.tensor_types["w"] == kind and f.tensor_shapes["w"] == (3, 5, 8)
  got = f.tensor("w", (3, 5, 8))
  assert got.dtype == np.float32
  if kind == "BF16":  # 8 mantissa bits, round to nearest
    np.testing.assert_allclose(got, x, rtol=2.0**-8, atol=0)
    np.testing.assert_array_equal(got, gguf.quants.dequantize(data, Q.BF16).reshape(x.shape))
  else:
    np.testing.assert_array_equal(got, data.astype(np.float32))


# Worst error of a value against its block's (32 values) largest magnitude amax: half a step,
# the step being amax / 127 (Q8_0), amax / 8 (Q4_0), 2 amax / 15 (Q4_1), amax / 16 (Q5_0),
# 2 amax / 31 (Q5_1); bounded here by a whole step.
STEP = {"Q8_0": 1 / 127, "Q4_0": 1 / 8, "Q4_1": 2 / 15, "Q5_0": 1 / 16, "Q5_1": 2 / 31}


@pytest.mark.parametrize("shape", [(3, 64), (2, 3, 32)])
@pytest.mark.parametrize("kind", list(STEP))
def test_block_quantizations_load(tmp_path, kind, shape):
  """Q4_0 / Q8_0... written by gguf's quantizer load back close to the float data, exactly as
  gguf dequantizes them (a Q4_0 or Q8_0 file was refused by a hand-kept list of 7 types)."""
  x = _x(shape, seed=1)
  packed = gguf.quants.quantize(x, Q[kind])
  f = GGUFFile(_write(tmp_path / "q.gguf", [("blk.0.ffn_up.weight", packed, Q[kind])]))
  assert f.tensor_types["blk.0.ffn_up.weight"] == kind
  got = f.tensor("blk.0.ffn_up.weight", shape)
  assert got.dtype == np.float32 and got.shape == shape
  np.testing.assert_array_equal(got, gguf.quants.dequantize(packed, Q[kind]))
  amax = np.abs(x.reshape(-1, 32)).max(-1, keepdims=True)
  err = np.abs(got - x).reshape(-1, 32)
  assert (err <= STEP[kind] * amax * (1 + 1e-3)).all(), float((err / amax).max())
  assert err.max() > 0  # really quantized, not stored as floats


def _q4_k(n_blocks, seed=2):
  """``n_blocks`` Q4_K blocks (256 values each) packed by ggml's block_q4_K layout, and the
  values they stand for by its formula ``d * sc[j] * q - dmin * m[j]`` over 8 sub-blocks j of
  32 (d, dmin float16; sc, m 6-bit; q 4-bit): [n_blocks, 144] uint8, [n_blocks, 256] float32."""
  rng = np.random.default_rng(seed)
  d, dmin = np.float16(2.0**-6), np.float16(2.0**-7)
  sc, m = rng.integers(0, 64, (n_blocks, 8)), rng.integers(0, 64, (n_blocks, 8))
  q = rng.integers(0, 16, (n_blocks, 8, 32))
  scales = np.concatenate([
      (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6),   # bytes 0-3: sc[0..3], top bits of sc[4..7]
      (m[:, :4] & 0x3F) | ((m[:, 4:] >> 4) << 6),     # bytes 4-7: m[0..3], top bits of m[4..7]
      (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4),  # bytes 8-11: low bits of sc[4..7], m[4..7]
  ], axis=1)
  qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(n_blocks, 128)  # sub-blocks 2p (low) / 2p+1 (high nibble)
  head = np.tile(np.array([d, dmin], np.float16).view(np.uint8), (n_blocks, 1))
  blocks = np.concatenate([head, scales.astype(np.uint8), qs.astype(np.uint8)], axis=1)
  values = (np.float32(d) * sc[:, :, None] * q - np.float32(dmin) * m[:, :, None]).astype(np.float32)
  return blocks, values.reshape(n_blocks, 256)


def test_q4_k_loads_to_the_ggml_formula(tmp_path):
  """Q4_K (the Gemma 3 270M file's main type) from blocks packed here, not by gguf."""
  blocks, values = _q4_k(6)
  f = GGUFFile(_write(tmp_path / "k.gguf", [("w", blocks.reshape(3, 2 * 144), Q.Q4_K)]))
  assert f.tensor_types["w"] == "Q4_K" and f.tensor_shapes["w"] == (3, 512)
  np.testing.assert_array_equal(f.tensor("w", (3, 512)), values.reshape(3, 512))


def test_integer_tensors_load_where_float32_holds_them(tmp_path):
  ints = np.array([[-2**24, -7, 0, 2**24]])
  path = _write(tmp_path / "i.gguf", [("i8", ints.clip(-128, 127).astype(np.int8), None),
                                      ("i32", ints.astype(np.int32), None), ("i64", ints.astype(np.int64), None),
                                      ("big", (ints + 1).astype(np.int32), None),
                                      ("f64", np.array([1.5, 1e300]), None)])
  f = GGUFFile(path)
  np.testing.assert_array_equal(f.tensor("i8", (1, 4)), [[-128, -7, 0, 127]])
  for name in ("i32", "i64"):
    np.testing.assert_array_equal(f.tensor(name, (1, 4)), ints.astype(np.float32))
  with pytest.raises(ValueError, match=r"tensor 'big' \(I32\) .* holds 16777217 at \(0, 3\) .*beyond \+-2\*\*24"):
    f.tensor("big", (1, 4))
  with pytest.raises(ValueError, match=r"tensor 'f64' \(F64\) .* holds 1e\+300 at \(1,\) .*beyond float32's range"):
    f.tensor("f64", (2,))


def _unsupported():
  """A ggml type with a block layout that the installed gguf cannot dequantize (Q8_1, Q8_K...)."""
  kinds = [k for k in Q if k in gguf.GGML_QUANT_SIZES and k.name not in supported_types()]
  if not kinds:  # pragma: no cover - a gguf that decodes every type
    pytest.skip("the installed gguf dequantizes every ggml type")
  return kinds[0]


def test_type_gguf_cannot_dequantize_is_a_clear_error(tmp_path):
  kind = _unsupported()
  block, size = gguf.GGML_QUANT_SIZES[kind]
  f = GGUFFile(_write(tmp_path / "u.gguf", [("blk.0.attn_q.weight", np.zeros((2, size), np.uint8), kind)]))
  assert f.tensor_types["blk.0.attn_q.weight"] == kind.name
  supported = ", ".join(supported_types())
  with pytest.raises(ValueError, match=rf"tensor 'blk\.0\.attn_q\.weight' \(2, {block}\) in '.*u\.gguf' has ggml "
                                       rf"type {kind.name}, which the installed gguf \S+ cannot dequantize; "
                                       rf"supported: {supported}$"):
    f.tensor("blk.0.attn_q.weight", (2, block))
  with pytest.raises(ValueError, match=rf"'blk\.0\.attn_q\.weight' has shape \(2, {block}\), expected \(2, 8\)"):
    f.tensor("blk.0.attn_q.weight", (2, 8))


def test_unknown_type_id_is_not_a_readable_file(tmp_path):
  """A type id no ggml version defines (patched into the tensor's header entry)."""
  path = _write(tmp_path / "x.gguf", [("w", np.ones((2, 4), np.float32), None)])
  raw = bytearray(path.read_bytes())
  at = raw.index(b"w\x02\x00\x00\x00") + 1  # the name "w", then n_dims (u32) = 2, dims (2 x u64), type (u32)
  assert raw[at + 20:at + 24] == bytes([0, 0, 0, 0])  # F32
  raw[at + 20:at + 24] = (250).to_bytes(4, "little")
  path.write_bytes(bytes(raw))
  with pytest.raises(ValueError, match=r"is not a readable GGUF file \(ValueError: \S*250\)? is not a "
                                       r"valid GGMLQuantizationType"):
    GGUFFile(path)


def test_metadata_read_through_reader_field_contents(tmp_path):
  meta = [("t.str", "héllo", V.STRING), ("t.u32", 7, V.UINT32), ("t.i64", -2**40, V.INT64),
          ("t.f32", 0.5, V.FLOAT32), ("t.f64", 1e-300, V.FLOAT64), ("t.bool", True, V.BOOL),
          ("t.strs", ["a", "▁b", ""], V.ARRAY), ("t.floats", [0.25, -1.5], V.ARRAY), ("t.ints", [3, -4], V.ARRAY),
          ("t.bools", [True, False], V.ARRAY)]
  f = GGUFFile(_write(tmp_path / "m.gguf", meta=meta))
  expected = {"t.str": "héllo", "t.u32": 7, "t.i64": -2**40, "t.f32": 0.5, "t.f64": 1e-300, "t.bool": True,
              "t.strs": ["a", "▁b", ""], "t.floats": [0.25, -1.5], "t.ints": [3, -4], "t.bools": [True, False]}
  for key, value in expected.items():
    assert f.metadata[key] == value and type(f.metadata[key]) is type(value), (key, f.metadata[key])
  assert [type(v) for v in f.metadata["t.bools"]] == [bool, bool]
  assert f.metadata["general.architecture"] == "test" and not any(k.startswith("GGUF.") for k in f.metadata)
  assert f.int_value("t.u32") == 7 and f.float_value("t.f32") == 0.5 and f.require("t.bool", bool) is True


def test_metadata_string_that_is_not_utf8(tmp_path):
  path = _write(tmp_path / "b.gguf", meta=[("t.bad", b"ab\xff", V.STRING)])
  with pytest.raises(ValueError, match=r"metadata 't\.bad' holds a string that is not UTF-8 .* in '.*b\.gguf'"):
    GGUFFile(path)


def _every_kind(tmp_path, name, endianess=gguf.GGUFEndian.LITTLE):
  meta = [("t.str", "héllo", V.STRING), ("t.u8", 200, V.UINT8), ("t.i16", -3, V.INT16), ("t.u64", 2**60, V.UINT64),
          ("t.f32", 0.1, V.FLOAT32), ("t.strs", ["a", "▁b", ""] * 50, V.ARRAY), ("t.floats", [0.1, -1.5], V.ARRAY),
          ("t.ints", list(range(-5, 300)), V.ARRAY), ("t.bools", [True, False], V.ARRAY)]
  q8 = gguf.quants.quantize(_x((4, 64), 1), Q.Q8_0)
  tensors = [("f32", _x((3, 5)), None), ("f16", _x((2, 8), 2).astype(np.float16), None),
             ("i32", np.arange(-6, 6, dtype=np.int32).reshape(3, 4), None), ("q8", q8, Q.Q8_0)]
  return _write(tmp_path / name, tensors, meta, endianess)


def test_header_reads_as_gguf_reader_does(tmp_path):
  """`GGUFFile` parses the header itself (gguf's reader took 18 s on Gemma 3's vocabulary):
  every metadata value, of the same Python type, and every tensor's stored data as
  ``gguf.GGUFReader`` reads them."""
  path = _every_kind(tmp_path, "all.gguf")
  f, reader = GGUFFile(path), gguf.GGUFReader(path)
  expected = {n: field.contents() for n, field in reader.fields.items() if not n.startswith("GGUF.")}
  assert f.metadata == expected
  for key, value in expected.items():
    values = value if isinstance(value, list) else [value]
    got = f.metadata[key] if isinstance(value, list) else [f.metadata[key]]
    assert [type(v) for v in got] == [type(v) for v in values], key
  for t in reader.tensors:
    raw = f._raw(t.name)  # pylint: disable=protected-access
    assert raw.dtype == t.data.dtype and raw.shape == t.data.shape and np.array_equal(raw, t.data), t.name
    assert f.tensor_types[t.name] == t.tensor_type.name


def test_big_endian_file_loads_as_the_little_endian_one(tmp_path):
  little = GGUFFile(_every_kind(tmp_path, "le.gguf"))
  big = GGUFFile(_every_kind(tmp_path, "be.gguf", gguf.GGUFEndian.BIG))
  assert big.metadata == little.metadata and big.tensor_shapes == little.tensor_shapes
  for name, shape in little.tensor_shapes.items():
    np.testing.assert_array_equal(big.tensor(name, shape), little.tensor(name, shape), err_msg=name)


def test_truncated_tensor_data_is_a_clear_error(tmp_path):
  path = _write(tmp_path / "t.gguf", [("w", _x((64, 64)), None)])
  path.write_bytes(path.read_bytes()[:-100])
  f = GGUFFile(path)  # the header is whole
  with pytest.raises(ValueError, match=r"tensor 'w' runs past the end of .*t\.gguf' \(truncated file\)"):
    f.tensor("w", (64, 64))
  path.write_bytes(path.read_bytes()[:30])
  with pytest.raises(ValueError, match=r"is not a readable GGUF file \(error: "):
    GGUFFile(path)
