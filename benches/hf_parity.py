#!/usr/bin/env python3
"""Tiny random Hugging Face checkpoints and transformers' figures for them: the parity fixtures.

transformers is the external reference for the engine's GPT-2 and LLaMA-family maths. This script
builds one tiny seeded checkpoint per case with transformers' own classes, computes transformers'
figures for it on the CPU in float32, and writes them as small files under
tests/fixtures/hf/models/, so the Rust tests need no Python. Rerunning it with the same versions
reproduces the same bytes (one thread, deterministic algorithms, fixed seeds).

Usage:
  PYTHONPATH=~/.cache/gaccwb-hf python3 benches/hf_parity.py            # rewrite the fixtures
  PYTHONPATH=~/.cache/gaccwb-hf python3 benches/hf_parity.py --out /tmp/x   # elsewhere (compare)
  PYTHONPATH=~/.cache/gaccwb-hf python3 benches/hf_parity.py --big ~/.cache/gaccwb-models  # only those
Install outside the repo (PyPI only; torch's default wheel also runs on the CPU):
  pip install --target ~/.cache/gaccwb-hf torch transformers peft tokenizers safetensors

What --out (default tests/fixtures/hf/models) receives:
  tokenizer.json        byte-level BPE (GPT-2's pre-tokenizer/decoder) trained on tokenizer-train.txt,
                        with <|endoftext|> added last; every case dir holds a copy
  eval.txt, tokenizer-train.txt   inputs (committed; copied into another --out, never rewritten)
  <case>/               save_pretrained output (config.json, model.safetensors, f32), tokenizer.json,
                        reference.json (batch, loss, 3 AdamW steps, bf16 losses, eval perplexity, the
                        loss under deliberate mistakes), grads.safetensors (the loss's gradient for
                        every parameter, named as in model.safetensors)
  <case>/lora/, <case>/lora-rslora/   PEFT adapters (llama-gqa-llama3, gpt2-tied) with their
                        reference.json and grads.safetensors
  ops.json, ops.safetensors   op-level figures: RMSNorm in bf16, llama3 inv_freq, RoPE applied
Cases: gpt2-tied, gpt2-untied, gpt2-hub-layout (gpt2-tied's weights in the layout of the hub's
GPT-2 files: no "transformer." prefix, attn.bias mask buffers), llama-gqa-llama3, llama-tied,
qwen2-bias, mistral-window. Also writes tests/fixtures/hf/shapes/{gpt2-small,smollm-135m}/config.json.
--big DIR writes only random checkpoints of those two shapes (about 0.5 GB each, never committed),
each with a byte-level BPE tokenizer.json of 8192 + 1 tokens trained on assets/corpus.txt.
docs/PARITY.md describes every figure. The mistakes, ops, PEFT and shape parts are in
hf_parity_extra.py beside this file.
"""

import argparse
import copy
import json
import math
import os
import platform
import shutil
import sys
import warnings
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import hf_parity_extra as extra  # noqa: E402

transformers.utils.logging.disable_progress_bar()

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests/fixtures/hf/models"
SHAPES = ROOT / "tests/fixtures/hf/shapes"
EOS = "<|endoftext|>"
TOKENIZER_BPE = 356  # BPE symbols (256 bytes + merges); EOS is added after them
PAD_MULTIPLE = 8  # model vocab = tokenizer size rounded up, as real checkpoints pad
SEQ = 16
ROWS = 2
INIT_RANGE = 0.2  # larger than the usual 0.02 so attention is far from uniform at d=32
ADAMW = {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1, "clip": 1.0}
BATCH_TEXT = (
    "A small model learns to predict the next word of a story about a keeper, a lamp and the sea; "
    "its loss falls as the weights move along the gradient, one careful step after another."
)


def setup():
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)


def versions():
    import peft
    import safetensors
    import tokenizers

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "tokenizers": tokenizers.__version__,
            "safetensors": safetensors.__version__, "peft": peft.__version__}


def dump_json(obj, path):
    """Indented JSON whose lists of numbers stay on one line; floats at full precision (repr)."""
    def enc(o, ind):
        pad = " " * ind
        if isinstance(o, dict):
            if not o:
                return "{}"
            items = [f'{pad}  {json.dumps(k)}: {enc(v, ind + 2)}' for k, v in o.items()]
            return "{\n" + ",\n".join(items) + f"\n{pad}}}"
        if isinstance(o, (list, tuple)):
            if all(not isinstance(v, (dict, list, tuple)) for v in o):
                return "[" + ", ".join(json.dumps(v) for v in o) + "]"
            return "[\n" + ",\n".join(f"{pad}  {enc(v, ind + 2)}" for v in o) + f"\n{pad}]"
        if isinstance(o, float) and not math.isfinite(o):
            raise ValueError(f"{path}: non-finite number {o}")
        return json.dumps(o)
    Path(path).write_text(enc(obj, 0) + "\n")


