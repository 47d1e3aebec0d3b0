"""The parts of benches/hf_parity.py beyond the per-case figures: the loss under deliberate
mistakes, the hub-layout GPT-2 copy, op-level figures (ops.json), PEFT adapters, the real-shape
configs and the large random checkpoints. Imported by hf_parity.py; see its docstring for usage."""

import copy
import json
import math
import shutil
import sys

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

LORA = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0}
LORA_TARGETS = {
    "llama-gqa-llama3": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "gpt2-tied": ["c_attn", "c_proj", "c_fc"],
}


def read_tensors(path):
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def loss_of(model, ids):
    return model(input_ids=ids, labels=ids).loss


# ---------------------------------------------------------------- deliberate mistakes


def interleaved_rope(q, k, cos, sin, unsqueeze_dim=1):
    """RoPE on adjacent pairs (2i, 2i+1) instead of HF's half split, same angles."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    half = q.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]

    def rot(x):
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)

    return rot(q), rot(k)


def tiled_kv(x, n_rep):
    """GQA with kv heads tiled (0,1,0,1) instead of repeated in place (0,0,1,1)."""
    return x.repeat(1, n_rep, 1, 1)


def figures(model, ids):
    """The loss and each parameter's gradient (named as model.named_parameters gives them)."""
    model.zero_grad(set_to_none=True)
    loss = loss_of(model, ids)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def mistakes(name, model, ids, loss):
    """The loss and gradients when one known detail is broken on purpose: evidence of what the
    fixture catches at the tests' tolerances (loss 1e-5 relative, each gradient 1e-4 relative L2)."""
    module = sys.modules[type(model).__module__]
    cfg = model.config
    _, good = figures(model, ids)
    out = {}

    def record(key, got):
        value, grads = got
        if value == loss:
            raise SystemExit(f"{name}: mistake {key} left the loss unchanged (patch not applied?)")
        worst = max(float((grads[n] - g).norm() / g.norm()) for n, g in good.items() if g.norm() > 0)
        out[key] = {"loss": value, "loss_relative_change": abs(value - loss) / abs(loss),
                    "largest_gradient_relative_l2_change": worst}

    def patched(attr, fn):
        old = getattr(module, attr)
        setattr(module, attr, fn)
        try:
            return figures(model, ids)
        finally:
            setattr(module, attr, old)

    def with_copy(edit):
        m = copy.deepcopy(model)
        edit(m)
        return figures(m, ids)

    if cfg.model_type == "gpt2":
        def gelu_exact(m):
            for blk in m.transformer.h:
                blk.mlp.act = torch.nn.GELU()
        record("gelu_exact_instead_of_tanh", with_copy(gelu_exact))

        def eps_default(m):
            for mod in m.modules():
                if isinstance(mod, torch.nn.LayerNorm):
                    mod.eps = 1e-5
        record("layer_norm_eps_1e-5_instead_of_config", with_copy(eps_default))

        def transposed(m):
            with torch.no_grad():
                for blk in m.transformer.h:
                    blk.attn.c_proj.weight.copy_(blk.attn.c_proj.weight.t().clone())
        record("attn_c_proj_weight_transposed", with_copy(transposed))
        return out
    record("rope_interleaved_instead_of_half_split", patched("apply_rotary_pos_emb", interleaved_rope))
    if cfg.num_key_value_heads < cfg.num_attention_heads:
        record("kv_heads_tiled_instead_of_repeat_interleave", patched("repeat_kv", tiled_kv))

    def eps_small(m):
        for mod in m.modules():
            if hasattr(mod, "variance_epsilon"):
                mod.variance_epsilon = 1e-6
    record("rms_norm_eps_1e-6_instead_of_config", with_copy(eps_small))
    if cfg.rope_parameters.get("rope_type") == "llama3":
        def unscaled(m):
            rot = m.model.rotary_emb
            inv, _ = rot.compute_default_rope_parameters(m.config)
            rot.inv_freq.copy_(inv)
        record("rope_llama3_scaling_ignored", with_copy(unscaled))
    if cfg.model_type == "qwen2":
        def no_bias(m):
            with torch.no_grad():
                for layer in m.model.layers:
                    for p in ("q_proj", "k_proj", "v_proj"):
                        getattr(layer.self_attn, p).bias.zero_()
        record("qkv_biases_dropped", with_copy(no_bias))
    return out


