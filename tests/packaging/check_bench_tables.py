#!/usr/bin/env python3
"""Checks scripts/bench_tables.py on a hand-written run folder (tests/packaging/bench_results/): one
file of each kind scripts/run_benchmarks.sh writes, with the line formats the benches print (RATIO
lines padded as bench_reduce, bench_collate, bench_generators and bench_loader pad them, bench_reduce's
no-goal line, bench_collate's goal>=0.00, bench_finetune's inf, bench_ops's OPS lines, bench_comm's
ratio table), Google Benchmark JSON with repetitions, a single run and only aggregates (bench_comm's
default), and a load.txt with a suite that gave up waiting and a suite missing. The markdown it prints
must carry the values written in those files.

Usage: check_bench_tables.py SOURCE_ROOT
"""
import os
import shutil
import subprocess
import sys
import tempfile

EXPECTED = [
    # header: commit.txt, the first JSON's context
    "Commit abc1234, run of 2026-12-06T21:14:03+00:00 (2 CPUs, 2994 MHz, LibTorch 2.13.0, host benchhost)",
    # every goal: reduce 1/2, collate 1/2 (goal>=0.00 is not one), generators 1/2, ops 1/2, schedule 2/2,
    # plan 1/2, loader 1/2, finetune 1/2
    "Goals met: 9 of 16.",
    # RATIO lines: goal met, not met, no goal, goal 0 (reported), padding of every width, inf
    "| `loom_vs_flat` | 0.898 | 0.569 | 1.195 | 11 | >= 0.95 | **no** |",
    "| `loom_vs_per_tensor` | 3.137 | 2.308 | 4.037 | 11 | >= 2.50 | yes |",
    "| `sweep_deterministic_wire` | 1.234 | 1.100 | 1.300 | 11 | none (reported) |  |",
    "| `collate_padded_loom_vs_memcpy` | 0.373 | 0.211 | 0.653 | 10 | >= 0 (reported) |  |",
    "| `sweep_loom_vs_memcpy/batch:8` | 0.821 | 0.687 | 1.085 | 10 | >= 0.90 | **no** |",
    "| `generator_loader/MiB:16/devices:8/workers:2_vs_memcpy` | 1.040 | 0.870 | 1.310 | 5 | >= 0.80 | yes |",
    "| `loader_workers:0_vs_in_memory` | 0.411 | 0.335 | 0.500 | 5 | >= 0.91 | **no** |",
    "| `time_to_accuracy_loom_vs_best/ranks:1` | 1.073 | 0.905 | inf | 3 | >= 1.2 | **no** |",
    # OPS lines
    "| `deterministic/device_path/ws:1/params:160` | 900.0 | 946.6 | 46.6 | 205.2 | 45.2 | 0.00 | 2.00 | <= 40 | **no** |",
    # bench_comm's table
    "| 67,108,864 | 0.96 | 0.95 |",
    # load.txt: waited, gave up, missing
    "Load before: 0.96 0.80 0.70; after: 3.51 2.10 1.20; waited 20 s for the load to fall.",
    "Load before: 1.62 1.40 1.10; after: 1.00 1.20 1.05; gave up after 300 s at load 1.62.",
    "Load: not in load.txt.",
    # the command from the first line of the suite's output
    "`build-torch2/bench/bench_ops`",
    # timings: the median of the iteration runs (55 of 50, 60, 55; not the aggregate's 999), a single
    # run, only a median aggregate; counters as medians
    "| `reduce_resnet50/flat` | 55 ms | median of 3 | busbw_GBps 1.8 |",
    "| `reduce_resnet50/loom` | 62 ms | median of 3 | wire_bytes 1.022e+08 |",
    "| `collate_padding/auto_boundaries` | 12.5 us | single run | padding_fraction 0.0625, buckets 8 |",
    "| `allreduce/loom/4096` | 105.5 us | median of 5 (aggregate) | algbw_GBps 0.0388 |",
    # counters with a goal in the bench's comment
    "| `schedule_io/loom/depth:2` | vs_ideal | 0.920 (median of 2) | >= 0.9 | yes |",
    "| `deal/balanced/ranks:4/batches_per_rank:4` | max_over_mean | 1.052 (single run) | <= 1.05 | **no** |",
    # a figure that is there is linked; one that is not is not
    "![reduce sweep](reduce_sweep.png)",
]
UNEXPECTED = ["999", "collate_sweep.png", "deal/round_robin/ranks:2/batches_per_rank:4` | max_over_mean"]
# Suites in run_benchmarks.sh's order.
ORDER = ["## reduce", "## collate", "## schedule", "## generators", "## comm", "## ops", "## plan", "## loader",
         "## finetune"]


def main():
    root = sys.argv[1]
    script = os.path.join(root, "scripts", "bench_tables.py")
    with tempfile.TemporaryDirectory() as tmp:
        outdir = os.path.join(tmp, "bench-results")
        shutil.copytree(os.path.join(root, "tests", "packaging", "bench_results"), outdir)
        open(os.path.join(outdir, "reduce_sweep.png"), "wb").close()
        run = subprocess.run([sys.executable, script, outdir], capture_output=True, text=True)
        usage = subprocess.run([sys.executable, script], capture_output=True, text=True)
    problems = []
    if run.returncode != 0:
        problems.append(f"exit status {run.returncode}: {run.stderr}")
    text = run.stdout
    problems += [f"missing: {line}" for line in EXPECTED if line not in text]
    problems += [f"should not be there: {s}" for s in UNEXPECTED if s in text]
    positions = [text.find(h + "\n") for h in ORDER]
    if -1 in positions or positions != sorted(positions):
        problems.append(f"suites not in run_benchmarks.sh's order: {positions}")
    if usage.returncode != 2 or "usage" not in usage.stderr:
        problems.append(f"no usage message without an argument (exit status {usage.returncode})")
    if problems:
        print(text)
        for p in problems:
            print("FAIL:", p)
        return 1
    print(f"ok: bench_tables.py printed the {len(EXPECTED)} expected lines of the fixture run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
