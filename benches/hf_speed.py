#!/usr/bin/env python3
"""gaccwb's training step at Hugging Face shapes against PyTorch's, alternating, with the host's limit.

For each shape and thread count, each round runs, for each dtype, three fresh processes one after
the other: `gaccwb bench --model CONFIG --json`, transformers' own model (GPT2LMHeadModel /
LlamaForCausalLM built from the same config.json, SDPA attention) and a nanoGPT-style model written
here with `F.scaled_dot_product_attention` (GQA through `enable_gqa`, no repeated K/V). A process
runs one dtype: PyTorch's f32 step, alternated with a bf16 model in one process, ran its backward
about a third slower than alone at GPT-2-small on one thread. All three train from random weights
at the same B, T, K=1,
thread count, loss (token-sum NLL over the window's tokens), global-norm clip 1.0 and AdamW (decay
0.1 on matrices only, betas 0.9/0.95); dropout is off (the engine has none); bf16 is autocast in
PyTorch (f32 master weights) and the engine's bf16 compute dtype. The best PyTorch step of the round
is the anchor: the ratio is gaccwb's median tokens/s over the best PyTorch median of that round.

The host's limit: the best product rate in each dtype, measured in gaccwb's process (its own
product, at 1024³, at [B·T, d]·[d, 4d] and at the head's [B·T, d]·[d, V]; bf16 on AMX tiles or
AVX-512 BF16 dot products where the CPU has them) or by torch.mm at the same shapes; the step's
model FLOP/s (6 per multiplied parameter per token plus attention's 12·L·T·q, the planner's rule) as
a fraction of the best rate in the step's dtype, and beside it gaccwb's and the best PyTorch
step's model FLOP/s as fractions of the f32 FMA peak gaccwb measures (its cores' fused multiply-add
rate with nothing else in the way: the ceiling of any product) where gaccwb's products run on f32
FMAs. bf16 products are timed with torch.mm on a GPU, and
on the CPU only where /proc/cpuinfo lists avx512_bf16 or amx_bf16 (elsewhere PyTorch's bf16 products
run on a slow path). Phase times (forward, backward, optimizer) are medians
of the timed steps; the forward includes the head and the loss. In brackets, the head's share: in
the forward from the LM head's start to the loss, in the backward from its start until the head's
input has its gradient (a hook on it); gaccwb's is the time in its fused head's kernels.

Usage (release binary built first; PyTorch and transformers from outside the repo):
  PYTHONPATH=~/.cache/gaccwb-hf python3 benches/hf_speed.py            # both shapes, threads 1 2, f32 bf16
  PYTHONPATH=~/.cache/gaccwb-hf python3 benches/hf_speed.py --shape gpt2-small --threads 2 \
      --dtype f32 --rounds 1 --steps 2
"""

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHAPES = os.path.join(ROOT, "tests", "fixtures", "hf", "shapes")
IMPLS = ["candle", "torch-hf", "torch-nano"]
TORCH_DTYPE = {"f32": "float32", "bf16": "bfloat16"}


def cpu_flags():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def loadavg():
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


# ---------------------------------------------------------------- PyTorch side (worker process)

