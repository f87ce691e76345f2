"""sharded_flash_decode and combine_across on 8 simulated CPU devices (see conftest.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import fdecode
from fdecode.reference import reference_decode
from fdecode.devtools.collectives import collective_bytes
from helpers import assert_attention_reordered, assert_close, make_problem, max_abs, tol
from helpers.paged import paged_shards

AUTO3 = (AxisType.Auto,) * 3
# S = 64 on 4 sequence shards: chunks of 16. With T = 4 the causal window straddles a
# chunk end for L - off in {17, 18}: lengths 17, 18, 34, 50 hit that on devices 0..2.
LENGTHS = [64, 17, 18, 34, 50, 16, 0, 1]


def _mesh(shape, names, axis_types=None):
  return jax.make_mesh(shape, names, axis_types=axis_types)


@jax.jit
def _expected(q, k, v, lengths):
  """(float32 reference, single-device flash_decode), each as (out, lse)."""
  q4 = q[:, None] if q.ndim == 3 else q
  ref, ref_lse = reference_decode(q4, k, v, lengths)
  if q.ndim == 3:
    ref, ref_lse = ref[:, 0], ref_lse[:, 0]
  single = fdecode.flash_decode(q, k, v, lengths, impl="xla", return_lse=True)
  return (ref, ref_lse), single


def _check(q, k, v, lengths, out, lse):
  """Against the float32 reference and against single-device flash_decode."""
  t = tol(q.dtype)
  for (e, e_lse), what in zip(_expected(q, k, v, lengths), ("vs reference", "vs single device")):
    assert_close(out, e, atol=t["atol"], rtol=t["rtol"], what=f"out {what}")
    assert_close(lse, e_lse, atol=t["lse"], rtol=t["lse"], what=f"lse {what}")


@pytest.mark.parametrize("mesh_shape,names,roles,t,axis_types", [
    ((8,), ("x",), dict(seq_axis="x"), None, None),                            # pure sequence parallel
    ((2, 4), ("d", "s"), dict(batch_axis="d", seq_axis="s"), 4, None),         # T=4 straddles chunks
    ((2, 4), ("d", "s"), dict(batch_axis="d", seq_axis="s"), 4, AUTO3[:2]),
    ((2, 2, 2), ("b", "h", "s"), dict(batch_axis="b", head_axis="h", seq_axis="s"), 3, None),
    ((2, 2, 2), ("b", "h", "s"), dict(batch_axis="b", head_axis="h", seq_axis="s"), None, AUTO3),
    ((2, 4), ("a", "b"), dict(seq_axis=("a", "b")), 4, None),                  # two axes as one
], ids=["seq8", "batch2-seq4-T4", "batch2-seq4-T4-auto", "b-h-s-T3", "b-h-s-auto", "seq(a,b)-T4"])
def test_matches_single_device(mesh_shape, names, roles, t, axis_types):
  q, k, v = make_problem(1, b=8, t=t, hq=4, hkv=2, s=64, dk=32)
  lengths = jnp.array(LENGTHS, jnp.int32)
  mesh = _mesh(mesh_shape, names, axis_types)
  out, lse = fdecode.sharded_flash_decode(q, k, v, lengths, mesh=mesh, impl="xla",
                                          return_lse=True, **roles)
  _check(q, k, v, lengths, out, lse)
  batch, head = roles.get("batch_axis"), roles.get("head_axis")
  want = P(batch, head, None) if t is None else P(batch, None, head, None)
  assert out.sharding.is_equivalent_to(NamedSharding(mesh, want), out.ndim), out.sharding


def test_causal_windows_straddling_chunk_ends():
  """Every length whose causal window straddles a chunk end (kv_offset gives each device
  its exact share), for every query: T=5 on 4 chunks of 8."""
  q, k, v = make_problem(2, b=8, t=5, hq=2, hkv=1, s=32, dk=16)
  mesh = _mesh((4,), ("s",))
  for lengths in ([9, 10, 11, 12, 13, 8, 7, 32], [25, 26, 27, 28, 17, 18, 19, 20]):
    lengths = jnp.array(lengths, jnp.int32)
    out, lse = fdecode.sharded_flash_decode(q, k, v, lengths, mesh=mesh, seq_axis="s",
                                            impl="xla", return_lse=True)
    _check(q, k, v, lengths, out, lse)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_pallas_seq_and_heads(layout):
  """The interpreted Triton kernel on each device's share (NHD: read in place)."""
  q, k, v = make_problem(3, b=2, t=2, hq=4, hkv=2, s=64, dk=32)
  lengths = jnp.array([33, 17], jnp.int32)
  mesh = _mesh((2, 2), ("h", "s"))
  kc, vc = (k, v) if layout == "HND" else (k.swapaxes(1, 2), v.swapaxes(1, 2))
  out, lse = fdecode.sharded_flash_decode(q, kc, vc, lengths, mesh=mesh, head_axis="h", seq_axis="s",
                                          impl="pallas", block_k=16, return_lse=True, kv_layout=layout)
  _check(q, k, v, lengths, out, lse)


