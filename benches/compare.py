#!/usr/bin/env python3
"""Candle (gaccwb bench) against PyTorch eager (torch_reference.py), run alternately.

For each thread count and micro-batch, runs `rounds` pairs (Candle then PyTorch, one fresh
process each, so neither inherits the other's caches or thread pools) and prints tokens/s
min/median/max of each and the Candle/PyTorch ratio of each round: min/median/max.

  python3 benches/compare.py                    # threads 1 2, micro-batch 8 32, 3 rounds
  python3 benches/compare.py --install          # first install CPU PyTorch (outside the repo)
  python3 benches/compare.py --threads 1 --micro-batch 8 --rounds 5 --steps 10

PyTorch is looked for on the normal path, then in --torch-dir (default ~/.cache/gaccwb-torch).
The gaccwb binary is built with `cargo build --release` unless --no-build.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torch_env(torch_dir):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [torch_dir, env.get("PYTHONPATH", "")] if p)
    return env


def have_torch(env):
    probe = [sys.executable, "-c", "import torch"]
    return subprocess.run(probe, env=env, capture_output=True).returncode == 0


def install_torch(torch_dir):
    """PyPI's Linux wheel is the CUDA build and `import torch` loads its CUDA libraries even on
    CPU (`--no-deps` alone fails), so this is the smallest install PyPI can give (~5.3 GB)."""
    pip = [sys.executable, "-m", "pip", "install", "--target", torch_dir, "torch"]
    subprocess.run(pip, check=True)


def run_json(cmd, env=None):
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{out.stderr}")
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1])


def spread(values):
    return f"{min(values):8.0f} {statistics.median(values):8.0f} {max(values):8.0f}"


def main():
    ap = argparse.ArgumentParser(description="Candle vs PyTorch eager tokens/s, alternating.")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--micro-batch", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--accum-steps", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--torch-dir", default=os.path.expanduser("~/.cache/gaccwb-torch"))
    ap.add_argument("--install", action="store_true", help="install CPU PyTorch into --torch-dir")
    ap.add_argument("--no-build", action="store_true")
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "release", "gaccwb"))
    args = ap.parse_args()

    env = torch_env(args.torch_dir)
    if not have_torch(env):
        if not args.install:
            sys.exit(f"PyTorch not found (also looked in {args.torch_dir}); rerun with --install")
        install_torch(args.torch_dir)
    if not args.no_build:
        subprocess.run(["cargo", "build", "--release", "--quiet"], cwd=ROOT, check=True)

    print("Candle / PyTorch eager, tokens/s (positions per second), f32, CPU; "
          f"{args.rounds} alternating rounds of {args.steps} timed steps each")
    print(f"{'thr':>3} {'B':>3} {'K':>2} | {'candle min/med/max':>26} | {'torch min/med/max':>26} "
          f"| {'ratio min/med/max':>20}")
    for threads in args.threads:
        for b in args.micro_batch:
            common = ["--steps", str(args.steps), "--warmup", str(args.warmup)]
            candle_cmd = [args.bin, "bench", "--json", "--threads", str(threads),
                          "--case", f"{b},{args.accum_steps}"] + common
            torch_cmd = [sys.executable, os.path.join(ROOT, "benches", "torch_reference.py"),
                         "--json", "--threads", str(threads), "--micro-batch", str(b),
                         "--accum-steps", str(args.accum_steps)] + common
            candle, torch_, ratio = [], [], []
            for _ in range(args.rounds):
                c = run_json(candle_cmd)["tokens_per_s"]
                t = run_json(torch_cmd, env)["tokens_per_s"]
                candle.append(c)
                torch_.append(t)
                ratio.append(c / t)
            print(f"{threads:>3} {b:>3} {args.accum_steps:>2} | {spread(candle)} | {spread(torch_)} | "
                  f"{min(ratio):6.2f} {statistics.median(ratio):6.2f} {max(ratio):6.2f}", flush=True)


if __name__ == "__main__":
    main()
