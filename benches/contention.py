#!/usr/bin/env python3
"""The CPU engine beside a competing busy process.

Runs the default preset (`baseline`, --steps 200) and `accumulate-to-fit` (its 150 steps)
headless, idle and beside one busy process at nice 0 and at nice 10, with:
  1 thread          RAYON_NUM_THREADS=1
  2 threads, pool   RAYON_NUM_THREADS=2 GACCWB_CPU_POOL=pool  (every window on the pool)
  2 threads, auto   RAYON_NUM_THREADS=2 (the default: the pool governor chooses)
and prints each run's wall time and ms per optimizer step over its last 10 steps, then the
ratios against 1 thread under the same load (below 1: faster than one thread).

For the 2-thread runs it also reads each step's `cpu_threads` from the run's recording: how
many windows ran on the pool, and what they cost beyond the median window on the trainer's
thread alone in the same run, as a share of the run's step time. Beside a busy process that
share is what the governor's choice costs against one thread, without the minute-to-minute
drift of a shared machine that separate runs carry.

  cargo build --release && python3 benches/contention.py [--rounds 2] [--binary PATH]

The machine is shared: read ratios from one invocation, and expect a few % of noise.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = [("baseline", ["--steps", "200"]), ("accumulate-to-fit", [])]
CONFIGS = [
    ("1 thread", {"RAYON_NUM_THREADS": "1"}),
    ("2 threads, pool", {"RAYON_NUM_THREADS": "2", "GACCWB_CPU_POOL": "pool"}),
    ("2 threads, auto", {"RAYON_NUM_THREADS": "2", "GACCWB_CPU_POOL": "auto"}),
]
LOADS = [("idle", None), ("busy nice 0", 0), ("busy nice 10", 10)]
SUMMARY = re.compile(r"([0-9.]+) ms/step over the last")


def start_load(nice):
    if nice is None:
        return None
    return subprocess.Popen(["nice", "-n", str(nice), "sh", "-c", "while :; do :; done"])


def run(binary, preset, extra, env_over):
    env = dict(os.environ, **env_over)
    with tempfile.TemporaryDirectory() as tmp:
        record = os.path.join(tmp, "run.jsonl")
        t0 = time.monotonic()
        out = subprocess.run([binary, "run", preset, "--headless", *extra, "--record", record],
                             env=env, capture_output=True, text=True, check=True)
        wall = time.monotonic() - t0
        with open(record) as f:
            steps = [e for e in map(json.loads, f) if e["type"] == "step"]
    m = SUMMARY.search(out.stdout + out.stderr)
    return wall, float(m.group(1)) if m else float("nan"), pool_share(steps)


def pool_share(steps):
    """(windows on the pool, their cost beyond the run's median window on one thread, as a
    share of all step time); None where the run recorded no choice or never ran serial."""
    threads = [s.get("cpu_threads") for s in steps]
    if None in threads:
        return None
    serial = [s["step_ms"] for s in steps[2:] if s["cpu_threads"] == 1]
    pool = [s["step_ms"] for s in steps[2:] if s["cpu_threads"] > 1]
    if not serial:
        return len(pool), None
    base = statistics.median(serial)
    return len(pool), sum(ms - base for ms in pool) / sum(s["step_ms"] for s in steps[2:])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--binary", default=os.path.join(ROOT, "target", "release", "gaccwb"))
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    results = {}
    for rnd in range(args.rounds):
        for load_name, nice in LOADS:
            load = start_load(nice)
            try:
                for preset, extra in CASES:
                    for cfg_name, env in CONFIGS:
                        wall, ms, share = run(args.binary, preset, extra, env)
                        results.setdefault((preset, load_name, cfg_name), []).append((wall, ms))
                        print(f"round {rnd + 1} {preset:18} {load_name:13} {cfg_name:16} "
                              f"wall {wall:7.2f} s  {ms:8.1f} ms/step{describe(share)}", flush=True)
            finally:
                if load:
                    load.kill()
                    load.wait()
    print("\nmedian over rounds; ratio = this config / 1 thread under the same load")
    print(f"{'preset':18} {'load':13} {'config':16} {'wall s':>8} {'ms/step':>8} {'wall ratio':>10} {'step ratio':>10}")
    for preset, _ in CASES:
        for load_name, _ in LOADS:
            base = results[(preset, load_name, CONFIGS[0][0])]
            bw, bm = median([w for w, _ in base]), median([m for _, m in base])
            for cfg_name, _ in CONFIGS:
                rs = results[(preset, load_name, cfg_name)]
                w, m = median([x for x, _ in rs]), median([y for _, y in rs])
                print(f"{preset:18} {load_name:13} {cfg_name:16} {w:8.2f} {m:8.1f} {w / bw:10.2f} {m / bm:10.2f}")


def describe(share):
    if share is None:
        return ""
    windows, cost = share
    if cost is None:
        return f"  {windows} windows on the pool, none on one thread"
    return f"  {windows} windows on the pool, costing {100 * cost:+.1f}% of step time against one thread"


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


if __name__ == "__main__":
    main()