# ---------------------------------------------------------------- GPT-2 in the hub's layout


def gpt2_hub_layout(out, src, dst, dump_json, versions):
    """src's weights renamed as the hub's GPT-2 files have them (no `transformer.` prefix) plus the
    `h.N.attn.bias` causal-mask buffers those files carry; transformers must load it to src's loss."""
    s, d = out / src, out / dst
    if d.exists():
        shutil.rmtree(d)
    d.mkdir()
    for f in ("config.json", "tokenizer.json"):
        shutil.copy(s / f, d / f)
    cfg = json.loads((s / "config.json").read_text())
    n = cfg["n_positions"]
    tensors = {k.removeprefix("transformer."): v for k, v in read_tensors(s / "model.safetensors").items()}
    for i in range(cfg["n_layer"]):
        tensors[f"h.{i}.attn.bias"] = torch.tril(torch.ones(n, n)).view(1, 1, n, n)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    ref = json.loads((s / "reference.json").read_text())
    m = AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        loss = loss_of(m.eval(), torch.tensor(ref["batch"]["input_ids"])).item()
    if loss != ref["loss"]:
        raise SystemExit(f"{d}: loss {loss!r} != {src}'s {ref['loss']!r}")
    dump_json({
        "case": dst, "versions": versions, "same_weights_as": src,
        "about": f"{src}'s model.safetensors renamed as the hub's GPT-2 files are (no 'transformer.' prefix) "
                 "with the f32 causal-mask buffers h.N.attn.bias [1,1,n_positions,n_positions] they carry; "
                 "transformers ignores those buffers on load. Gradients, AdamW, bf16 and eval: see "
                 f"../{src}/reference.json (names there carry the 'transformer.' prefix).",
        "tensors_in_file": sorted(tensors), "batch": ref["batch"], "loss": loss,
    }, d / "reference.json")


def check_legacy_layouts(out, names, built, loss_of_fn):
    """A hand-edited config.json must give transformers the RoPE parameters the model was built with
    (its loss was already checked against the reference by the reload)."""
    for name in names:
        raw = json.loads((out / name / "config.json").read_text())
        if "rope_parameters" in raw or "rope_theta" not in raw:
            raise SystemExit(f"{out / name}/config.json: not in the legacy RoPE layout")
        loaded = AutoConfig.from_pretrained(out / name).rope_parameters
        want = built[name][0].config.rope_parameters
        if loaded != want:
            raise SystemExit(f"{out / name}: legacy layout reads as {loaded}, built with {want}")


# ---------------------------------------------------------------- op-level figures


