#!/usr/bin/env python3
"""Prints the results tables of one scripts/run_benchmarks.sh run as markdown (docs/benchmarks.md's
tables are these, pasted after a full run).

Reads the OUTDIR the script writes:
  commit.txt      the commit the suites were built from
  load.txt        per suite: "<suite> waited <s> s for the load to fall" (or "<suite> gave up waiting
                  after <s> s at load <l>"), "<suite> before: <1m> <5m> <15m>", "<suite> after: ..."
  <suite>.txt     console output, first line "== <suite>: <command>"; what the benches print for
                  scripts to read:
                    RATIO <name> median=<m> min=<a> max=<b> n=<n> goal>=<g> met|NOT-met
                    RATIO <name> median=<m> min=<a> max=<b> n=<n> no-goal          (bench_reduce)
                      (goal>=0.00: a ratio reported without a goal, as bench_collate prints it)
                    OPS <case> plain=<p> loom=<l> extra=<e> ... goal<=<g> met|NOT-met  (bench_ops)
                    bench_comm's table after "ratio of time per all-reduce to the raw c10d baseline"
  <suite>.json    Google Benchmark JSON: per benchmark the median of its repetitions' real time
                  (iteration runs; the "median" aggregate when only aggregates were written, as
                  bench_comm does by default), or the single run's, with its counters likewise
  *.png           the figures (scripts/plot_benchmarks.sh, plot_time_to_accuracy.sh), linked

Counters with a goal that the bench states in its file comment but prints nowhere (bench_schedule's
vs_ideal and vs_sequential, bench_plan's max_over_mean) are checked against COUNTER_GOALS below.

Usage: scripts/bench_tables.py OUTDIR > OUTDIR/results.md      (Python 3, standard library only)
"""
import json
import math
import os
import re
import statistics
import sys

# The order run_benchmarks.sh runs them in; a suite found only in OUTDIR comes after, by name.
SUITES = ["reduce", "collate", "schedule", "generators", "comm", "ops", "plan", "loader", "finetune"]

# (suite, benchmark name prefix, counter, ">=" or "<=", goal): from the benches' file comments.
COUNTER_GOALS = [
    ("schedule", "schedule_io/loom", "vs_ideal", ">=", 0.9),
    ("schedule", "schedule_io/loom", "vs_sequential", ">=", 5.0),
    ("plan", "deal/balanced", "max_over_mean", "<=", 1.05),
]

FIGURES = {"reduce": ["reduce_sweep.png"], "collate": ["collate_sweep.png"], "finetune": ["time_to_accuracy.png"]}

RATIO_RE = re.compile(
    r"^RATIO\s+(?P<name>\S+)\s+median=(?P<median>\S+)\s+min=(?P<min>\S+)\s+max=(?P<max>\S+)\s+n=(?P<n>\d+)\s+"
    r"(?:goal(?P<op>>=|<=)(?P<goal>\S+)\s+(?P<met>met|NOT-met)|(?P<nogoal>no-goal))\s*$")
OPS_RE = re.compile(r"^OPS\s+(?P<case>\S+)\s+(?P<values>(?:\S+=\S+\s+)*)goal(?P<op><=|>=)(?P<goal>\S+)\s+"
                    r"(?P<met>met|NOT-met)\s*$")
COMM_HEADER = "ratio of time per all-reduce to the raw c10d baseline"
# Parts of a Google Benchmark run name that say how it ran, not what: left out of the tables.
RUN_NAME_NOISE = re.compile(r"^(min_time|min_warmup_time|iterations|repeats|threads):|^(real_time|manual_time)$")
STANDARD_KEYS = {"name", "family_index", "per_family_instance_index", "run_name", "run_type", "repetitions",
                 "repetition_index", "threads", "iterations", "real_time", "cpu_time", "time_unit", "aggregate_name",
                 "aggregate_unit", "error_occurred", "error_message", "label"}


def num(text):
    """A number as the benches print it ("nan", "-nan" and "inf" included)."""
    return float(text)


def fmt(x, digits=3):
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return str(x)
    return f"{x:.{digits}f}"


def fmt_g(x):
    """A timing or counter: four significant digits, no exponent below 10^7."""
    if math.isnan(x) or math.isinf(x):
        return str(x)
    if x != 0 and (abs(x) >= 1e7 or abs(x) < 1e-3):
        return f"{x:.3e}"
    s = f"{x:.4g}"
    return f"{x:,.0f}" if "e" not in s and abs(x) >= 1e4 else s