def nano_model(cfg, torch, F):
    """A nanoGPT-style model of `cfg` (GPT-2 or LLaMA family), SDPA attention, tied head as configured."""
    nn = torch.nn
    llama = cfg["model_type"] != "gpt2"
    d = cfg["hidden_size"] if llama else cfg["n_embd"]
    layers = cfg["num_hidden_layers"] if llama else cfg["n_layer"]
    heads = cfg["num_attention_heads"] if llama else cfg["n_head"]
    kv = cfg.get("num_key_value_heads", heads) if llama else heads
    hd = cfg.get("head_dim") or d // heads
    ff = cfg["intermediate_size"] if llama else 4 * d
    qkv_bias = cfg["model_type"] == "qwen2" or cfg.get("attention_bias", False)
    vocab = cfg["vocab_size"]
    eps = cfg.get("rms_norm_eps", cfg.get("layer_norm_epsilon", 1e-5))
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))

    def norm():
        return nn.RMSNorm(d, eps=eps) if llama else nn.LayerNorm(d, eps=eps)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.n1, self.n2 = norm(), norm()
            self.qkv = nn.Linear(d, (heads + 2 * kv) * hd, bias=not llama or qkv_bias)
            self.o = nn.Linear(heads * hd, d, bias=not llama)
            if llama:
                self.gate_up = nn.Linear(d, 2 * ff, bias=False)
            else:
                self.fc = nn.Linear(d, ff)
            self.down = nn.Linear(ff, d, bias=not llama)

        def forward(self, x, rope):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.n1(x)).split([heads * hd, kv * hd, kv * hd], dim=-1)
            q = q.view(b, t, heads, hd).transpose(1, 2)
            k = k.view(b, t, kv, hd).transpose(1, 2)
            v = v.view(b, t, kv, hd).transpose(1, 2)
            if rope is not None:
                q, k = rotate(q, rope), rotate(k, rope)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv != heads)
            x = x + self.o(y.transpose(1, 2).reshape(b, t, heads * hd))
            h = self.n2(x)
            if llama:
                g, u = self.gate_up(h).chunk(2, dim=-1)
                h = F.silu(g) * u
            else:
                h = F.gelu(self.fc(h), approximate="tanh")
            return x + self.down(h)

    def rotate(x, rope):
        cos, sin = rope
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(vocab, d)
            self.wpe = None if llama else nn.Embedding(cfg["n_positions"], d)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.nf = norm()
            self.lm_head = nn.Linear(d, vocab, bias=False)
            for p in self.parameters():
                if p.dim() > 1:
                    nn.init.normal_(p, std=0.02)
            if cfg.get("tie_word_embeddings", True):
                self.lm_head.weight = self.wte.weight

        def forward(self, ids):
            t = ids.shape[1]
            x = self.wte(ids)
            rope = None
            if llama:
                at = dict(dtype=torch.float32, device=ids.device)
                inv = 1.0 / theta ** (torch.arange(0, hd, 2, **at) / hd)
                ang = torch.outer(torch.arange(t, **at), inv)
                ang = torch.cat((ang, ang), dim=-1)
                rope = (ang.cos(), ang.sin())
            else:
                x = x + self.wpe.weight[:t]
            for blk in self.blocks:
                x = blk(x, rope)
            return self.lm_head(self.nf(x))

    return Model()


