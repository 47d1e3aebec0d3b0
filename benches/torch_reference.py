#!/usr/bin/env python3
"""The gaccwb model and optimizer step in PyTorch eager, for a side-by-side throughput check.

Same architecture, initialisation scheme, parameter order and step as src/model.rs and
src/train/: token + position embeddings, pre-LN blocks (LN -> qkv [d,3d] -> causal softmax
attention scaled 1/sqrt(hd) -> proj [d,d] -> residual; LN -> fc [d,4d] -> GELU tanh -> proj [4d,d]
-> residual), final LN, untied head [d,V], LN eps 1e-5; loss = sum of token NLL over the window /
counted tokens, K micro-batches of B accumulated; global-norm clip 1.0; AdamW (decoupled decay
0.1, none on biases and norm gains, betas 0.9/0.95, eps 1e-8). Every sample is full length, so
tokens/s is positions processed per second.

Usage: torch_reference.py --threads 1 --micro-batch 8 --accum-steps 1 [--steps 10] [--json]
Install outside the repo (see README "Performance"), then run with PYTHONPATH=~/.cache/gaccwb-torch:
  pip install --target ~/.cache/gaccwb-torch torch
"""

import argparse
import json
import math
import time
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


class Config:
    vocab = 256
    d_model = 128
    layers = 4
    heads = 4
    seq_len = 128


def init_params(cfg, seed):
    """Parameters in the order of Gpt::new; returns [(name, tensor, decay)]."""
    g = torch.Generator().manual_seed(seed)
    d, v, t = cfg.d_model, cfg.vocab, cfg.seq_len
    proj_std = 0.02 / math.sqrt(2.0 * cfg.layers)
    params = []

    def normal(name, shape, std):
        params.append((name, torch.randn(shape, generator=g) * std, True))

    def const(name, shape, value):
        params.append((name, torch.full(shape, value), False))

    normal("wte", (v, d), 0.02)
    normal("wpe", (t, d), 0.02)
    for l in range(cfg.layers):
        const(f"h{l}.ln1.g", (d,), 1.0)
        const(f"h{l}.ln1.b", (d,), 0.0)
        normal(f"h{l}.attn.qkv.w", (d, 3 * d), 0.02)
        const(f"h{l}.attn.qkv.b", (3 * d,), 0.0)
        normal(f"h{l}.attn.proj.w", (d, d), proj_std)
        const(f"h{l}.attn.proj.b", (d,), 0.0)
        const(f"h{l}.ln2.g", (d,), 1.0)
        const(f"h{l}.ln2.b", (d,), 0.0)
        normal(f"h{l}.mlp.fc.w", (d, 4 * d), 0.02)
        const(f"h{l}.mlp.fc.b", (4 * d,), 0.0)
        normal(f"h{l}.mlp.proj.w", (4 * d, d), proj_std)
        const(f"h{l}.mlp.proj.b", (d,), 0.0)
    const("lnf.g", (d,), 1.0)
    const("lnf.b", (d,), 0.0)
    normal("head.w", (d, v), 0.02)
    return [(n, p.requires_grad_(), decay) for n, p, decay in params]


def forward(cfg, p, ids, mask, sdpa=False):
    """Logits [B*T, V]; `p` is the parameter list in Gpt::new order, `mask` the causal mask.
    With `sdpa` attention is `F.scaled_dot_product_attention` (causal; `mask` unused)."""
    b, t = ids.shape
    d, h = cfg.d_model, cfg.heads
    hd = d // h
    it = iter(p)
    wte, wpe = next(it), next(it)
    x = (wte[ids] + wpe[:t]).reshape(b * t, d)
    for _ in range(cfg.layers):
        g1, b1, wqkv, bqkv, wproj, bproj = (next(it) for _ in range(6))
        g2, b2, wfc, bfc, wout, bout = (next(it) for _ in range(6))
        a = F.layer_norm(x, (d,), g1, b1, 1e-5)
        qkv = torch.addmm(bqkv, a, wqkv).reshape(b, t, 3, h, hd).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        if sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
            y = torch.softmax(scores + mask, dim=-1) @ v
        y = y.transpose(1, 2).reshape(b * t, d)
        x = x + torch.addmm(bproj, y, wproj)
        m = F.layer_norm(x, (d,), g2, b2, 1e-5)
        m = F.gelu(torch.addmm(bfc, m, wfc), approximate="tanh")
        x = x + torch.addmm(bout, m, wout)
    gf, bf, head = next(it), next(it), next(it)
    return F.layer_norm(x, (d,), gf, bf, 1e-5) @ head


def make_window(cfg, gen, n):
    tokens = torch.randint(1, 17, (n, cfg.seq_len + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--accum-steps", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.set_num_interop_threads(1)
    cfg = Config()
    named = init_params(cfg, args.seed)
    params = [p for _, p, _ in named]
    opt = torch.optim.AdamW(
        [
            {"params": [p for _, p, dec in named if dec], "weight_decay": 0.1},
            {"params": [p for _, p, dec in named if not dec], "weight_decay": 0.0},
        ],
        lr=3e-3,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    t = cfg.seq_len
    mask = torch.full((t, t), float("-inf")).triu(1)
    gen = torch.Generator().manual_seed(args.seed)
    b, k = args.micro_batch, args.accum_steps
    window_tokens = b * k * t

    step_s = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        inputs, targets = make_window(cfg, gen, b * k)
        opt.zero_grad(set_to_none=True)
        for j in range(k):
            sl = slice(j * b, (j + 1) * b)
            logits = forward(cfg, params, inputs[sl], mask)
            nll = F.cross_entropy(logits, targets[sl].reshape(-1), reduction="sum")
            (nll / window_tokens).backward()
            nll.item()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        elapsed = time.perf_counter() - t0
        if i >= args.warmup:
            step_s.append(elapsed)

    rates = sorted(window_tokens / s for s in step_s)
    med = rates[len(rates) // 2] if len(rates) % 2 else (rates[len(rates) // 2 - 1] + rates[len(rates) // 2]) / 2
    if args.json:
        print(json.dumps({
            "impl": "torch",
            "torch": torch.__version__,
            "micro_batch": b,
            "accum_steps": k,
            "threads": torch.get_num_threads(),
            "tokens_per_step": window_tokens,
            "tokens_per_s": med,
            "step_s": step_s,
        }))
    else:
        print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), B={b} K={k}: "
              f"tokens/s min {rates[0]:.0f} median {med:.0f} max {rates[-1]:.0f}")


if __name__ == "__main__":
    main()