def read(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def read_load(outdir):
    """suite -> {"before": "a b c", "after": "a b c", "waited": "N s" or "gave up after N s at load L"}."""
    load = {}
    path = os.path.join(outdir, "load.txt")
    if not os.path.exists(path):
        return load, []
    order = []
    for line in read(path).splitlines():
        m = re.match(r"^(\S+) (before|after): (.*)$", line)
        w = re.match(r"^(\S+) waited (\d+) s for the load to fall$", line)
        g = re.match(r"^(\S+) gave up waiting after (\d+) s at load (\S+)$", line)
        if m:
            suite, key, value = m.group(1), m.group(2), m.group(3).strip()
        elif w:
            suite, key, value = w.group(1), "waited", f"{w.group(2)} s"
        elif g:
            suite, key, value = g.group(1), "waited", f"gave up after {g.group(2)} s at load {g.group(3)}"
        else:
            continue
        if suite not in load:
            order.append(suite)
        load.setdefault(suite, {})[key] = value
    return load, order


def parse_text(text):
    """(command, RATIO rows, OPS rows, comm ratio rows) of one suite's console output."""
    command, ratios, ops, comm = None, [], [], []
    lines = text.splitlines()
    in_comm = False
    for line in lines:
        if command is None and line.startswith("== "):
            command = line.split(": ", 1)[1] if ": " in line else ""
            continue
        m = RATIO_RE.match(line.strip())
        if m:
            ratios.append(m.groupdict())
            continue
        m = OPS_RE.match(line.strip())
        if m:
            row = m.groupdict()
            row["values"] = [kv.split("=", 1) for kv in row["values"].split()]
            ops.append(row)
            continue
        if line.strip().startswith(COMM_HEADER):
            in_comm = True
            comm = [{"header": line.strip()}]
            continue
        if in_comm:
            cells = line.split()
            if len(cells) == 3 and cells[0].isdigit():
                comm.append({"bytes": int(cells[0]), "loom": cells[1], "loom_checked": cells[2]})
            elif cells and cells[0] != "bytes":
                in_comm = False
    return command, ratios, ops, comm


def display_name(run_name):
    parts = [p for p in run_name.split("/") if not RUN_NAME_NOISE.match(p)]
    return "/".join(parts)


def parse_json(path):
    """(context, rows): rows of (name, value, unit, how, counters) in the file's order."""
    data = json.loads(read(path))
    context = data.get("context", {})
    runs, aggregates, order = {}, {}, []
    for bm in data.get("benchmarks", []):
        if bm.get("error_occurred"):
            continue
        name = bm.get("run_name") or bm.get("name", "")
        if name not in order:
            order.append(name)
        if bm.get("run_type", "iteration") == "iteration":
            runs.setdefault(name, []).append(bm)
        elif bm.get("aggregate_name") == "median":
            aggregates[name] = bm
    rows = []
    for name in order:
        reps = runs.get(name, [])
        if reps:
            sample = reps
            how = f"median of {len(reps)}" if len(reps) > 1 else "single run"
            pick = statistics.median
        elif name in aggregates:
            sample = [aggregates[name]]
            how = f"median of {aggregates[name].get('repetitions', '?')} (aggregate)"
            pick = statistics.median
        else:
            continue
        value = pick([float(b["real_time"]) for b in sample])
        keys = []
        for b in sample:
            for k, v in b.items():
                if k not in STANDARD_KEYS and isinstance(v, (int, float)) and not isinstance(v, bool) and k not in keys:
                    keys.append(k)
        counters = [(k, pick([float(b[k]) for b in sample if k in b])) for k in keys]
        rows.append((display_name(name), value, sample[0].get("time_unit", "ns"), how, counters))
    return context, rows


def met(value, op, goal):
    return value >= goal if op == ">=" else value <= goal


def ratio_table(ratios):
    out = ["| ratio | median | min | max | n | goal | met? |", "|---|---:|---:|---:|---:|---|---|"]
    for r in ratios:
        if r["nogoal"]:
            goal, verdict = "none (reported)", ""
        elif num(r["goal"]) == 0 and r["op"] == ">=":
            goal, verdict = ">= 0 (reported)", ""
        else:
            goal, verdict = f"{r['op']} {r['goal']}", "yes" if r["met"] == "met" else "**no**"
        out.append(f"| `{r['name']}` | {r['median']} | {r['min']} | {r['max']} | {r['n']} | {goal} | {verdict} |")
    return out


def ops_table(ops):
    keys = [k for k, _ in ops[0]["values"]]
    out = ["| case | " + " | ".join(keys) + " | goal (extra) | met? |", "|---|" + "---:|" * len(keys) + "---|---|"]
    for r in ops:
        values = dict(r["values"])
        cells = " | ".join(values.get(k, "") for k in keys)
        out.append(f"| `{r['case']}` | {cells} | {r['op']} {r['goal']} | {'yes' if r['met'] == 'met' else '**no**'} |")
    return out


def comm_table(comm):
    out = [f"{comm[0]['header']}:", "", "| bytes | loom | loom_checked |", "|---:|---:|---:|"]
    for r in comm[1:]:
        out.append(f"| {r['bytes']:,} | {r['loom']} | {r['loom_checked']} |")
    return out


def counter_goals(suite, rows):
    """(benchmark, counter, value, how, op, goal, met) of each counter COUNTER_GOALS names."""
    found = []
    for goal_suite, prefix, counter, op, goal in COUNTER_GOALS:
        if goal_suite != suite:
            continue
        for name, _, _, how, counters in rows:
            if name == prefix or name.startswith(prefix + "/"):
                found += [(name, k, v, how, op, goal, met(v, op, goal)) for k, v in counters if k == counter]
    return found


def counter_goal_table(goals):
    out = ["| benchmark | counter | value | goal | met? |", "|---|---|---|---|---|"]
    for name, counter, value, how, op, goal, ok in goals:
        out.append(f"| `{name}` | {counter} | {fmt(value)} ({how}) | {op} {fmt_g(goal)} | {'yes' if ok else '**no**'} |")
    return out


def timing_table(rows):
    out = ["| benchmark | real time | of | counters |", "|---|---:|---|---|"]
    for name, value, unit, how, counters in rows:
        cs = ", ".join(f"{k} {fmt_g(v)}" for k, v in counters)
        out.append(f"| `{name}` | {fmt_g(value)} {unit} | {how} | {cs} |")
    return out


def main(argv):
    if len(argv) != 2 or not os.path.isdir(argv[1]):
        print("usage: bench_tables.py OUTDIR   (the folder scripts/run_benchmarks.sh wrote)", file=sys.stderr)
        return 2
    outdir = argv[1]
    load, load_order = read_load(outdir)
    present = {f[:-4] for f in os.listdir(outdir) if f.endswith(".txt") and f not in ("load.txt", "commit.txt")}
    suites = [s for s in SUITES if s in present]
    suites += [s for s in load_order if s in present and s not in suites]
    suites += sorted(present - set(suites))
    commit_path = os.path.join(outdir, "commit.txt")
    commit = read(commit_path).strip() if os.path.exists(commit_path) else "unknown"

    parsed, contexts = {}, []
    for s in suites:
        json_path = os.path.join(outdir, s + ".json")
        context, rows = {}, []
        if os.path.exists(json_path):
            try:
                context, rows = parse_json(json_path)
            except (ValueError, KeyError) as e:  # a suite that stopped half-way leaves a cut-off file
                print(f"bench_tables: {json_path}: {e}; its timings left out", file=sys.stderr)
        if context:
            contexts.append(context)
        parsed[s] = (parse_text(read(os.path.join(outdir, s + ".txt"))), rows)

    ctx = contexts[0] if contexts else {}
    date = ctx.get("date", "date unknown")
    libtorch = next((c["libtorch"] for c in contexts if "libtorch" in c), None)
    machine = ", ".join(x for x in [
        f"{ctx['num_cpus']} CPUs" if "num_cpus" in ctx else "",
        f"{ctx['mhz_per_cpu']} MHz" if "mhz_per_cpu" in ctx else "",
        f"LibTorch {libtorch}" if libtorch else "",
        f"host {ctx['host_name']}" if "host_name" in ctx else ""] if x)

    out = ["# Benchmark results", "",
           f"Commit {commit}, run of {date}" + (f" ({machine})" if machine else "") + ". Generated by "
           "scripts/bench_tables.py from scripts/run_benchmarks.sh's output; load averages are 1, 5 and 15 "
           "minutes."]
    n_goals = n_met = 0
    for s in suites:
        (_, ratios, ops, _), rows = parsed[s]
        for r in ratios:
            if r["goal"] is not None and not (num(r["goal"]) == 0 and r["op"] == ">="):
                n_goals += 1
                n_met += r["met"] == "met"
        for r in ops:
            n_goals += 1
            n_met += r["met"] == "met"
        for goal in counter_goals(s, rows):
            n_goals += 1
            n_met += goal[-1]
    out += ["", f"Goals met: {n_met} of {n_goals}."]

    for s in suites:
        (command, ratios, ops, comm), rows = parsed[s]
        out += ["", f"## {s}", ""]
        if command:
            out += [f"`{command}`", ""]
        l = load.get(s)
        if l:
            waited = l.get("waited", "")
            if waited and not waited.startswith("gave up"):
                waited = f"waited {waited} for the load to fall"
            out.append(f"Load before: {l.get('before', '?')}; after: {l.get('after', '?')}"
                       + (f"; {waited}" if waited else "") + ".")
        else:
            out.append("Load: not in load.txt.")
        if ratios:
            out += ["", "RATIO lines (median, min and max of the per-repetition ratios, higher is better for loom; "
                    "the bench's file comment says what each compares):", ""]
            out += ratio_table(ratios)
        if ops:
            out += ["", "OPS lines (operators per optimizer step, loom's beyond the plain loop's):", ""]
            out += ops_table(ops)
        if len(comm) > 1:
            out += [""] + comm_table(comm)
        goals = counter_goals(s, rows)
        if goals:
            out += ["", "Counters with a goal (the bench's file comment):", ""] + counter_goal_table(goals)
        if rows:
            out += ["", "Timings (real time; medians over repetitions where there are repetitions):", ""]
            out += timing_table(rows)
        for fig in FIGURES.get(s, []):
            if os.path.exists(os.path.join(outdir, fig)):
                out += ["", f"![{fig[:-4].replace('_', ' ')}]({fig})"]
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