# ---------------------------------------------------------------- tokenizer


def train_tokenizer(text, bpe_size):
    """GPT-2-style byte-level BPE, `<|endoftext|>` appended after the BPE symbols (as GPT-2 has it)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=bpe_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[], show_progress=False)
    tok.train_from_iterator(text.splitlines(keepends=True), trainer)
    tok.add_special_tokens([AddedToken(EOS, special=True, normalized=False)])
    return tok


def padded(n):
    return (n + PAD_MULTIPLE - 1) // PAD_MULTIPLE * PAD_MULTIPLE


# ---------------------------------------------------------------- cases


def cases(vocab, eos):
    """name -> (model class, config, facts recorded in reference.json)."""
    common = dict(vocab_size=vocab, bos_token_id=eos, eos_token_id=eos, initializer_range=INIT_RANGE)
    gpt2 = dict(common, n_embd=32, n_layer=2, n_head=4, n_positions=64, n_inner=96, layer_norm_epsilon=1e-4,
                activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    llama = dict(common, hidden_size=32, num_attention_heads=4, intermediate_size=64, num_hidden_layers=2,
                 rms_norm_eps=1e-5, attention_dropout=0.0)
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}
    return {
        "gpt2-tied": (GPT2LMHeadModel, GPT2Config(**gpt2, tie_word_embeddings=True),
                      "GPT-2, n_inner 96 (not 4*n_embd), layer_norm_epsilon 1e-4, gelu_new, tied head"),
        "gpt2-untied": (GPT2LMHeadModel, GPT2Config(**gpt2, tie_word_embeddings=False),
                        "gpt2-tied's shape with its own lm_head.weight"),
        "llama-gqa-llama3": (LlamaForCausalLM, LlamaConfig(
            **llama, num_key_value_heads=2, head_dim=16, rope_theta=10000.0, rope_scaling=llama3,
            max_position_embeddings=256, tie_word_embeddings=False),
            "LLaMA, GQA 4 heads / 2 kv heads, explicit head_dim 16 != 32/4, llama3 rope scaling, untied"),
        "llama-tied": (LlamaForCausalLM, LlamaConfig(
            **llama, num_key_value_heads=4, rope_theta=100000.0, max_position_embeddings=128,
            tie_word_embeddings=True), "LLaMA, MHA, rope_theta 1e5, no scaling, tied (SmolLM-like)"),
        "qwen2-bias": (Qwen2ForCausalLM, Qwen2Config(
            **llama, num_key_value_heads=2, rope_theta=1000000.0, max_position_embeddings=128,
            tie_word_embeddings=True, use_sliding_window=False),
            "Qwen2, GQA 4/2, non-zero q/k/v biases (o_proj has none), rope_theta 1e6, tied"),
        "mistral-window": (MistralForCausalLM, MistralConfig(
            **llama, num_key_value_heads=2, head_dim=8, rope_theta=1000000.0, sliding_window=32,
            max_position_embeddings=128, tie_word_embeddings=False),
            f"Mistral, GQA 4/2, sliding_window 32 > batch length {SEQ}, < max_position_embeddings 128"),
    }


# Cases whose config.json is rewritten into the pre-5.0 layout (rope_theta/rope_scaling at the top
# level, as most files on the hub still have it); the others keep `rope_parameters` as written.
LEGACY_ROPE = ("llama-gqa-llama3", "mistral-window")


def build(cls, config, seed):
    """The model's own init (seeded), then every bias random and every 1-D gain near but not at 1,
    so a dropped bias, a wrong norm or a transposed weight changes the loss."""
    torch.manual_seed(seed)
    config._attn_implementation = "eager"
    model = cls(config).float()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif p.ndim == 1:
                p.copy_(1.0 + (torch.rand(p.shape, generator=g) - 0.5) * 0.6)
    return model


def legacy_rope_layout(path):
    """Rewrite config.json's rope_parameters into top-level rope_theta (+ rope_scaling)."""
    cfg = json.loads(path.read_text())
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    if rope.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = rope
    path.write_text(json.dumps(dict(sorted(cfg.items())), indent=2) + "\n")


