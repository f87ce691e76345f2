"""The compile tier: every path fdecode ships, compiled by the real chip compilers with
no chip (libtpu for TPU v5e / v6e / v5p / v4, XLA:GPU + ptxas for H100 sm_90a and A100
sm_80), each case in a worker process (`fdecode.devtools.compile_check`).

Run by ``scripts/compile_tier`` (and so by ``scripts/test`` and CI) in ``.venv-chips``;
the CPU tier skips this folder. Asserts, per case and chip: it compiles; on GPU every
fdecode kernel has no register spills (``ptxas -v``) and fits the chip's shared memory;
the benchmark shapes give every SM two programs (from the compiled kernel's registers,
threads and shared memory); a decode launches at most two kernels on GPU; token-major
caches are read in place on GPU and TPU (no cache-sized transpose or copy); and on TPU the
compiled decode's ``cost_analysis()`` counts the KV bytes within 10%.
"""

import math

import pytest

from fdecode.kernels.common import chips
from fdecode.kernels.triton import merges_parts

from cases import BENCH, CASES, INVARIANT_BENCH, PLAIN_XLA, SM90_ONLY, TARGETS, TPU_XLA, names_for


@pytest.fixture(scope="session")
def reports(compiled):
  """target -> case -> report (tests/compile_tier/conftest.py)."""
  return compiled


# K and V bytes of cases (bf16): B * Hkv * S * (Dk + Dv) * 2.
CASE_KV_BYTES = {
    "bench-b8-s32k": 8 * 8 * 32768 * 256 * 2,
    "paged16-bf16-d128": 2 * 2 * 4096 * 256 * 2,
    "contiguous-bfloat16-d80": 2 * 2 * 4096 * 160 * 2,
    "mla-bf16-g16": 2 * 1 * 4096 * 576 * 2,   # one latent read serves K and V
}


def _params():
  return [pytest.param(t, n, id=f"{t}-{n}") for t in TARGETS for n in names_for(t)]


@pytest.mark.parametrize("target,name", _params())
def test_compiles(reports, target, name):
  report = reports[target][name]
  assert report["ok"], f"{name} on {target}: {report.get('error')}"
  kernels = report["kernels"]
  if name in PLAIN_XLA:  # test_gpu_xla_fuses_with_the_target_config
    return
  if name in SM90_ONLY:  # a Mosaic GPU custom call (test_mla_lowers_to_mosaic_gpu_on_sm90), no Triton split kernel
    assert report["mosaic_gpu_kernels"], f"{name} on {target}: {report}"
    assert all(k["name"].startswith("fdecode_combine_triton") for k in kernels), f"{name} on {target}: {kernels}"
  if target in chips.TPUS and name in TPU_XLA:  # the dispatch's documented XLA path
    assert not kernels, f"{name} on {target}: expected the XLA path, got {kernels}"
    return
  assert kernels or report.get("mosaic_gpu_kernels"), f"{name} on {target}: no fdecode kernel in the compiled program"
  if target in chips.GPUS:
    gpu = chips.GPUS[target]
    for k in kernels:
      assert "regs" in k, f"{name} on {target}: ptxas did not report {k['name']}"
      assert k["spill_stores"] == 0 and k["spill_loads"] == 0, (
          f"{name} on {target}: {k['name']} spills ({k['regs']} registers, "
          f"{k['spill_stores']} B stores / {k['spill_loads']} B loads)")
      assert k["smem"] <= gpu.smem_per_block, f"{name} on {target}: {k['smem']} B shared memory"


def waves(gpu, kernel):
  """Full waves a compiled kernel's grid fills on ``gpu``."""
  resident = gpu.resident_programs(threads=kernel["threads"], regs=kernel["regs"], smem=kernel["smem"])
  return math.prod(kernel["grid"]) / (gpu.sms * resident)