def hf_model(config_json, torch):
    import transformers
    config = transformers.AutoConfig.from_pretrained(config_json)
    for name in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout"):
        if hasattr(config, name):
            setattr(config, name, 0.0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return lambda ids: model(input_ids=ids).logits, model


def head_marks(head, time, sync):
    """When the LM head's forward starts and when its input's gradient is ready, each step: the
    head's share (with the loss) of the forward and of the backward, as `gaccwb bench` splits it."""
    marks = {}

    def ready(_grad):
        sync()
        marks["backward"] = time.perf_counter()

    def start(_module, inputs):
        sync()
        marks["forward"] = time.perf_counter()
        if inputs[0].requires_grad:
            inputs[0].register_hook(ready)

    head.register_forward_pre_hook(start)
    return marks


def torch_worker(args):
    import warnings
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import torch
    import torch.nn.functional as F
    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    torch.manual_seed(0)
    dev = torch.device(args.device)
    # A GPU's kernels return once queued: every time mark waits for them.
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    with open(args.config) as f:
        cfg = json.load(f)
    b, t = args.micro_batch, args.seq_len
    runs = []
    for dtype in args.dtype:
        if args.worker == "torch-hf":
            fwd, module = hf_model(args.config, torch)
        else:
            module = nano_model(cfg, torch, F)
            fwd = module
        module.to(dev)
        module.train()
        decay = [p for p in module.parameters() if p.dim() > 1]
        rest = [p for p in module.parameters() if p.dim() <= 1]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
        try:
            opt = torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, fused=True)
        except (RuntimeError, TypeError):
            opt = torch.optim.AdamW(groups, lr=3e-4, betas=(0.9, 0.95), eps=1e-8)
        params = [p for p in module.parameters()]
        marks = head_marks(module.lm_head, time, sync)
        runs.append({"dtype": dtype, "fwd": fwd, "opt": opt, "params": params, "times": [],
                     "marks": marks})
    vocab = cfg["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    for i in range(args.warmup + args.steps):
        for run in runs:
            tokens = torch.randint(0, vocab, (b, t + 1), generator=gen).to(dev)
            ids, targets = tokens[:, :-1], tokens[:, 1:]
            sync()
            t0 = time.perf_counter()
            run["opt"].zero_grad(set_to_none=True)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=run["dtype"] == "bf16"):
                logits = run["fwd"](ids)
                nll = F.cross_entropy(logits.reshape(-1, vocab).float(), targets.reshape(-1), reduction="sum")
            sync()
            t1 = time.perf_counter()
            (nll / (b * t)).backward()
            sync()
            t2 = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(run["params"], 1.0)
            run["opt"].step()
            sync()
            t3 = time.perf_counter()
            nll.item()
            if i >= args.warmup:
                m = run["marks"]
                run["times"].append((t3 - t0, t1 - t0, t2 - t1, t3 - t2, t1 - m["forward"],
                                     m["backward"] - t1))
    for run in runs:
        med = [statistics.median(x[j] for x in run["times"]) for j in range(6)]
        print(json.dumps({
            "impl": args.worker, "dtype": run["dtype"], "threads": torch.get_num_threads(),
            "torch": torch.__version__, "tokens_per_s": b * t / med[0],
            "forward_ms": med[1] * 1e3, "backward_ms": med[2] * 1e3, "optimizer_ms": med[3] * 1e3,
            "head_forward_ms": med[4] * 1e3, "head_backward_ms": med[5] * 1e3,
        }), flush=True)
    if args.products:
        products(args, cfg, torch, dev, sync)


def products(args, cfg, torch, dev, sync):
    """torch.mm at the shapes gaccwb times: the square, [rows, d]·[d, 4d] and the head's."""
    d = cfg.get("hidden_size") or cfg["n_embd"]
    ff = 4 * d
    rows = args.micro_batch * args.seq_len
    shapes = [(1024, 1024, 1024), (rows, d, ff), (rows, d, cfg["vocab_size"])]
    dtypes = [torch.float32]
    if dev.type == "cuda" or cpu_flags() & {"avx512_bf16", "amx_bf16"}:
        dtypes.append(torch.bfloat16)
    out = []
    for dt in dtypes:
        for m, k, n in shapes:
            a, w = torch.ones(m, k, dtype=dt, device=dev), torch.ones(k, n, dtype=dt, device=dev)
            a @ w
            calls = 1
            if dev.type == "cuda":
                # One product can take less than its launch: a sample runs enough to take 20 ms.
                sync()
                t0 = time.perf_counter()
                a @ w
                sync()
                calls = min(10000, math.ceil(0.02 / max(time.perf_counter() - t0, 1e-9)))
            times = []
            for _ in range(max(2, args.steps)):
                sync()
                t0 = time.perf_counter()
                for _ in range(calls):
                    a @ w
                sync()
                times.append((time.perf_counter() - t0) / calls)
            out.append({"dtype": str(dt).split(".")[-1], "m": m, "k": k, "n": n,
                        "flops_per_s": 2.0 * m * k * n / statistics.median(times)})
    print(json.dumps({"impl": "torch-product", "products": out}), flush=True)


# ---------------------------------------------------------------- driver