def write_ops(out, config, dump_json, versions):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

    g = torch.Generator().manual_seed(4242)
    bf = torch.bfloat16
    eps = 1e-5
    x = (torch.randn(4, 32, generator=g) * 3.0).to(bf)
    w = (1.0 + 0.5 * torch.randn(32, generator=g)).to(bf)
    norm = LlamaRMSNorm(32, eps=eps).to(bf)
    with torch.no_grad():
        norm.weight.copy_(w)
        hf = norm(x)
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        wrong = (w.float() * normed).to(bf)
    if not torch.equal(hf, w * normed.to(bf)):
        raise SystemExit("LlamaRMSNorm no longer casts before the weight: update ops.json's description")
    differ = int((hf != wrong).sum())
    if differ == 0:
        raise SystemExit("rms_norm_bf16: the two cast orders agree on this input; pick another seed")

    inv_scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    inv_plain, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    t, heads, hd = 16, config.num_attention_heads, config.head_dim
    q = torch.randn(1, heads, t, hd, generator=g)
    rot = LlamaRotaryEmbedding(config)
    cos, sin = rot(q, torch.arange(t)[None])
    half, _ = apply_rotary_pos_emb(q, q, cos, sin)
    inter, _ = interleaved_rope(q, q, cos, sin)
    if torch.allclose(half, inter):
        raise SystemExit("rope_apply: the two conventions agree on this input")
    tensors = {"rope.q": q, "rope.half_split": half, "rope.interleaved": inter, "rope.cos": cos[0],
               "rope.sin": sin[0]}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "ops.safetensors"),
              metadata={"format": "pt"})

    def flat(tensor):
        return [float(v) for v in tensor.float().flatten()]

    dump_json({
        "versions": versions,
        "rms_norm_bf16": {
            "about": "LlamaRMSNorm on a bf16 input with a bf16 weight: x to f32, x*rsqrt(mean(x^2)+eps), back to "
                     "bf16, then weight*x in bf16 (`output`). `wrong_order` multiplies the weight in f32 before "
                     "the cast. All values are exact bf16 numbers written as f32, row-major.",
            "shape": [4, 32], "eps": eps, "input": flat(x), "weight": flat(w), "output": flat(hf),
            "wrong_order": flat(wrong), "elements_that_differ": differ,
        },
        "rope_llama3_inv_freq": {
            "about": "inv_freq for ../llama-gqa-llama3's config (head_dim 16, rope_theta 1e4, llama3 factor 8, "
                     "low 1, high 4, original_max_position_embeddings 64), f32",
            "scaled": flat(inv_scaled), "unscaled": flat(inv_plain),
        },
        "rope_apply": {
            "about": "ops.safetensors: rope.q [1,heads,T,head_dim] (random), rope.half_split = HF "
                     "apply_rotary_pos_emb (rotate_half, emb = cat(freqs, freqs)) at positions 0..T-1 with the "
                     "llama3-scaled inv_freq, rope.interleaved = the same angles on adjacent pairs (2i, 2i+1), "
                     "rope.cos / rope.sin [T, head_dim] as HF computes them (f32)",
            "file": "ops.safetensors", "heads": heads, "seq_len": t, "head_dim": hd,
            "tensors": sorted(tensors),
        },
    }, out / "ops.json")


# ---------------------------------------------------------------- PEFT


def peft_model(case_dir, name, rslora):
    from peft import LoraConfig, get_peft_model

    base = AutoModelForCausalLM.from_pretrained(case_dir, attn_implementation="eager", dtype=torch.float32)
    cfg = LoraConfig(**LORA, target_modules=LORA_TARGETS[name], use_rslora=rslora, bias="none",
                     fan_in_fan_out=name.startswith("gpt2"), task_type="CAUSAL_LM")
    torch.manual_seed(77)  # lora_A: PEFT's Kaiming-uniform init
    model = get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(78)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:  # PEFT starts B at zero; random B makes the adapter change the loss
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