@pytest.mark.parametrize("target", [t for t in TARGETS if t in chips.GPUS])
@pytest.mark.parametrize("name", list(BENCH))
def test_benchmark_shapes_fill_every_sm(target, name, reports):
  """The split kernel gives every SM `fdecode.kernels.triton.PROGRAMS_PER_SM` programs (or all it
  may hold): two keep an SM's loads in flight (measured on H100 / H200; a full wave at the
  upper residency over-split B=1 S=32k). The combine kernel's few programs are not counted."""
  from fdecode.kernels.triton import PROGRAMS_PER_SM  # pylint: disable=g-import-not-at-top
  report = reports[target][name]
  assert report["ok"], report.get("error")
  gpu = chips.GPUS[target]
  for k in report["kernels"]:
    if "split_kv" not in k["name"]:
      continue
    resident = gpu.resident_programs(threads=k["threads"], regs=k["regs"], smem=k["smem"])
    assert math.prod(k["grid"]) >= gpu.sms * min(resident, PROGRAMS_PER_SM), (
        f"{name} on {target}: {k['grid']} ({resident} resident a SM)")


@pytest.mark.parametrize("target", [t for t in TARGETS if t in chips.GPUS])
def test_gpu_invariant_plans_do_not_depend_on_the_batch(target, reports):
  """The batch-invariant mode's compiled GPU program at B = 1 / 8 / 64 (S = 32k): the Triton
  split kernel and the combine, the split kernel's grid ``(B, Hkv * row blocks, S / split)``
  (the split size's count whatever B), its shared memory and threads the same at every B.
  (Registers may not be: on A100 ptxas gave B = 1 one more, 159 against 158, its
  sequence index folded to 0; the arithmetic is the same.)"""
  from fdecode.kernels.xla.invariant import SPLIT_SIZE  # pylint: disable=g-import-not-at-top
  split = {}
  for name, b in INVARIANT_BENCH.items():
    report = reports[target][name]
    assert report["ok"], f"{name} on {target}: {report.get('error')}"
    assert report["launches"] <= 2, f"{name} on {target}: {report['launches']} launches ({report['kernels']})"
    (k,) = [k for k in report["kernels"] if k["name"].startswith("fdecode_split_kv_triton")]
    assert k["grid"][0] == b and k["grid"][2] == 32768 // SPLIT_SIZE, f"{name} on {target}: {k['grid']}"
    split[b] = (tuple(k["grid"][1:]), k["smem"], k["threads"])
  assert len(set(split.values())) == 1, f"{target}: {split}"


def calibration_samples(target_name: str, reports: dict, names) -> list:
  """The launch model's samples of ``target_name``'s compiled cases ``names``
  (`fdecode.kernels.triton.CalibrationSample`): each case whose trace makes one compiled
  Triton plan and whose program has one split kernel, that kernel's shared memory and
  registers against the plan's estimate (`fdecode.kernels.triton.Launch`)."""
  import jax  # pylint: disable=g-import-not-at-top
  from fdecode.devtools.compile_check import Target  # pylint: disable=g-import-not-at-top
  from fdecode.dispatch import recording_plans  # pylint: disable=g-import-not-at-top
  from fdecode.kernels.triton import CalibrationSample, TritonPlan  # pylint: disable=g-import-not-at-top
  target, samples = Target(target_name).load(), []
  for name in names:
    report = reports[name]
    split = [k for k in report.get("kernels", ()) if k["name"].startswith("fdecode_split_kv_triton")]
    if not report["ok"] or len(split) != 1 or "regs" not in split[0]:
      continue
    fn, args, *_ = CASES[name](target)
    mesh = args[0].sharding.mesh if getattr(args[0], "sharding", None) is not None else target.mesh(1)
    with jax.set_mesh(mesh), recording_plans() as log:
      jax.jit(fn).trace(*args)
    plans = [p for _, p in log if isinstance(p, TritonPlan) and not p.interpret]
    if len(plans) == 1:
      launch = plans[0].launch
      samples.append(CalibrationSample(name, launch.smem, launch.regs, split[0]["smem"], split[0]["regs"]))
  return samples