@pytest.mark.parametrize("gran", [dict(tile=None), dict(tile=8), dict(per_tensor=True)],
                         ids=["per-token", "tile8", "per-tensor"])
@pytest.mark.parametrize("roles,shape", [(dict(head_axis="h", seq_axis="s"), (2, 4)),
                                         (dict(head_axis="h"), (8,))], ids=["h2-s4", "h8-replicated-kv"])
def test_quantized_cache_scales_split_with_the_cache(gran, roles, shape):
  """int8 cache with scales of every granularity: the scales follow the cache's split."""
  from fdecode.cache.quant import quantize
  q, k, v = make_problem(9, b=2, t=2, hq=8, hkv=2, s=32, dk=16)
  kq, ks = quantize(k, jnp.int8, **gran)
  vq, vs = quantize(v, jnp.int8, **gran)
  lengths = jnp.array([32, 11], jnp.int32)
  mesh = _mesh(shape, tuple(roles.values()) if len(shape) == 2 else ("h",))
  out = fdecode.sharded_flash_decode(q, kq, vq, lengths, mesh=mesh, impl="xla", k_scale=ks,
                                     v_scale=vs, **roles)
  single = fdecode.flash_decode(q, kq, vq, lengths, k_scale=ks, v_scale=vs, impl="xla")
  assert_close(out, single, atol=3e-5, rtol=3e-5)


def test_few_kv_heads_are_replicated_and_query_groups_split():
  """Hkv=2 on 8 devices: each kv head on 4 devices, each with 2 of its 8 query heads."""
  q, k, v = make_problem(4, b=2, t=None, hq=16, hkv=2, s=32, dk=16)
  lengths = jnp.array([32, 5], jnp.int32)
  mesh = _mesh((8,), ("h",))
  out, lse = fdecode.sharded_flash_decode(q, k, v, lengths, mesh=mesh, head_axis="h",
                                          impl="xla", return_lse=True)
  _check(q, k, v, lengths, out, lse)
  assert out.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "h", None)), 3)


def test_bfloat16_under_jit_with_presharded_and_missharded_inputs():
  q, k, v = make_problem(5, b=8, t=None, hq=4, hkv=2, s=64, dk=32, dtype=jnp.bfloat16)
  lengths = jnp.array(LENGTHS, jnp.int32)
  mesh = _mesh((2, 4), ("b", "s"))
  step = jax.jit(functools.partial(fdecode.sharded_flash_decode, mesh=mesh, batch_axis="b",
                                   seq_axis="s", impl="xla", return_lse=True))
  expected = step(q, k, v, lengths)  # unsharded (single-device) inputs
  _check(q, k, v, lengths, *expected)
  # Already laid out as sharded_flash_decode wants them, and laid out some other way.
  put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
  for args in ((put(q, "b"), put(k, "b", None, "s"), put(v, "b", None, "s"), put(lengths, "b")),
               (put(q, None, "s"), put(k, "s", "b"), put(v, None, "b"), put(lengths, "s"))):
    # Other input shardings compile other programs (other partitioning, other fusions):
    # equal within float32 reordering, not bit for bit.
    assert_attention_reordered(step(*args), expected, keys=int(max(LENGTHS)), dk=q.shape[-1], values=max_abs(v))


