#!/usr/bin/env python3
"""Activation bytes kept for backward: gaccwb's ledger beside PyTorch's saved tensors.

For each shape (V 256, 4 heads; d_model/seq_len 128/128 and 256/256) and micro-batch (4, 8)
this runs one recorded training step of gaccwb per dtype (`gaccwb run --headless --steps 1
--record`, the `activations` category of the backward phase's memory event) and one forward of
the same model in PyTorch (benches/torch_reference.py's model and loss), counting the bytes
autograd saves for backward with `torch.autograd.graph.saved_tensors_hooks`, each storage once,
parameters and (under autocast) their half-precision casts left out, as gaccwb books those as
`parameters` and `compute_weights`. PyTorch runs eager attention (the probabilities kept) and
`F.scaled_dot_product_attention` (SDPA), in f32 and under bf16 autocast.

Per layer: the difference between 4 and 2 layers, halved (both sides). gaccwb's f32 and bf16 rows
are the fused CPU path (f32 arithmetic on bf16 storage); its `lean` rows
(`GACCWB_KERNELS=lean`) are the lean path, what a CUDA step runs.

Last, the bf16/f32 tokens/s ratio of gaccwb's default shape (d128 T128 B8, V 256) at one thread and
at two: `gaccwb bench --dtype f32,bf16 --case 8,1`, the two dtypes' steps interleaved in one process.

Usage: PYTHONPATH=DIR_WITH_TORCH benches/activations.py [--gaccwb target/release/gaccwb]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_reference  # noqa: E402

SHAPES = [(128, 128), (256, 256)]
BATCHES = [4, 8]
LAYERS = (4, 2)
VOCAB, HEADS = 256, 4


def gaccwb_activations(binary, d, t, b, layers, dtype, lean):
    """The backward phase's `activations` of one recorded step."""
    env = dict(os.environ, RAYON_NUM_THREADS="1")
    env["GACCWB_KERNELS"] = "lean" if lean else "fused"
    with tempfile.TemporaryDirectory() as tmp:
        record = os.path.join(tmp, "run.jsonl")
        sets = [
            f"model.vocab={VOCAB}", f"model.d_model={d}", f"model.seq_len={t}",
            f"model.layers={layers}", f"model.heads={HEADS}", f"train.micro_batch={b}",
            "train.accum_steps=1", f"train.dtype={dtype}", "train.eval_every=0",
        ]
        cmd = [binary, "run", "baseline", "--headless", "--steps", "1", "--record", record]
        for s in sets:
            cmd += ["--set", s]
        subprocess.run(cmd, env=env, check=True, capture_output=True)
        with open(record) as f:
            events = [json.loads(line) for line in f]
    backward = [e for e in events if e.get("type") == "memory" and e.get("phase") == "backward"]
    return backward[-1]["categories"]["activations"]


class Shape:
    def __init__(self, d, t, layers):
        self.vocab, self.d_model, self.seq_len, self.layers, self.heads = VOCAB, d, t, layers, HEADS


def torch_saved(d, t, b, layers, bf16, sdpa):
    """Bytes autograd saves for one forward and loss, each storage once, weights left out."""
    cfg = Shape(d, t, layers)
    params = [p for _, p, _ in torch_reference.init_params(cfg, 0)]
    weights = {p.untyped_storage().data_ptr() for p in params}
    saved = {}

    def is_weight_cast(x):
        # Autocast's half-precision copy of a parameter: ToCopy straight from its leaf.
        fn = x.grad_fn
        if fn is None or type(fn).__name__ != "ToCopyBackward0":
            return False
        leaf = fn.next_functions[0][0]
        var = getattr(leaf, "variable", None)
        return var is not None and var.untyped_storage().data_ptr() in weights

    def pack(x):
        storage = x.untyped_storage()
        if storage.data_ptr() not in weights and not is_weight_cast(x):
            saved[storage.data_ptr()] = storage.nbytes()
        return x

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 17, (b, t + 1), generator=gen)
    mask = torch.full((t, t), float("-inf")).triu(1)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = torch_reference.forward(cfg, params, tokens[:, :-1], mask, sdpa=sdpa)
            loss = F.cross_entropy(logits.float(), tokens[:, 1:].reshape(-1), reduction="sum")
    del loss
    return sum(saved.values())


def per_layer(measure):
    """(total at 4 layers, per layer from 4 and 2 layers)."""
    four, two = measure(LAYERS[0]), measure(LAYERS[1])
    return four, (four - two) // (LAYERS[0] - LAYERS[1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gaccwb", default="target/release/gaccwb")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = [("case", "gaccwb total", "per layer", "eager total", "per layer", "SDPA total",
             "per layer", "gaccwb/SDPA per layer")]
    for d, t in SHAPES:
        for b in BATCHES:
            for label, dtype, lean, bf16 in [
                ("f32 (fused)", "f32", False, False),
                ("f32 lean", "f32", True, False),
                ("bf16 (fused)", "bf16", False, True),
                ("bf16 lean", "bf16", True, True),
            ]:
                g = per_layer(lambda n: gaccwb_activations(args.gaccwb, d, t, b, n, dtype, lean))
                e = per_layer(lambda n: torch_saved(d, t, b, n, bf16, sdpa=False))
                s = per_layer(lambda n: torch_saved(d, t, b, n, bf16, sdpa=True))
                rows.append((f"d{d} T{t} B{b} {label}", *(f"{x:,}" for x in (*g, *e, *s)),
                             f"{g[1] / s[1]:.2f}"))
                print(f"done: {rows[-1][0]}", file=sys.stderr)
    print(f"PyTorch {torch.__version__}; V {VOCAB}, 4 layers, {HEADS} heads; bytes kept for backward")
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(rows[0], widths)) + " |")
    print("|" + "|".join("-" * (w + 2) if i == 0 else "-" * (w + 1) + ":" for i, w in enumerate(widths)) + "|")
    for r in rows[1:]:
        print("| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) + " |")
    for threads in (1, 2):
        f32, bf16 = tokens_per_s(args.gaccwb, threads)
        print(f"bf16/f32 tokens/s at d128 T128 B8, {threads} thread(s): {bf16 / f32:.3f} "
              f"({bf16:,.0f} vs {f32:,.0f}; medians of interleaved steps)")


def tokens_per_s(binary, threads, steps=20):
    """Median tokens/s of f32 and bf16 at the default shape, their steps interleaved."""
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads))
    cmd = [binary, "bench", "--dtype", "f32,bf16", "--case", "8,1", "--steps", str(steps), "--json"]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    rates = {row["dtype"]: row["tokens_per_s"] for row in map(json.loads, out.splitlines())}
    return rates["f32"], rates["bf16"]


if __name__ == "__main__":
    main()