@pytest.mark.parametrize("target", [t for t in TARGETS if t in chips.GPUS])
def test_launch_model_calibration(reports, target):
  """The launch model's residency fractions (`fdecode.kernels.triton.LAUNCH`'s
  ``smem_measured`` / ``regs_measured``) hold on the cases they are fitted on
  (`fdecode.kernels.triton.CALIBRATION_CASES`): each compiled split kernel takes at least
  those fractions of its plan's shared memory and register estimates, so the upper
  residency estimate the split rule judges by is one. On failure the message gives the
  fractions the reports support (`fdecode.kernels.triton.measure_calibration`)."""
  from fdecode.kernels.triton import (CALIBRATION_CASES, check_calibration,  # pylint: disable=g-import-not-at-top
                                      measure_calibration)
  samples = calibration_samples(target, reports[target], CALIBRATION_CASES)
  assert len(samples) == len(CALIBRATION_CASES), samples
  problems = check_calibration(samples)
  assert not problems, f"{target}: {problems}; the reports support {measure_calibration(samples)}"


# One K cache of the token-major cases (cases.py: B=2, Hkv=2, S=4096, D=128; pools hold
# B * S / page_size + 3 pages; ragged: 16 sequences).
TOKEN_MAJOR_K_BYTES = {
    "nhd-bf16-d128": 2 * 4096 * 2 * 128 * 2,
    "nhd-paged16-int8-token": (2 * 256 + 3) * 16 * 2 * 128 * 1,
    "nhd-paged1-f32-d128-t4": (2 * 4096 + 3) * 1 * 2 * 128 * 4,
    "ragged-nhd-paged16": (16 * 256 + 3) * 16 * 2 * 128 * 2,
    "flax-mha-attention-fn": 2 * 4096 * 8 * 128 * 2,  # Flax's own cache, 8 heads
    # One kv head: MQA (Gemma 3's shape), MLA latents (fp8 with bf16 RoPE columns).
    "nhd-mqa-bf16-d256": 2 * 4096 * 1 * 256 * 2,
    "nhd-mqa-int8-paged16": (2 * 256 + 3) * 16 * 1 * 128 * 1,
    "nhd-mla-bf16-g16": 2 * 4096 * 1 * 576 * 2,
    "nhd-mla-fp8-g16-paged16": (2 * 256 + 3) * 16 * 1 * 512 * 1,
    "nhd-hkv8-int8-token": 2 * 4096 * 8 * 128 * 1,
    "nhd-hkv8-e4m3-tiles-paged16": (2 * 256 + 3) * 16 * 8 * 128 * 1,
    "nhd-hkv3-bf16-paged16": (2 * 256 + 3) * 16 * 3 * 128 * 2,
    "nhd-hkv9-bf16-paged16": (2 * 256 + 3) * 16 * 9 * 128 * 2,
    # Sparse index lists (the Mosaic sparse kernel DMAs each listed token's heads).
    "nhd-sparse-shared": 2 * 4096 * 2 * 128 * 2,
    "nhd-sparse-per-head-paged16": (2 * 256 + 3) * 16 * 2 * 128 * 2,
    "nhd-sparse-int8-token": 2 * 4096 * 2 * 128 * 1,
    "nhd-sparse-mla-paged16": (2 * 256 + 3) * 16 * 1 * 576 * 2,
    "nhd-sparse-mla-fp8": 2 * 4096 * 1 * 512 * 1,
}


@pytest.mark.parametrize("target", [t for t in TARGETS if t in chips.GPUS])
@pytest.mark.parametrize("name", list(TOKEN_MAJOR_K_BYTES))
def test_gpu_reads_token_major_caches_in_place(reports, target, name):
  """The Triton kernel reads a token-major cache at its own strides: the compiled program
  transposes or copies nothing near a cache's size (only queries, scales, partial states;
  a head-major copy of the pool measured 33.6 MB in ragged-nhd-paged16 before)."""
  report = reports[target][name]
  assert report["ok"], report.get("error")
  assert report["largest_copy_bytes"] < TOKEN_MAJOR_K_BYTES[name] / 8, (
      f"{name} on {target}: a {report['largest_copy_bytes']} B copy next to a "
      f"{TOKEN_MAJOR_K_BYTES[name]} B cache")


# ... and on TPU, where the Mosaic kernel reads every one of them in place (float32 by
# head, bfloat16 / 8-bit as words of 2 / 4 heads, the rest by the whole head axis;
# sparse lists by each listed token's packed heads).
TPU_TOKEN_MAJOR_K_BYTES = dict(
    TOKEN_MAJOR_K_BYTES,
    **{"nhd-modifier-mask-paged16": (2 * 256 + 3) * 16 * 2 * 128 * 2,
       "nhd-modifier-alibi": 2 * 4096 * 2 * 128 * 2})