def file_keys(path):
    with safe_open(str(path), "pt") as f:
        return set(f.keys())


def loss_of(model, ids):
    return model(input_ids=ids, labels=ids).loss


def gradients(model, ids, names_in_file):
    """The loss's gradient per parameter (tied matrices once, under the name in the file)."""
    model.zero_grad(set_to_none=True)
    loss = loss_of(model, ids)
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        if name not in names_in_file:
            raise SystemExit(f"parameter {name} is not in model.safetensors ({sorted(names_in_file)[:4]}...)")
        grads[name] = p.grad.detach().clone().contiguous()
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def adamw_steps(model, ids, steps=3):
    """torch.optim.AdamW with decay on ndim >= 2 only, constant LR, clip before each step."""
    model = copy.deepcopy(model)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": ADAMW["weight_decay"]},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=ADAMW["lr"], betas=tuple(ADAMW["betas"]), eps=ADAMW["eps"],
                            foreach=False)
    losses, norms = [], []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model, ids)
        loss.backward()
        losses.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(params, ADAMW["clip"]).item())
        opt.step()
    with torch.no_grad():
        losses.append(loss_of(model, ids).item())
    return {**ADAMW, "decay_rule": "weight decay on parameters with ndim >= 2 (matrices, embeddings); none on "
            "biases and norm gains; two param groups", "warmup": 0, "schedule": "constant",
            "optimizer": "torch.optim.AdamW(foreach=False), clip_grad_norm_ before each step, same batch each step",
            "losses": losses, "grad_norms": norms}


def bf16_losses(model, ids):
    with torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            auto = loss_of(model, ids).float().item()
        whole = loss_of(copy.deepcopy(model).to(torch.bfloat16), ids).float().item()
    return {"autocast": auto, "model_bf16": whole,
            "note": "autocast: f32 weights, torch.autocast('cpu', bfloat16); model_bf16: model.to(bfloat16). "
                    "Both: transformers upcasts the logits to f32 for the loss."}


def eval_ppl(model, ids, seq_len=SEQ):
    """Consecutive non-overlapping windows of seq_len (a last one of >= 2 tokens counts too)."""
    total, count, windows = 0.0, 0, 0
    with torch.no_grad():
        for start in range(0, len(ids), seq_len):
            w = ids[start:start + seq_len]
            if len(w) < 2:
                continue
            x = torch.tensor([w])
            total += float(loss_of(model, x).double()) * (len(w) - 1)
            count += len(w) - 1
            windows += 1
    nll = total / count
    return {"file": "../eval.txt", "seq_len": seq_len, "windows": windows, "tokens": count, "nll": nll,
            "ppl": math.exp(nll), "ids": ids}


def rope_facts(config):
    """Which llama3 regime each rotary frequency falls in (transformers' boundaries)."""
    rp = getattr(config, "rope_parameters", None) or {}
    if rp.get("rope_type") != "llama3":
        return None
    dim = config.head_dim
    old = rp["original_max_position_embeddings"]
    high, low = old / rp["high_freq_factor"], old / rp["low_freq_factor"]
    out = []
    for i in range(dim // 2):
        wl = 2 * math.pi * rp["rope_theta"] ** (2 * i / dim)
        regime = "keep" if wl < high else "divide by factor" if wl > low else "interpolate"
        out.append({"index": i, "wavelength": wl, "regime": regime})
    return {"high_freq_wavelen": high, "low_freq_wavelen": low, "frequencies": out,
            "all_three_regimes": len({f["regime"] for f in out}) == 3}


def write_case(out, name, cls, config, about, tok, seed, eval_ids, batch):
    d = out / name
    if d.exists():
        shutil.rmtree(d)
    model = build(cls, config, seed)
    model.save_pretrained(d, safe_serialization=True)
    shutil.copy(out / "tokenizer.json", d / "tokenizer.json")
    layout = "rope_parameters (as transformers writes it)" if hasattr(config, "rope_parameters") else "no rope"
    if name in LEGACY_ROPE:
        legacy_rope_layout(d / "config.json")
        layout = "legacy: rope_theta (and rope_scaling) at the top level, hand-edited from rope_parameters"
    keys = file_keys(d / "model.safetensors")
    ids = torch.tensor(batch)
    model.train()
    loss, grads = gradients(model, ids, keys)
    save_file(grads, str(d / "grads.safetensors"), metadata={"format": "pt"})
    tied = bool(config.tie_word_embeddings)
    if tied and "lm_head.weight" in keys:
        raise SystemExit(f"{d}: a tied model saved lm_head.weight")
    ref = {
        "case": name, "about": about, "versions": versions(),
        "settings": {"device": "cpu", "dtype": "float32", "threads": 1, "deterministic_algorithms": True,
                     "attn_implementation": "eager", "seed": seed},
        "config_layout": layout,
        "rope_llama3": rope_facts(config),
        "tokenizer": {"file": "tokenizer.json", "size": tok.get_vocab_size(), "eos": EOS,
                      "eos_id": tok.token_to_id(EOS), "model_vocab_size": config.vocab_size},
        "parameters": sum(p.numel() for p in model.parameters()),
        "tied": tied, "tensors_in_file": sorted(keys),
        "batch": {"text": BATCH_TEXT, "input_ids": batch, "labels": batch,
                  "note": "labels = input_ids; transformers shifts, so the loss averages B*(T-1) predictions"},
        "loss": loss,
        "grads": {"file": "grads.safetensors", "count": len(grads),
                  "global_norm": math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))},
        "adamw": adamw_steps(model, ids),
        "bf16": bf16_losses(model, ids),
    }
    model.eval()
    ref["eval"] = eval_ppl(model, eval_ids)
    ref["mistakes"] = extra.mistakes(name, model, ids, loss)
    dump_json(ref, d / "reference.json")
    return model, ref