def test_seq_parallel_sends_states_not_cache_bytes():
  """Compiled HLO: only O(B*Hq*Dv) values cross devices; batch/head splits send nothing."""
  b, t, hq, hkv, s, d = 2, 2, 4, 2, 16384, 64  # abstract: compiled, never allocated
  q = jax.ShapeDtypeStruct((b, t, hq, d), jnp.float32)
  k = jax.ShapeDtypeStruct((b, hkv, s, d), jnp.float32)
  lengths = jax.ShapeDtypeStruct((b,), jnp.int32)
  mesh = _mesh((8,), ("s",))
  step = jax.jit(functools.partial(fdecode.sharded_flash_decode, mesh=mesh, seq_axis="s",
                                   impl="xla", return_lse=True))
  sent = collective_bytes(step.lower(q, k, k, lengths).compile().as_text())
  assert sent, "seq parallel must communicate"
  assert set(sent) <= {"all-gather", "all-reduce"}, sent
  cache_per_device = 2 * b * hkv * s * d * 4 // 8
  state = b * t * hq * (d + 1) * 4  # o and lse, float32
  total = sum(sum(x) for x in sent.values())
  # Each device receives the 8 devices' states (async ops may count operand + result).
  assert total <= 2 * 8 * state, (sent, state)
  assert total * 100 < cache_per_device, (sent, cache_per_device)
  k2 = jax.ShapeDtypeStruct((b, 4, 256, d), jnp.float32)
  hlo = jax.jit(functools.partial(fdecode.sharded_flash_decode, mesh=_mesh((2, 4), ("b", "h")),
                                  batch_axis="b", head_axis="h", impl="xla")).lower(
      q, k2, k2, lengths).compile().as_text()
  assert not collective_bytes(hlo), collective_bytes(hlo)