def run_lines(cmd, env):
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def one_round(args, config, threads, first):
    """A process of each implementation in turn, for each dtype; returns {impl: {dtype: row}},
    product rows."""
    env = dict(os.environ, RAYON_NUM_THREADS=str(threads), OMP_NUM_THREADS=str(threads))
    common = ["--steps", str(args.steps), "--warmup", str(args.warmup)]
    torch_common = ["--steps", str(args.steps), "--warmup", str(args.torch_warmup)]
    rows, prods, peaks = {}, [], []
    for dtype in args.dtype:
        for impl in args.impls:
            if impl == "candle":
                cmd = [args.bin, "bench", "--model", config, "--seq-len", str(args.seq_len),
                       "--json", "--threads", str(threads), "--case", f"{args.micro_batch},1",
                       "--dtype", dtype, "--device", args.device] + common
            else:
                cmd = [sys.executable, os.path.abspath(__file__), "--worker", impl, "--config",
                       config, "--threads", str(threads), "--micro-batch", str(args.micro_batch),
                       "--seq-len", str(args.seq_len), "--dtype", dtype,
                       "--device", args.device] + torch_common
                if first and impl == "torch-nano" and dtype == args.dtype[0]:
                    cmd.append("--products")
            for row in run_lines(cmd, env):
                print("raw " + json.dumps({k: v for k, v in row.items() if k != "step_s"}),
                      file=sys.stderr, flush=True)
                if row["impl"] in IMPLS:
                    rows.setdefault(row["impl"], {})[row["dtype"]] = row
                elif row["impl"] == "candle-product":
                    prods += [dict(p, dtype=TORCH_DTYPE[p["dtype"]], impl="candle")
                              for p in row["products"]]
                    if row.get("fma_peak"):
                        peaks.append(row["fma_peak"])
                else:
                    prods += [dict(p, impl="torch") for p in row["products"]]
    return rows, prods, peaks


def of_peak(c, best, peak):
    """gaccwb's median model FLOP/s and the best PyTorch step's at the same FLOPs per token, as
    shares of the FMA peak, where gaccwb's products run on f32 FMAs ('-' elsewhere)."""
    if not peak or c[0].get("of_fma_peak") is None:
        return "-"
    per_token = c[0]["flops_per_token"]
    ours = statistics.median(x["tokens_per_s"] for x in c) * per_token
    theirs = statistics.median(best) * per_token
    return f"{100 * ours / peak:.0f}% / {100 * theirs / peak:.0f}%"


def ms(x):
    """Milliseconds, or '-' where the implementation did not time it."""
    return "-" if x is None else f"{x:.0f}"


