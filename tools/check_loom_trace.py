"""Runs loom-trace on tools/testdata (records written by hand: three ranks, rank 2 skips bucket 0 at
step 1) and checks its exit status and verdict; then on a folder with two jobs' records (it reads the
newest job's and names the record it skipped); then its answer to a folder without records.

Usage: check_loom_trace.py LOOM_TRACE TESTDATA_FOLDER
"""
import subprocess
import sys
import tempfile


def main():
    program, data = sys.argv[1], sys.argv[2]
    run = subprocess.run([program, data + "/skipped_bucket", "--last", "3"], capture_output=True, text=True)
    out = run.stdout
    problems = []
    if run.returncode != 1:
        problems.append(f"exit status {run.returncode} (expected 1: a divergence); stderr: {run.stderr}")
    for part in [
        "rank 2 of 3 on node2:1002",
        "verdict: first divergence at collective #4: rank 2 issued all_reduce #4 (reducer bucket 1, step 1",
        "while ranks 0, 1 issued all_reduce #4 (reducer bucket 0, step 1, Float x 100)",
    ]:
        if part not in out:
            problems.append(f"missing from the output: {part!r}")
    if out.count("\n  ") < 9:  # 3 ranks x (reason line + 3 entries)
        problems.append("expected 3 entries per rank")
    # A folder that also holds an earlier job's record (rank 2 of a 3-rank job that skipped a bucket):
    # the newest job alone is read, and the skipped record is named.
    run = subprocess.run([program, data + "/two_jobs"], capture_output=True, text=True)
    if run.returncode != 0:
        problems.append(f"two_jobs: exit status {run.returncode} (expected 0: job bb alone has no divergence)")
    for part in [
        "job 00000000000000bb: 2 records",
        "skipped 1 record of 1 other job: job 00000000000000aa (rank 2)",
        "verdict: no divergence in the records",
    ]:
        if part not in run.stdout:
            problems.append(f"two_jobs: missing from the output: {part!r}\n{run.stdout}")
    run = subprocess.run([program, data + "/two_jobs", "--job", "00000000000000aa"], capture_output=True, text=True)
    if "job 00000000000000aa: 1 record" not in run.stdout or "rank 2 of 3 on node2:1002" not in run.stdout:
        problems.append(f"two_jobs --job 00000000000000aa: {run.stdout!r} {run.stderr!r}")
    with tempfile.TemporaryDirectory() as empty:
        run = subprocess.run([program, empty], capture_output=True, text=True)
        if run.returncode != 2 or "no loom-trace-rank" not in run.stderr:
            problems.append(f"an empty folder: exit {run.returncode}, stderr {run.stderr!r}")
    run = subprocess.run([program, data + "/no-such-folder"], capture_output=True, text=True)
    if run.returncode != 2 or "cannot read the folder" not in run.stderr:
        problems.append(f"a missing folder: exit {run.returncode}, stderr {run.stderr!r}")
    if problems:
        print(out)
        for p in problems:
            print("FAIL:", p)
        return 1
    print(out)
    print("ok: loom-trace prints the timeline and the verdict")
    return 0


if __name__ == "__main__":
    sys.exit(main())
