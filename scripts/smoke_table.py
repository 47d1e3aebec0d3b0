#!/usr/bin/env python3
"""The GPU smoke script's report: one row per recorded preset, then measured vs estimated
memory per ledger category.

Usage: smoke_table.py DIR
DIR holds one recording per preset (NAME.jsonl) and, when written by gpu-smoke.sh, runs.tsv
(preset, exit status, seconds). Only the standard library is used.

Figures, all taken from the recording (never from this script's own measurements):
  tok/s       mean `tokens_per_s` of the last 10 `step` events (what the headless summary prints)
  NVML peak   highest per-process device memory in `device` events with source `nvml`
              (device-wide `used` minus the first sample when the driver hides per-process figures)
  trainer     highest `peak` of measured `memory` events (cuda-pool on a GPU, allocator on a CPU)
              and of `device` events with source `cuda-pool`
  estimate    highest `total` of `memory` events with source `estimate`
  categories  per category, the highest measured value against the highest estimated one
NVML and the trainer agree when the trainer's peak is not above NVML's (5% + 64 MiB sampling
slack) and NVML exceeds it by no more than the CUDA context allowance (GPU_SMOKE_CONTEXT_MIB,
default 1536): NVML also counts the context, loaded kernels and cuBLAS workspaces.
"""

import json
import os
import sys

MIB = 1024 * 1024
CATEGORIES = [
    "parameters",
    "compute_weights",
    "gradients",
    "gradients_transient",
    "optimizer_state",
    "offloaded",
    "activations",
    "frozen",
    "other",
]
TRAINER_SOURCES = ("allocator", "cuda-pool")


def read_events(path):
    """Events of a JSON Lines recording; a truncated last line (a crash) is reported, not fatal."""
    events, problems = [], []
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError as e:
            problems.append(f"{os.path.basename(path)}:{number}: not JSON ({e.msg})")
    return events, problems