@pytest.mark.parametrize("target,name", [(t, n) for t in TARGETS if t in chips.TPUS for n in TPU_TOKEN_MAJOR_K_BYTES
                                         if n in names_for(t)])
def test_tpu_reads_token_major_caches_in_place(reports, target, name):
  """The Mosaic kernel reads a token-major cache in place (16- / 8-bit ones as words of
  2 / 4 heads or by the whole head axis): the compiled program runs the paged kernel, which reads token-major pages (a
  contiguous cache as a pool; before, the contiguous kernel on a head-major view), or
  the sparse kernel, which DMAs each listed token's heads (before, from a head-major copy), and
  copies nothing of a quarter of a cache (the largest left: the Flax step's 1024 x 1024
  bfloat16 projection weight, 1/8 of its cache; before, the other cases copied a whole
  cache)."""
  report = reports[target][name]
  assert report["ok"], report.get("error")
  names = {k["name"] for k in report["kernels"]}
  assert names == {"fdecode_sparse_mosaic" if "sparse" in name else "fdecode_split_kv_mosaic_paged"}, names
  assert report["largest_copy_bytes"] < TPU_TOKEN_MAJOR_K_BYTES[name] / 4, (
      f"{name} on {target}: a {report['largest_copy_bytes']} B copy next to a "
      f"{TPU_TOKEN_MAJOR_K_BYTES[name]} B cache")


@pytest.mark.parametrize("target", [t for t in TARGETS if t in chips.GPUS])
@pytest.mark.parametrize("name", ["ragged-paged16-write", "ragged-nhd-paged16", "ragged-contiguous-write",
                                  "ragged-nhd-contiguous"])