def spread(xs, fmt="{:.1f}"):
    return " / ".join(fmt.format(x) for x in (min(xs), statistics.median(xs), max(xs)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", nargs="+", default=["gpt2-small", "smollm-135m"],
                    help="names under tests/fixtures/hf/shapes, or paths to config.json files")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--dtype", nargs="+", default=["f32", "bf16"], choices=["f32", "bf16"])
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    # PyTorch's bf16 step is still warming up after one step: the nanoGPT-style SmolLM-135M step
    # ran 188.7 tok/s after one warm-up step, 270.8 after four.
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--torch-warmup", type=int,
                    help="warm-up steps of the PyTorch processes (default: --warmup); where their bf16 "
                         "step takes minutes (a CPU without bf16 instructions), 0 keeps three rounds "
                         "to about an hour a shape")
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "release", "gaccwb"))
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="where every step runs (cuda: a gaccwb built with --features cuda)")
    ap.add_argument("--worker", choices=IMPLS[1:], help=argparse.SUPPRESS)
    ap.add_argument("--config", help=argparse.SUPPRESS)
    ap.add_argument("--products", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        args.threads = args.threads[0]
        return torch_worker(args)
    if args.torch_warmup is None:
        args.torch_warmup = args.warmup
    if not os.path.exists(args.bin):
        sys.exit(f"{args.bin} not found: run `cargo build --release` first (or pass --bin)")
    import importlib.util
    # Without transformers (a GPU machine with PyTorch alone) the nanoGPT-style step is the anchor.
    args.impls = [i for i in IMPLS if i != "torch-hf" or importlib.util.find_spec("transformers")]
    if "torch-hf" not in args.impls:
        print("# transformers is not importable: its step is not timed (HF column '-')", flush=True)
    flags = cpu_flags()
    simd = sorted(f for f in flags if f.startswith(("avx512", "amx")) or f in ("avx2", "fma"))
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} CPUs, "
          f"flags: {' '.join(simd)}; B={args.micro_batch} T={args.seq_len} K=1, "
          f"{args.rounds} rounds of {args.steps} timed steps after {args.warmup} warm-up "
          f"({args.torch_warmup} for PyTorch), "
          f"device {args.device}", flush=True)
    header = ("| shape | thr | dtype | gaccwb tok/s | HF tok/s | nano tok/s | ratio to best min/med/max "
              "| gaccwb GFLOP/s | of best product in its dtype | of FMA peak gaccwb / best torch "
              "| gaccwb fwd (head) / bwd (head) / opt ms "
              "| best torch fwd (head) / bwd (head) / opt ms "
              "| load |")
    print(header)
    print("|" + "|".join([" --- "] * (header.count("|") - 1)) + "|")
    for shape in args.shape:
        config = shape if shape.endswith(".json") else os.path.join(SHAPES, shape, "config.json")
        for threads in args.threads:
            per = {d: {i: [] for i in args.impls} for d in args.dtype}
            loads, prods, peaks = [], [], []
            for r in range(args.rounds):
                loads.append(loadavg())
                rows, p, f = one_round(args, config, threads, r == 0)
                prods += p
                peaks += f
                for d in args.dtype:
                    for i in args.impls:
                        per[d][i].append(rows[i][d])
            best_rate = {d: max(p["flops_per_s"] for p in prods if p["dtype"] == TORCH_DTYPE[d])
                         for d in args.dtype}
            for line in prods:
                print(f"#   {shape} {threads} thr: {line['impl']} {line['dtype']} product "
                      f"[{line['m']}x{line['k']}]·[{line['k']}x{line['n']}] "
                      f"{line['flops_per_s'] / 1e9:.1f} GFLOP/s"
                      + (f" on {line['kernel']}" if "kernel" in line else ""), flush=True)
            peak = max((f["flops_per_s"] for f in peaks), default=None)
            if peak:
                print(f"#   {shape} {threads} thr: f32 FMA peak {peak / 1e9:.1f} GFLOP/s "
                      f"({peaks[0]['isa']}; the rounds read "
                      f"{spread([f['flops_per_s'] / 1e9 for f in peaks])})", flush=True)
            for d in args.dtype:
                c, hf, nano = (per[d].get(i, []) for i in IMPLS)
                tok = lambda rows: [x["tokens_per_s"] for x in rows]  # noqa: E731
                best = [max(a, b) for a, b in zip(tok(hf), tok(nano))] if hf else tok(nano)
                ratio = [a / b for a, b in zip(tok(c), best)]
                rate = [x["flops_per_s"] for x in c]
                mid = len(c) // 2
                bt = hf if hf and statistics.median(tok(hf)) >= statistics.median(tok(nano)) else nano
                phases = lambda x: "{:.0f} ({}) / {:.0f} ({}) / {:.0f}".format(  # noqa: E731
                    x["forward_ms"], ms(x.get("head_forward_ms")), x["backward_ms"],
                    ms(x.get("head_backward_ms")), x["optimizer_ms"])
                order = sorted(range(len(c)), key=lambda k: c[k]["tokens_per_s"])
                print(f"| {shape} | {threads} | {d} | {spread(tok(c))} | {spread(tok(hf)) if hf else '-'} | "
                      f"{spread(tok(nano))} | {spread(ratio, '{:.2f}')} | "
                      f"{statistics.median(rate) / 1e9:.1f} | "
                      f"{100 * statistics.median(rate) / best_rate[d]:.0f}% | "
                      f"{of_peak(c, best, peak)} | {phases(c[order[mid]])} | "
                      f"{phases(sorted(bt, key=lambda x: x['tokens_per_s'])[mid])} | "
                      f"{min(loads):.1f}–{max(loads):.1f} |", flush=True)


if __name__ == "__main__":
    main()
