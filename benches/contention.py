#!/usr/bin/env python3
"""The CPU engine beside a competing busy process.

Runs the default preset (`baseline`, --steps 200) and `accumulate-to-fit` (its 150 steps)
headless, idle and beside one busy process at nice 0 and at nice 10, with:
  1 thread          RAYON_NUM_THREADS=1
  2 threads, pool   RAYON_NUM_THREADS=2 GACCWB_CPU_POOL=pool  (every window on the pool)
  2 threads, auto   RAYON_NUM_THREADS=2 (the default: the pool governor chooses)
and prints each run's wall time and ms per optimizer step over its last 10 steps, then the
ratios against 1 thread under the same load (below 1: faster than one thread).

  cargo build --release && python3 benches/contention.py [--rounds 2] [--binary PATH]

The machine is shared: read ratios from one invocation, and expect a few % of noise.
"""

import argparse
import os
import re
import subprocess
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
    t0 = time.monotonic()
    out = subprocess.run([binary, "run", preset, "--headless", *extra], env=env,
                         capture_output=True, text=True, check=True)
    wall = time.monotonic() - t0
    m = SUMMARY.search(out.stdout + out.stderr)
    pool_lines = out.stdout.count("CPU ops now on") + out.stderr.count("CPU ops now on")
    return wall, float(m.group(1)) if m else float("nan"), pool_lines


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
                        wall, ms, _ = run(args.binary, preset, extra, env)
                        results.setdefault((preset, load_name, cfg_name), []).append((wall, ms))
                        print(f"round {rnd + 1} {preset:18} {load_name:13} {cfg_name:16} "
                              f"wall {wall:7.2f} s  {ms:8.1f} ms/step", flush=True)
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


def median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


if __name__ == "__main__":
    main()