def verify_case(out, name, ref):
    """Load the directory back with from_pretrained and recompute the loss."""
    d = out / name
    m = AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager", dtype=torch.float32)
    m.eval()
    with torch.no_grad():
        loss = loss_of(m, torch.tensor(ref["batch"]["input_ids"])).item()
    if loss != ref["loss"]:
        raise SystemExit(f"{d}: reloaded loss {loss!r} != {ref['loss']!r}")
    return m


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=FIXTURES, help="fixture directory (default: %(default)s)")
    ap.add_argument("--shapes", type=Path, default=SHAPES, help="where the real-shape config.json files go")
    ap.add_argument("--big", type=Path, help="also write random gpt2-small and smollm-135m checkpoints here")
    args = ap.parse_args()
    setup()
    if args.big:
        args.big.mkdir(parents=True, exist_ok=True)
        extra.write_big(args.big, ROOT / "assets/corpus.txt", train_tokenizer, EOS)
        return 0
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    for f in ("eval.txt", "tokenizer-train.txt"):
        if not (out / f).exists():
            shutil.copy(FIXTURES / f, out / f)
    tok = train_tokenizer((out / "tokenizer-train.txt").read_text(), TOKENIZER_BPE)
    tok.save(str(out / "tokenizer.json"))
    eos = tok.token_to_id(EOS)
    vocab = padded(tok.get_vocab_size())
    ids = tok.encode(BATCH_TEXT, add_special_tokens=False).ids
    if len(ids) < ROWS * SEQ:
        raise SystemExit(f"BATCH_TEXT gives {len(ids)} tokens, need {ROWS * SEQ}")
    batch = [ids[r * SEQ:(r + 1) * SEQ] for r in range(ROWS)]
    eval_ids = tok.encode((out / "eval.txt").read_text(), add_special_tokens=False).ids
    built = {}
    for seed, (name, (cls, config, about)) in enumerate(cases(vocab, eos).items()):
        model, ref = write_case(out, name, cls, config, about, tok, 1000 + seed, eval_ids, batch)
        verify_case(out, name, ref)
        built[name] = (model, ref)
        print(f"{name:18} loss {ref['loss']:.6f}  eval ppl {ref['eval']['ppl']:.4f}  "
              f"params {ref['parameters']}  ({ref['config_layout'].split(':')[0]})")
    extra.gpt2_hub_layout(out, "gpt2-tied", "gpt2-hub-layout", dump_json, versions())
    print("gpt2-hub-layout    loads with gpt2-tied's loss")
    extra.check_legacy_layouts(out, LEGACY_ROPE, built, loss_of)
    extra.write_ops(out, built["llama-gqa-llama3"][0].config, dump_json, versions())
    for name in ("llama-gqa-llama3", "gpt2-tied"):
        for rslora in (False, True):
            r = extra.write_lora(out / name, name, batch, rslora, dump_json, versions(), adamw_steps, ADAMW)
            print(f"{name}/{'lora-rslora' if rslora else 'lora'}: loss {r['loss']:.6f}")
    extra.write_shapes(args.shapes)
    print(f"tokenizer: {tok.get_vocab_size()} tokens, {EOS} id {eos}, model vocab {vocab}; wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