def test_combine_across_in_a_user_shard_map_is_exact_and_deterministic():
  q, k, v = make_problem(7, b=2, t=None, hq=4, hkv=2, s=64, dk=32)
  lengths = jnp.array([64, 21], jnp.int32)
  mesh = _mesh((4,), ("s",), (AxisType.Auto,))

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(P(), P(None, None, "s"),
                                                        P(None, None, "s"), P()),
                     out_specs=(P(), P(), P("s")))
  def decode(q, k, v, lengths):
    chunk = k.shape[2]
    local = jnp.clip(lengths - jax.lax.axis_index("s") * chunk, 0, chunk)
    o, lse = fdecode.flash_decode(q, k, v, local, impl="xla", return_lse=True)
    o, lse = fdecode.combine_across(o, lse, "s")
    return o, lse, o[None]  # the last: every device's copy, to compare them

  out, lse, copies = jax.jit(decode)(q, k, v, lengths)
  _check(q, k, v, lengths, out, lse)
  copies = np.asarray(copies)
  for i in range(1, 4):
    np.testing.assert_array_equal(copies[i], copies[0])  # bitwise identical on every device
  again = jax.jit(decode)(q, k, v, lengths)
  np.testing.assert_array_equal(np.asarray(again[0]), np.asarray(out))
  with pytest.raises(ValueError, match=r"o.shape\[:-1\] must equal lse.shape"):
    jax.shard_map(lambda o, l: fdecode.combine_across(o, l, "s"), mesh=mesh,
                  in_specs=(P(), P()), out_specs=(P(), P()))(jnp.zeros((2, 3, 8)), jnp.zeros((2, 4)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_combine_across_carries_every_bit_of_each_state(dtype):
  """The gathered states reach the merge bit for bit, NaN, inf, -0.0 and empty parts
  included (a gather by float ``pmax`` would drop the NaN on XLA:CPU): the result equals
  `merge_states` of the stacked states, bit for bit, on 1-D and 2-D axes, Explicit and
  Auto meshes."""
  rng = np.random.default_rng(0)
  o = jnp.asarray(rng.standard_normal((8, 3, 4)), dtype)
  o = o.at[1, 0, 0].set(jnp.nan).at[2, 1].set(-0.0).at[3, 2, 1].set(jnp.inf)
  lse = jnp.asarray(rng.standard_normal((8, 3)), jnp.float32)
  lse = lse.at[4, 0].set(jnp.nan).at[5].set(-jnp.inf).at[6, 1].set(jnp.inf)
  want_o, want_lse = fdecode.merge_states(o, lse, axis=0)
  bits = lambda x: np.asarray(x).view(np.uint16 if np.dtype(x.dtype).itemsize == 2 else np.uint32)
  for shape, names in (((8,), ("s",)), ((2, 4), ("a", "b"))):
    axes = names[0] if len(names) == 1 else names
    for types in (AxisType.Explicit, AxisType.Auto):
      mesh = _mesh(shape, names, (types,) * len(names))
      spec = P(axes)
      fn = jax.jit(jax.shard_map(lambda o, l: fdecode.combine_across(o[0], l[0], axes), mesh=mesh,
                                 in_specs=(spec, spec), out_specs=(P(), P())))
      shard = jax.sharding.NamedSharding(mesh, spec)
      got_o, got_lse = fn(jax.device_put(o, shard), jax.device_put(lse, shard))
      np.testing.assert_array_equal(bits(got_o), bits(want_o))
      np.testing.assert_array_equal(bits(got_lse), bits(want_lse))


@pytest.mark.parametrize("shape,roles,hq,hkv,pattern", [
    ((8,), dict(head_axis="x"), 6, 3, r"head_axis of size 8 must divide Hkv=3.*k.shape=\(4, 3, 64, 16\)"),
    ((8,), dict(batch_axis="x"), 4, 2, r"batch_axis of size 8 must divide the batch B=4"),
    ((2, 4), dict(seq_axis="a", batch_axis="a"), 4, 2, r"mesh axis 'a' is given as both seq_axis and batch_axis"),
    ((8,), dict(seq_axis="nope"), 4, 2, r"seq_axis='nope' is not an axis of the mesh"),
])
def test_errors(shape, roles, hq, hkv, pattern):
  q, k, v = make_problem(8, b=4, t=None, hq=hq, hkv=hkv, s=64, dk=16)
  mesh = _mesh(shape, ("x",) if len(shape) == 1 else ("a", "b"))
  with pytest.raises(ValueError, match=pattern):
    fdecode.sharded_flash_decode(q, k, v, jnp.full((4,), 8, jnp.int32), mesh=mesh, **roles)


def test_errors_shapes_and_values():
  q, k, v = make_problem(9, b=2, t=None, hq=4, hkv=2, s=60, dk=16)
  mesh = _mesh((8,), ("x",))
  with pytest.raises(ValueError, match=r"seq_axis of size 8 must divide the cache capacity S=60"):
    fdecode.sharded_flash_decode(q, k, v, jnp.array([3, 4]), mesh=mesh, seq_axis="x")
  with pytest.raises(ValueError, match=r"lengths must lie in \[0, S=60\]"):
    fdecode.sharded_flash_decode(q, k, v, jnp.array([3, 61]), mesh=mesh, seq_axis="x")
  with pytest.raises(ValueError, match=r"Hq \(4\) must be a multiple of Hkv \(3\)"):  # flash_decode's own check
    fdecode.sharded_flash_decode(q, k[:, :1].repeat(3, 1), v[:, :1].repeat(3, 1), jnp.array([3, 4]),
                                 mesh=mesh, seq_axis="x")


@pytest.mark.parametrize("roles,shape,names", [
    (dict(seq_axis="s"), (4,), ("s",)),
    (dict(batch_axis="b", head_axis="h", seq_axis="s"), (2, 2, 2), ("b", "h", "s")),
    (dict(head_axis="h"), (8,), ("h",)),  # kv heads replicated
], ids=["seq4", "b-h-s", "h8-replicated"])
def test_paged_cache_sharded(roles, shape, names):
  page_size = 4
  q, k, v = make_problem(10, b=2, t=2, hq=8, hkv=2, s=32, dk=16)
  n_s = dict(zip(names, shape)).get(roles.get("seq_axis"), 1)
  table = paged_shards(k, n_s, page_size, seed=0)
  hkv, b, n = 2, 2, 32 // page_size
  to_pool = lambda x: x.reshape(b, hkv, n, page_size, 16).transpose(1, 0, 2, 3, 4).reshape(hkv, b * n, page_size, 16)
  inv = np.argsort(table.reshape(-1))
  kp, vp = to_pool(k)[:, inv], to_pool(v)[:, inv]  # page table[i, j] holds chunk (i, j)
  lengths = jnp.array([32, 13], jnp.int32)
  out = fdecode.sharded_flash_decode(q, kp, vp, lengths, mesh=_mesh(shape, names), impl="xla",
                                     block_tables=table, **roles)
  single = fdecode.flash_decode(q, k, v, lengths, impl="xla")
  assert_close(out, single, atol=3e-5, rtol=3e-5)


def test_paged_seq_axis_page_ownership_error():
  q, k, v = make_problem(11, b=2, t=None, hq=4, hkv=2, s=16, dk=16)
  kp = jnp.zeros((2, 8, 4, 16)); table = np.arange(8, dtype=np.int32).reshape(2, 4)  # row-major: wrong shards
  with pytest.raises(ValueError, match=r"block_tables\[0, 2\] = 2 must be a page of pool shard 1"):
    fdecode.sharded_flash_decode(q, kp, kp, jnp.array([16, 16]), mesh=_mesh((2,), ("s",)), seq_axis="s",
                                 block_tables=table)


def _token_major(x, paged):
  """A head-major cache-shaped array -> the token-major layout (kv_layout="NHD")."""
  return x.transpose(1, 2, 0, 3) if paged else x.swapaxes(1, 2)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("roles,shape,names", [
    (dict(batch_axis="b", head_axis="h", seq_axis="s"), (2, 2, 2), ("b", "h", "s")),
    (dict(head_axis="h"), (8,), ("h",)),  # kv heads replicated: each device slices its kv head
], ids=["b-h-s", "h8-replicated"])
def test_token_major_caches_split_on_the_same_logical_axes(paged, roles, shape, names):
  """kv_layout="NHD": the cache, its per-token int8 scales and the table split on kv heads,
  tokens / pages and sequences; the result is the head-major call's (within float32
  reordering: another program) and matches single-device flash_decode."""
  from fdecode.cache.quant import quantize
  page_size, b, hkv, s, d = 4, 2, 2, 32, 16
  q, k, v = make_problem(12, b=b, t=3, hq=8, hkv=hkv, s=s, dk=d)
  kq, ks = quantize(k, jnp.int8)
  lengths = jnp.array([32, 13], jnp.int32)
  v_contiguous = v
  mesh = _mesh(shape, names)
  kw = dict(mesh=mesh, impl="xla", return_lse=True, **roles)
  if paged:
    n_s = dict(zip(names, shape)).get(roles.get("seq_axis"), 1)
    table = paged_shards(k, n_s, page_size, seed=1)
    inv = np.argsort(table.reshape(-1))
    to_pool = lambda x: x.reshape(b, hkv, s // page_size, page_size, x.shape[-1]).transpose(
        1, 0, 2, 3, 4).reshape(hkv, -1, page_size, x.shape[-1])[:, inv]
    kq, ks, v = to_pool(kq), to_pool(ks), to_pool(v)
    kw["block_tables"] = table
  head_major = fdecode.sharded_flash_decode(q, kq, v, lengths, k_scale=ks, **kw)
  token_major = fdecode.sharded_flash_decode(
      q, _token_major(kq, paged), _token_major(v, paged), lengths, k_scale=_token_major(ks, paged),
      kv_layout="NHD", **kw)
  # Two layouts, two compiled programs: equal within float32 reordering.
  assert_attention_reordered(token_major, head_major, keys=s, dk=d, values=max_abs(v))
  k8, k8_scale = quantize(k, jnp.int8)
  single = fdecode.flash_decode(q, k8, v_contiguous, lengths, k_scale=k8_scale, impl="xla", return_lse=True)
  assert_close(token_major[0], single[0], atol=3e-5, rtol=3e-5)
  assert_close(token_major[1], single[1], atol=3e-5, rtol=3e-5)


def test_token_major_layout_errors():
  q, k, v = make_problem(13, b=2, t=None, hq=4, hkv=2, s=16, dk=16)
  mesh = _mesh((2,), ("h",))
  with pytest.raises(ValueError, match="kv_layout must be one of"):
    fdecode.sharded_flash_decode(q, k, v, jnp.array([16, 3]), mesh=mesh, head_axis="h", kv_layout="BSHD")
  q, k, v = make_problem(13, b=2, t=None, hq=2, hkv=2, s=16, dk=16)
  with pytest.raises(ValueError, match=r"head_axis of size 4 must divide Hkv=2"):  # Hkv from axis 2, not S
    fdecode.sharded_flash_decode(q, k.swapaxes(1, 2), v.swapaxes(1, 2), jnp.array([16, 3]),
                                 mesh=_mesh((4,), ("h",)), head_axis="h", kv_layout="NHD")
