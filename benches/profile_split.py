#!/usr/bin/env python3
"""Where a CPU training step's time goes: a call-graph profile of `gaccwb bench` split into kinds of work.

    RAYON_NUM_THREADS=1 perf record -F 197 --call-graph dwarf,16384 -D 7000 -o step.data \\
        target/release/gaccwb bench --model tests/fixtures/hf/shapes/smollm-135m/config.json \\
        --seq-len 256 --threads 1 --case 2,1 --dtype f32 --steps 4 --warmup 1
    perf script -i step.data -F ip,sym | python3 benches/profile_split.py

`-D` (milliseconds) skips the start-up; samples under the model's initialisation, the product
timings and the FMA peak that the bench runs after its steps are left out, so what remains is
the steps. Each sample is put in the first kind its stack matches, from its innermost function
that was not inlined:

- products: `gemm`'s micro-kernels, and its packing and blocking loops (attention's apart);
- the optimizer (the gradient norm and AdamW: `ops::fused::optim`);
- attention's own work besides its products (softmax, rotary turns);
- the other fused element-wise kernels (norms, SwiGLU or GELU, the head's softmax, adds);
- a pool thread waiting for work (it spins a while before it sleeps), page faults, and the rest.

Standard-library Python; reads `perf script` output on standard input (or the file named).
"""
import collections
import re
import sys

# Stacks under these are not the step.
OUTSIDE = ("peak::", "measure_products", "model::init", "Trainer::new")
FAULTS = ("exc_page_fault", "clear_page", "do_anonymous_page", "handle_mm_fault", "folio", "memcg",
          "mem_cgroup", "pte_", "get_page_from_freelist", "access_error")


def stacks(lines):
    """Each sample's frames, innermost first (`perf script -F ip,sym`: a line per frame, a
    blank line between samples)."""
    frames = []
    for line in lines:
        parts = line.split(None, 1)
        if not parts:
            if frames:
                yield frames
            frames = []
        elif len(parts) == 2:
            frames.append(re.sub(r"\+0x[0-9a-f]+$", "", parts[1].strip()))
    if frames:
        yield frames


def kind(frames):
    """The kind of work of one sample."""
    leaf = next((f for f in frames if not f.endswith("(inlined)")), frames[0])
    attention = " (attention)" if any("attention::Attention" in f for f in frames) else ""
    if "microkernel" in leaf:
        return "products: micro-kernel" + attention
    # Packing, and `gemm`'s blocking loops (inlined into a thread-local's `with`).
    if "imp_fastcall" in leaf or "gemm_basic" in leaf or (
        "LocalKey" in leaf and any("gemm_common" in f for f in frames)
    ):
        return "products: packing" + attention
    if any("fused::optim" in f for f in frames):
        return "optimizer: gradient norm, AdamW"
    if attention:
        return "attention: softmax, rotary"
    if any(f in leaf for f in FAULTS):
        return "page faults"
    if "ops::pool::" in leaf:
        return "pool: waiting for work"
    if "vmath" in leaf or "ops::fused::" in leaf:
        return "element-wise: norms, activations, head softmax, adds"
    return "other"


def main():
    lines = open(sys.argv[1]) if len(sys.argv) > 1 else sys.stdin
    counts = collections.Counter(
        kind(frames) for frames in stacks(lines) if not any(o in f for f in frames for o in OUTSIDE)
    )
    total = sum(counts.values())
    if total == 0:
        sys.exit("profile_split: no samples of the step (was the profile recorded with --call-graph?)")
    print(f"{total} samples of the step")
    for name, n in counts.most_common():
        print(f"{100 * n / total:5.1f}%  {name}")


if __name__ == "__main__":
    main()