def fmt_bytes(n):
    if n is None:
        return "-"
    for unit, size in (("GiB", 1024**3), ("MiB", MIB), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def max_or_none(values):
    values = [v for v in values if v is not None]
    return max(values) if values else None


def nvml_peak(device_events):
    """(bytes, how) of the process's peak device memory per NVML, or (None, why not)."""
    nvml = [e for e in device_events if e.get("source") == "nvml"]
    with_data = [e for e in nvml if e.get("used") is not None]
    if not with_data:
        reasons = [e["unavailable"] for e in nvml if e.get("unavailable")]
        return None, (reasons[0] if reasons else "no NVML samples in the recording")
    per_process = max_or_none(e.get("process_used") for e in with_data)
    if per_process is not None:
        return per_process, "process"
    baseline = with_data[0]["used"]
    return max(e["used"] for e in with_data) - baseline, "device delta"


def trainer_peak(memory_events, device_events):
    measured = [
        e.get("peak") or e.get("total")
        for e in memory_events
        if e.get("source") in TRAINER_SOURCES
    ]
    pool = [e.get("peak") or e.get("used") for e in device_events if e.get("source") == "cuda-pool"]
    return max_or_none(measured + pool)


def category_peaks(chosen):
    """Highest value of each category over every phase and step, or None without such events."""
    if not chosen:
        return None
    return {c: max(e.get("categories", {}).get(c, 0) or 0 for e in chosen) for c in CATEGORIES}


def agreement(nvml, nvml_how, trainer, allowance):
    if nvml is None:
        return f"n/a ({nvml_how})"
    if trainer is None:
        return "n/a (no trainer figure)"
    if trainer > nvml * 1.05 + 64 * MIB:
        return f"NO: trainer {fmt_bytes(trainer - nvml)} above NVML"
    gap = max(nvml - trainer, 0)
    if gap > allowance:
        return f"NO: NVML {fmt_bytes(gap)} above trainer"
    return f"yes (NVML +{fmt_bytes(gap)})"


def worst_category(measured, estimate):
    """The estimated category furthest from its measurement, as 'name x1.23'."""
    if measured is None or estimate is None:
        return "-"
    worst, worst_off = None, 0.0
    for c in CATEGORIES:
        m, e = measured[c], estimate[c]
        if e <= 0 or c == "other":
            continue
        ratio = m / e
        off = max(ratio, 1 / ratio) if ratio > 0 else float("inf")
        if worst is None or off > worst_off:
            worst, worst_off = f"{c} x{ratio:.2f}", off
    return worst or "-"


def summarize(name, path, status, allowance):
    events, problems = read_events(path)
    by_type = {}
    for e in events:
        by_type.setdefault(e.get("type"), []).append(e)
    steps = by_type.get("step", [])
    tail = steps[-10:]
    # Estimates are `estimate` events; recordings made before that carried them as `memory`
    # events with source "estimate" (the reader in crates/engine/src/record.rs migrates the same).
    memory_all, device = by_type.get("memory", []), by_type.get("device", [])
    memory = [e for e in memory_all if e.get("source") != "estimate"]
    estimates = by_type.get("estimate", []) + [e for e in memory_all if e.get("source") == "estimate"]
    ends = by_type.get("end", [])
    end = ends[-1]["reason"] if ends else "no end event"
    nvml, nvml_how = nvml_peak(device)
    trainer = trainer_peak(memory, device)
    measured = category_peaks([e for e in memory if e.get("source") in TRAINER_SOURCES])
    estimate = category_peaks(estimates)
    estimate_total = max_or_none(e.get("total") for e in estimates)
    ok = status in ("0", None) and end == "completed"
    return {
        "name": name,
        "status": "ok" if ok else f"FAIL ({end}; exit {status})",
        "steps": str(steps[-1]["step"]) if steps else "0",
        "tok_s": f"{sum(s['tokens_per_s'] for s in tail) / len(tail):.0f}" if tail else "-",
        "nvml": fmt_bytes(nvml) + (" (device delta)" if nvml_how == "device delta" else ""),
        "trainer": fmt_bytes(trainer),
        "estimate": fmt_bytes(estimate_total),
        "worst": worst_category(measured, estimate),
        "agree": agreement(nvml, nvml_how, trainer, allowance),
        "measured_cats": measured,
        "estimate_cats": estimate,
        "problems": problems,
        "ok": ok,
    }


def table(rows, columns):
    widths = [max(len(title), *(len(r[key]) for r in rows)) for title, key in columns]
    lines = ["  ".join(t.ljust(w) for (t, _), w in zip(columns, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for r in rows:
        lines.append("  ".join(r[k].ljust(w) for (_, k), w in zip(columns, widths)).rstrip())
    return "\n".join(lines)


def runs_in(directory):
    """(preset, recording, exit status) from runs.tsv, or every recording in the folder."""
    listing = os.path.join(directory, "runs.tsv")
    if os.path.exists(listing):
        with open(listing, encoding="utf-8") as f:
            for line in f:
                name, status, *_ = line.rstrip("\n").split("\t")
                yield name, os.path.join(directory, f"{name}.jsonl"), status
        return
    for file in sorted(os.listdir(directory)):
        if file.endswith(".jsonl"):
            yield file[: -len(".jsonl")], os.path.join(directory, file), None


def category_table(summaries):
    rows = []
    for s in summaries:
        m, e = s["measured_cats"], s["estimate_cats"]
        if m is None and e is None:
            continue
        for c in CATEGORIES:
            mv = m[c] if m else None
            ev = e[c] if e else None
            if not mv and not ev:
                continue
            ratio = f"{mv / ev:.2f}" if mv is not None and ev else "-"
            rows.append(
                {"preset": s["name"], "cat": c, "m": fmt_bytes(mv), "e": fmt_bytes(ev), "r": ratio}
            )
    if not rows:
        return "no memory events with categories in these recordings"
    columns = [("preset", "preset"), ("category", "cat"), ("measured", "m"), ("estimate", "e"),
               ("meas/est", "r")]
    return table(rows, columns)


def main(argv):
    if len(argv) != 2 or not os.path.isdir(argv[1]):
        print("usage: smoke_table.py DIR  (a folder of NAME.jsonl recordings)", file=sys.stderr)
        return 2
    allowance = int(os.environ.get("GPU_SMOKE_CONTEXT_MIB", "1536")) * MIB
    summaries = []
    for name, path, status in runs_in(argv[1]):
        if not os.path.exists(path):
            summaries.append(summarize_missing(name, status))
            continue
        summaries.append(summarize(name, path, status, allowance))
    if not summaries:
        print(f"no recordings in {argv[1]}", file=sys.stderr)
        return 1
    columns = [("preset", "name"), ("status", "status"), ("steps", "steps"), ("tok/s", "tok_s"),
               ("NVML peak", "nvml"), ("trainer peak", "trainer"), ("estimate", "estimate"),
               ("worst category meas/est", "worst"), ("NVML vs trainer", "agree")]
    print(table(summaries, columns))
    print()
    print(category_table(summaries))
    for s in summaries:
        for p in s["problems"]:
            print(f"warning: {p}")
    return 0 if all(s["ok"] for s in summaries) else 1


def summarize_missing(name, status):
    return {
        "name": name, "status": f"FAIL (no recording; exit {status})", "steps": "0", "tok_s": "-",
        "nvml": "-", "trainer": "-", "estimate": "-", "worst": "-", "agree": "-",
        "measured_cats": None, "estimate_cats": None, "problems": [], "ok": False,
    }


if __name__ == "__main__":
    sys.exit(main(sys.argv))
