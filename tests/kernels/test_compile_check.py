"""`fdecode.devtools.compile_check`'s launch count, on a thunk sequence as XLA:GPU dumps it
(runs on the CPU tier: no compiler needed)."""

from fdecode.devtools.compile_check import gpu_host_waits, thunk_launches

# A ragged step's shape (H100, trimmed): 3 kernels, a conditional whose branches launch 3
# and 1, then one more kernel.
SEQUENCE = """\
001: kCustomKernel [source        | next=002 (1)] loop_reduce_window_fusion grid: [1, 1, 1] threads: [32, 1, 1]
002: kCopy         [source        | next=003 (1)] kCopy
003: kCustomKernel [prev=002 (1)  | next=035 (1)] fdecode_split_kv_triton grid: [16, 2, 12] threads: [128, 1, 1]
035: kConditional  [prev=003 (1)  | next=036 (1)]
  false_branch:
    015: kCustomKernel [source       | next=016 (1)] loop_subtract_fusion grid: [1, 1, 1] threads: [20, 1, 1]
    016: kCustomKernel [prev=015 (1) | next=017 (1)] fdecode_split_kv_triton__1 grid: [119, 4, 1] threads: [256, 1, 1]
    017: kCopy         [prev=016 (1) | sink        ] kCopy
  true_branch:
    034: kCopy [source | sink] kCopy

036: kCustomKernel [prev=035 (1)  | sink        ] loop_select_fusion grid: [2048, 1, 1] threads: [128, 1, 1]
"""


def test_a_conditional_counts_its_longest_branch():
  assert thunk_launches(SEQUENCE.splitlines()) == 3 + 1 + 3 + 1


def test_nested_conditionals_and_while_loops():
  lines = ["001: kWhile [source | sink]",
           "  condition:",
           "    002: kCustomKernel [source | sink] loop_compare_fusion",
           "  body:",
           "    003: kConditional [source | sink]",
           "      branch_0:",
           "        004: kCustomKernel [source | sink] a",
           "        005: kCustomKernel [source | sink] b",
           "      branch_1:",
           "        006: kCopy [source | sink] kCopy",
           "002: kCustomKernel [source | sink] after"]
  # the while, its condition (1) and body (the conditional, its longest branch: 2), then one more
  assert thunk_launches(lines) == 1 + 1 + (1 + 2) + 1


def test_host_waits_count_conditionals_and_loops(tmp_path):
  """Each conditional or while loop, nested ones included, is a host wait; kernels and
  copies are not."""
  (tmp_path / "module_0001.thunk_sequence.txt").write_text(SEQUENCE)
  assert gpu_host_waits(str(tmp_path)) == 1
  (tmp_path / "module_0002.thunk_sequence.txt").write_text(
      "001: kWhile [source | sink]\n  body:\n    003: kConditional [source | sink]\n"
      "002: kCustomKernel [source | sink] after\n")
  assert gpu_host_waits(str(tmp_path)) == 1 + 2



def test_every_case_gets_a_report_when_workers_die(tmp_path):
  """`run_targets`' lanes: a worker that dies fails the case it was handed, with its exit
  status and stderr, and a new worker takes the next case (here every worker dies: the
  cases file does not load). Both lanes end."""
  from fdecode.devtools.compile_check import run_targets
  bad = tmp_path / "cases.py"
  bad.write_text("raise RuntimeError('no cases here')\n")
  out = run_targets(str(bad), {"h100": ["a", "b", "c"], "v5e": ["d"]}, timeout=120)
  assert {t: sorted(r) for t, r in out.items()} == {"h100": ["a", "b", "c"], "v5e": ["d"]}
  for t, reports in out.items():
    for name, r in reports.items():
      assert not r["ok"] and f"compile worker died (exit 1) compiling {name}" in r["error"], r
      assert "no cases here" in r["error"], r