def write_lora(case_dir, name, batch, rslora, dump_json, versions, adamw_steps, adamw):
    from peft import PeftModel

    adir = case_dir / ("lora-rslora" if rslora else "lora")
    if adir.exists():
        shutil.rmtree(adir)
    model = peft_model(case_dir, name, rslora)
    model.save_pretrained(adir)
    (adir / "README.md").unlink(missing_ok=True)  # PEFT's empty model card
    acfg_path = adir / "adapter_config.json"
    acfg = json.loads(acfg_path.read_text())
    acfg["base_model_name_or_path"] = name  # not this machine's path; the base is the parent folder
    acfg["target_modules"] = sorted(acfg["target_modules"])  # PEFT writes a set: order varies per run
    acfg_path.write_text(json.dumps(acfg, indent=2, sort_keys=True) + "\n")
    saved = read_tensors(adir / "adapter_model.safetensors")
    ids = torch.tensor(batch)
    model.train()
    model.zero_grad(set_to_none=True)
    loss = loss_of(model, ids)
    loss.backward()
    grads = {}
    for n, p in model.named_parameters():
        if p.requires_grad:
            key = n.replace(".default.", ".")
            if key not in saved:
                raise SystemExit(f"{adir}: trainable {n} saved under no known name")
            grads[key] = p.grad.detach().clone().contiguous()
    if set(grads) != set(saved):
        raise SystemExit(f"{adir}: saved tensors {sorted(set(saved) - set(grads))} have no gradient")
    save_file(grads, str(adir / "grads.safetensors"), metadata={"format": "pt"})
    base_ref = json.loads((case_dir / "reference.json").read_text())
    steps = adamw_steps(model, ids)
    reloaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(case_dir, attn_implementation="eager", dtype=torch.float32), adir)
    with torch.no_grad():
        again = loss_of(reloaded.eval(), ids).item()
    if again != loss.item():
        raise SystemExit(f"{adir}: reloaded adapter gives {again!r}, built {loss.item()!r}")
    scale = LORA["lora_alpha"] / (math.sqrt(LORA["r"]) if rslora else LORA["r"])
    ref = {
        "case": f"{name}/{adir.name}", "versions": versions,
        "base": "..", "lora": {**LORA, "target_modules": LORA_TARGETS[name], "use_rslora": rslora,
                                "scaling": scale, "fan_in_fan_out": name.startswith("gpt2")},
        "about": "PEFT LoraConfig on the parent model, saved by PeftModel.save_pretrained. lora_A: PEFT's "
                 "Kaiming-uniform init (torch seed 77); lora_B: 0.1*randn (seed 78) instead of zeros. Output = "
                 "base(x) + lora_B(lora_A(x)) * scaling. Saved names are the PEFT model's parameter names "
                 "without the adapter name ('.default'). lora-rslora holds the same A and B; only the scaling "
                 "differs (alpha/sqrt(r) instead of alpha/r)."
                 + (" GPT-2: 'c_proj' matches both attn.c_proj and mlp.c_proj; Conv1D weights are [in, out], "
                    "the LoRA matrices are not (A [r, in], B [out, r])." if name.startswith("gpt2") else ""),
        "saved_name_example": sorted(saved)[0],
        "tensors_in_file": {k: list(v.shape) for k, v in sorted(saved.items())},
        "batch": base_ref["batch"], "base_loss": base_ref["loss"], "loss": loss.item(),
        "grads": {"file": "grads.safetensors", "count": len(grads),
                  "note": "gradient of `loss` for every lora_A/lora_B, named as in adapter_model.safetensors"},
        "adamw": steps,
    }
    dump_json(ref, adir / "reference.json")
    return ref


# ---------------------------------------------------------------- real shapes


def shape_configs():
    gpt2 = GPT2Config()
    gpt2.architectures = ["GPT2LMHeadModel"]
    smol = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                       rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=0,
                       eos_token_id=0, initializer_range=0.02)
    smol.architectures = ["LlamaForCausalLM"]
    return {"gpt2-small": (GPT2LMHeadModel, gpt2), "smollm-135m": (LlamaForCausalLM, smol)}


def write_shapes(shapes):
    for name, (_, cfg) in shape_configs().items():
        d = shapes / name
        d.mkdir(parents=True, exist_ok=True)
        cfg.save_pretrained(d)


MARK = "RANDOM-WEIGHTS.txt"


def write_big(root, corpus, train_tokenizer, eos_token):
    """Random checkpoints of the real shapes, for manual runs; never over a directory we did not write."""
    tok = train_tokenizer(corpus.read_text(), 8192)
    eos = tok.token_to_id(eos_token)
    for i, (name, (cls, cfg)) in enumerate(shape_configs().items()):
        d = root / name
        if d.exists() and any(d.iterdir()) and not (d / MARK).exists():
            raise SystemExit(f"{d} exists and was not written by this script; give another --big directory")
        cfg = copy.deepcopy(cfg)
        cfg.bos_token_id = cfg.eos_token_id = eos
        torch.manual_seed(2000 + i)
        model = cls(cfg)
        model.save_pretrained(d, safe_serialization=True)
        tok.save(str(d / "tokenizer.json"))
        (d / MARK).write_text(f"Random weights of {name}'s shape, written by benches/hf_parity.py --big; "
                              f"tokenizer: byte-level BPE of {tok.get_vocab_size()} tokens trained on "
                              f"assets/corpus.txt ({eos_token} = {eos}); model vocab {cfg.vocab_size}.\n")
        n = sum(p.numel() for p in model.parameters())
        print(f"{d}: {n} parameters")