def test_gpu_ragged_step_split_launches(reports, target, name):
  """ragged_decode on a paged pool (or a contiguous cache, each sequence read in place
  through its cache row) with the Triton kernels: the decode part (16 sequences) and every
  prefill block (ceil(256 / 64) + 16 = 20), each part's work items on its own balanced
  schedule (its units plus a wave's worth of items). On H100 both parts run in *one*
  split launch, a one-axis grid of item x (kv head, row block) programs, none idle
  (`fdecode.kernels.triton.split_states_merged`); on A100, where ptxas spilled that
  merged kernel, in two (`fdecode.kernels.triton.plan.MERGE_PARTS_CAPABILITY`). Then one
  combine launch stores the packed rows (`fdecode.kernels.triton.step`)."""
  report = reports[target][name]
  assert report["ok"], report.get("error")
  gpu = chips.GPUS[target]
  split = [k for k in report["kernels"] if "split_kv" in k["name"]]
  if merges_parts(gpu):
    # Programs: the decode part's items (16 + extra) x Hkv 2, the prefill part's (20 + extra) x Hkv 2 x 2
    # row blocks of 128 (R = 64 * 4), each part's extra items a wave of its own programs.
    assert len(split) == 1 and split[0]["grid"][1:] == [1, 1], report["kernels"]
    assert split[0]["grid"][0] > 16 * 2 + 20 * 4 and waves(gpu, split[0]) >= 1, split
  else:
    decode, prefill = sorted(split, key=lambda k: k["grid"][1])
    assert decode["grid"][0] > 16 and prefill["grid"][0] > 20 and prefill["grid"][1:] == [4, 1], split
    assert waves(gpu, decode) >= 1 and waves(gpu, prefill) >= 1, split
  # The combine: 16 decode + 20 prefill + 16 padding programs (16 rows of G = 4 each) on
  # axis 0, the prefill part's kv head x tile of 4 query rows (of 64 * 4) x all 128 columns
  # on axis 1 (`segment_combine_tiling`).
  combine = [k for k in report["kernels"] if "combine" in k["name"]]
  assert len(combine) == 1 and combine[0]["grid"] == [16 + 20 + 256 // 16, 2 * (64 * 4 // 4), 1], report["kernels"]


# Launches of one ragged step (no conditional on GPU: both parts always run), on H100 /
# A100: the fused write (one Triton kernel for keys and values, `fdecode.ragged.write`),
# the split kernel of both parts (H100: one launch; A100: one a part) and one combine that
# stores the packed rows (`fdecode.kernels.triton.triton_step`). Nothing else: every program
# derives its unit's geometry (and the write kernel each row's position) from the step's
# own cu_q_lens, kv_lens and num_seqs (`fdecode.kernels.triton.geometry`), and reads its
# q rows, table rows and contiguous cache rows in place. ragged-chunk40-g4 does not
# donate: two copies of the caches before the write. ragged-mla-fp8-write: one latent
# cache; ragged-m256-write: 256 sequences, 2048 rows; ragged-g7-write: G = 7 (28 / 4 heads);
# ragged-mask-write / ragged-bias-heads: a per-row mask / per-row, per-head bias, read by
# the split kernel at each row's packed row (before: the two-part path, 13 launches with
# the write, the per-row arrays gathered per part).
# Before (same compiler, same target config): 34 / 30 / 29, where XLA merged the balanced
# items, scattered the rows into zeroed outputs and gathered q per item; then 25 / 20-21 /
# 19-20 with the schedule computed in XLA (6 fusions) and cu's running maximum a
# reduce-window (row positions 4 fusions, the output 2); then 18 / 14 / 17 with the
# schedule in the kernels (ragged-paged16-write not donated, 16 donated) and q and table
# rows gathered (3 fusions); then 13 / 11 / 14 with a conditional around the prefill call
# (its predicate and itself: 2, and a host wait, `test_gpu_ragged_step_has_no_host_wait`);
# then 12 / 10 / 12 with the write as XLA's scatter per cache and a fusion for the rows'
# slots (3 launches where the kernel is 1, as the thunk sequence shows); then 11 / 10 / 11
# with each part its own split and combine launch, 6 XLA fusions around them (offsets,
# rows' positions, block geometry, decode lengths, the output select gathering the rows
# from both parts' outputs); ragged-m256-write was 13.
RAGGED_LAUNCHES = {"h100": {"ragged-paged16-write": 3, "ragged-nhd-paged16": 2, "ragged-chunk40-g4": 5,
                            "ragged-contiguous-write": 3, "ragged-nhd-contiguous": 2, "ragged-mla-fp8-write": 3,
                            "ragged-m256-write": 3, "ragged-g7-write": 3, "ragged-mask-write": 3,
                            "ragged-bias-heads": 2, "ragged-mla-bf16-paged16": 2, "ragged-mla-bf16-contiguous-g8": 2}}
RAGGED_LAUNCHES["a100"] = {name: n + 1 for name, n in RAGGED_LAUNCHES["h100"].items()}  # two split launches
RAGGED_WRITES = {"ragged-paged16-write", "ragged-chunk40-g4", "ragged-contiguous-write", "ragged-mla-fp8-write",
                 "ragged-m256-write", "ragged-g7-write", "ragged-mask-write"}


@pytest.mark.parametrize("target", [t for t in TARGETS if t in chips.GPUS])
@pytest.mark.parametrize("name", list(RAGGED_LAUNCHES["h100"]) + ["balance-b37-paged16"])
def test_gpu_ragged_step_has_no_host_wait(reports, target, name):
  """No conditional or while loop in the compiled step: XLA:GPU evaluates each on the
  host (it copies the predicate from the GPU and waits for the stream), which would stall
  every layer's attention in a serving step. (Before: the prefill call sat in a
  `lax.cond`, one host wait per call.)"""
  report = reports[target][name]
  assert report["ok"], report.get("error")
  assert report["host_waits"] == 0, f"{name} on {target}: {report['host_waits']} conditionals / loops"


@pytest.mark.parametrize("target", [t for t in TARGETS if t in chips.GPUS])
@pytest.mark.parametrize("name", list(RAGGED_LAUNCHES["h100"]))
def test_gpu_ragged_step_launches(reports, target, name):
  """The step's fdecode kernels and nothing else: one split launch for the decode part and
  the prefill blocks (two on A100), one combine into the packed rows, and with the fused
  write its kernel (keys and values in one launch); the count pinned."""
  report = reports[target][name]
  assert report["ok"], report.get("error")
  names = sorted(k["name"].split("__")[0] for k in report["kernels"])
  writes = ["fdecode_write_triton"] if name in RAGGED_WRITES else []
  splits = ["fdecode_split_kv_triton"] * (1 if merges_parts(chips.GPUS[target]) else 2)
  assert names == ["fdecode_combine_triton"] + splits + writes, report["kernels"]
  assert report["launches"] == RAGGED_LAUNCHES[target][name], f"{name} on {target}: {report['launches']} launches"


@pytest.mark.parametrize("target", [t for t in TARGETS if t in chips.GPUS])
def test_ragged_contiguous_mla_keeps_the_hopper_decode(reports, target):
  """Contiguous bf16 MLA latents at G = 16: on sm_90 the step keeps the two-part path, its
  decode part on the Hopper MLA kernel (as `flash_decode` dispatches it: 2-8x the Triton
  kernel on an H200) beside the prefill blocks' Triton call; elsewhere (A100) the Triton
  step, launches as the other ragged cases'."""
  report = reports[target]["ragged-mla-bf16-contiguous-g16"]
  assert report["ok"], report.get("error")
  names = sorted(k["name"].split("__")[0] for k in report["kernels"])
  if chips.GPUS[target].capability == (9, 0):
    assert report["mosaic_gpu_kernels"] == ["fdecode_mla_mosaic_gpu"], report["mosaic_gpu_kernels"]
    assert names == ["fdecode_combine_triton"] * 2 + ["fdecode_split_kv_triton"], report["kernels"]
  else:
    assert not report["mosaic_gpu_kernels"], report["mosaic_gpu_kernels"]
    assert names == ["fdecode_combine_triton"] + ["fdecode_split_kv_triton"] * 2, report["kernels"]
    assert report["launches"] == 3, report["launches"]


@pytest.mark.parametrize("target", [t for t in TARGETS if t in chips.GPUS])
def test_gpu_xla_fuses_with_the_target_config(reports, target):
  """A select over a gather is one XLA fusion: the target config gives XLA's cost model
  the chip's clock (`fdecode.kernels.common.chips.gpu_target_config`), so the launch
  counts here are what the chip would run."""
  report = reports[target]["xla-gather-select"]
  assert report["ok"], report.get("error")
  assert report["launches"] == 1, report


@pytest.mark.parametrize("target", [t for t in TARGETS if t in chips.TPUS])
@pytest.mark.parametrize("name", list(CASE_KV_BYTES))
def test_tpu_cost_estimate_counts_the_kv_bytes(reports, target, name):
  """XLA's cost model of the compiled decode sees the cache it reads (Mosaic passes the
  kernel's `pl.CostEstimate` on; Triton's lowering in jax 0.10 drops it). The cases are
  ones where the cache dominates: queries, partial outputs and the merge add < 10%."""
  report = reports[target][name]
  assert report["ok"], report.get("error")
  kv = CASE_KV_BYTES[name]
  assert report["bytes_accessed"] is not None
  assert abs(report["bytes_accessed"] - kv) <= 0.1 * kv, f"{report['bytes_accessed']:.3e} vs {kv:.3e}"


# Issue 34: a decode call launches the split kernel and, with several splits, the combine
# kernel, and nothing else on GPU (no q pad, no merge fusions: 4-7 launches before). On TPU
# the merge of a single split is the kernel's own state; what remains around the Mosaic
# kernel is the query's padding to its sublane tile and the output's slice and cast.
# A mask per token and query head ([B, T, Hq, S]) is read in place by the Triton kernel
# (before: transposed into the canonical [B, Hkv, T, G, S] first, 3 launches).
GPU_TWO_LAUNCHES = list(BENCH) + [
    "contiguous-bfloat16-d128", "contiguous-float32-d128", "paged16-bf16-d128", "paged1-f32-d128",
    "nhd-bf16-d128", "int8-token-offsets", "float8_e4m3fn-token", "t8-bf16-d128-g8", "mla-bf16-g16",
    "mla-bf16-g128", "mla-fp8-g16-paged16", "rows-t5-g7-hkv2", "rows-t1-g48-hkv1", "balance-b37-paged16",
    *[f"modifier-{m}" for m in ("mask", "bias", "alibi", "window", "soft_cap", "sinks", "non_causal")],
    "modifier-mask-paged16", "nhd-modifier-mask-paged16", "modifier-mask-s100"]
# bf16 MLA at G >= 16 (T = 1, contiguous) runs on the Hopper kernel on sm_90 (dispatch).
HOPPER_MLA = {"mla-bf16-g16", "mla-bf16-g128"}
TPU_LAUNCHES = {n: 4 for n in list(BENCH) + ["paged16-bf16-d128", "nhd-bf16-d128", "int8-token-offsets",
                                             "mla-bf16-g128"]}


@pytest.mark.parametrize("target", [t for t in TARGETS if t in chips.GPUS])
@pytest.mark.parametrize("name", GPU_TWO_LAUNCHES)
def test_gpu_decode_is_at_most_two_launches(reports, target, name):
  """Two launches: the split kernel and the combine (on sm_90, bf16 MLA: the Hopper kernel
  and the combine; below 64 query heads its TMA copies the G rows into the first rows of
  wgmma's 64-row tile: before, q was first padded to 64 rows, a third launch)."""
  report = reports[target][name]
  assert report["ok"], report.get("error")
  assert report["launches"] <= 2, f"{name} on {target}: {report['launches']} launches ({report['kernels']})"


# Sparse index lists on GPU: the split kernel and the combine, after XLA's sort of the lists
# (a select of the dropped entries, then the sort: Pallas' Triton lowering has none). The
# kernel counts each list's live slots and selects a repeated position's later slots away
# itself (`kernel._index_bounds`, `kernel._firsts`). Per-token lists add their tokens' ends
# (5); per-head lists that and a copy before the sort (6); e4m3 tile scales theirs (6).
# Before: 9-11, with a second select and sort (the repeats dropped), a copy, and each list's
# bounds counted and stacked in XLA (`fdecode.kernels.common.sparse.canonicalize`, which
# the XLA and Mosaic paths still read). The same on H100 and A100.
SPARSE_LAUNCHES = {"sparse-shared1": 4, "sparse-shared": 4, "sparse-per_token": 5, "sparse-per_head": 6,
                   "sparse-shared-paged16": 4, "sparse-mla": 4, "sparse-f32": 4, "sparse-int8-token": 4,
                   "sparse-e4m3-tiles-paged16": 6}


@pytest.mark.parametrize("target", [t for t in TARGETS if t in chips.GPUS])
@pytest.mark.parametrize("name", list(SPARSE_LAUNCHES))
def test_gpu_sparse_launches(reports, target, name):
  report = reports[target][name]
  assert report["ok"], report.get("error")
  names = sorted(k["name"].split("__")[0] for k in report["kernels"])
  assert names == ["fdecode_combine_triton", "fdecode_split_kv_triton"], report["kernels"]
  assert report["launches"] == SPARSE_LAUNCHES[name], f"{name} on {target}: {report['launches']} launches"


@pytest.mark.parametrize("target", [t for t in TARGETS if t in chips.TPUS])
@pytest.mark.parametrize("name", list(TPU_LAUNCHES))
def test_tpu_decode_launches(reports, target, name):
  report = reports[target][name]
  assert report["ok"], report.get("error")
  assert report["launches"] <= TPU_LAUNCHES[name], f"{name} on {target}: {report['launches']} launches"


@pytest.mark.parametrize("target", [t for t in TARGETS if t in chips.GPUS and chips.GPUS[t].capability == (9, 0)])
@pytest.mark.parametrize("name", ["mla-bf16-g128-mosaic-gpu", "mla-int8-g128-mosaic-gpu", "mla-fp8-g128-mosaic-gpu",
                                  *sorted(HOPPER_MLA)])
def test_mla_lowers_to_mosaic_gpu_on_sm90(reports, target, name):
  """The MLA decode (`fdecode.kernels.mosaic_gpu.mla_decode`: bf16, and int8 / e4m3 latents
  with per-token scales; flash_decode's default dispatch for bf16 MLA at G >= 16) compiled
  for sm_90 holds the Hopper kernel as a Mosaic
  GPU custom call (TMA + wgmma; its PTX is assembled when the program loads on a GPU, so
  this proves the lowering); the only Triton kernel beside it is the split combine (one launch
  that merges the splits' partials), never the Triton split kernel: two launches
  (`mosaic_gpu.mla_run`, for the opt-in entry point as for the dispatch)."""
  report = reports[target][name]
  assert report["ok"], report.get("error")
  assert any(c.startswith("mosaic_gpu") for c in report["custom_calls"]), report["custom_calls"]
  assert report["mosaic_gpu_kernels"] == ["fdecode_mla_mosaic_gpu"], report["mosaic_gpu_kernels"]
  assert [k["name"] for k in report["kernels"]] == ["fdecode_combine_triton"], report["kernels"]
  assert report["launches"] <= 2, f"{name} on {target}: {report['launches']} launches"


@pytest.mark.parametrize("target", [t for t in TARGETS if t in chips.GPUS and chips.GPUS[t].capability == (9, 0)])
def test_8bit_mla_stays_on_triton_on_sm90(reports, target):
  """flash_decode's default dispatch does not route 8-bit MLA (int8 latents, one scale per
  token: a call `fdecode.kernels.mosaic_gpu.mla_decode` takes) to the Hopper kernel: its
  8-bit path is opt-in until a GPU measures it, so the Triton split kernel runs."""
  report = reports[target]["mla-int8-token-g128"]
  assert report["ok"], report.get("error")
  assert not report["mosaic_gpu_kernels"], report["mosaic_gpu_kernels"]
  assert "fdecode_split_kv_triton" in [k["name"] for k in report["kernels"]], report["kernels"]


ROWS_MOSAIC_GPU = ["rows-bf16-t4-g16-mosaic-gpu", "rows-int8-t4-g16-mosaic-gpu", "rows-fp8-t4-g16-d256-mosaic-gpu",
                   "rows-bf16-t4-g16-paged16-mosaic-gpu", "rows-int8-t4-g16-paged32-mosaic-gpu"]


@pytest.mark.parametrize("target", [t for t in TARGETS if t in chips.GPUS and chips.GPUS[t].capability == (9, 0)])
@pytest.mark.parametrize("name", ROWS_MOSAIC_GPU)
def test_rows_lower_to_mosaic_gpu_on_sm90(reports, target, name):
  """The GQA rows decode (`fdecode.kernels.mosaic_gpu.rows_decode`: bf16, int8 and e4m3
  per-token caches, D = 128 and 256, 4 causal tokens x 16 heads; contiguous, and paged
  pools read in place, a page per TMA copy, at page sizes 16 and 32) lowers for sm_90 to the
  Hopper kernel as a Mosaic GPU custom call (register layouts, wgmma operand and dtype
  conversions are checked by the lowering; ptxas runs when the program loads on a GPU),
  its splits merged by the Triton combine kernel: three launches in all, q's rows laid out
  and padded, the rows kernel and the combine (before: 12, an XLA merge and transposes)."""
  report = reports[target][name]
  assert report["ok"], report.get("error")
  assert "mosaic_gpu_v2" in report["custom_calls"], report["custom_calls"]
  assert report["mosaic_gpu_kernels"] == ["fdecode_rows_mosaic_gpu"], report["mosaic_gpu_kernels"]
  assert [k["name"].split("__")[0] for k in report["kernels"]] == ["fdecode_combine_triton"], report["kernels"]
  assert report["launches"] <= 3, f"{name} on {target}: {report['launches']} launches"


@pytest.mark.parametrize("target", [t for t in TARGETS if t in chips.GPUS and chips.GPUS[t].capability == (9, 0)])
def test_ragged_opt_in_runs_the_rows_kernel_on_sm90(reports, target):
  """``ragged_decode(impl="mosaic_gpu")`` over a paged pool: the decode part and the one
  batched prefill call both run the Hopper rows kernel (a Mosaic GPU custom call), each
  followed by its Triton combine; no Triton split kernel anywhere."""
  report = reports[target]["ragged-paged16-mosaic-gpu"]
  assert report["ok"], report.get("error")
  assert report["mosaic_gpu_kernels"] == ["fdecode_rows_mosaic_gpu"], report["mosaic_gpu_kernels"]
  names = sorted(k["name"].split("__")[0] for k in report["kernels"])
  assert "fdecode_split_kv_triton" not in names, report["kernels"]
  assert names == ["fdecode_combine_triton"] * 2, report["kernels"]
