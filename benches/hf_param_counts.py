#!/usr/bin/env python3
"""Parameter counts of every config.json under tests/fixtures/hf/, as `transformers` builds them.

For each fixture the model is built from its config on PyTorch's meta device (no weights are
allocated or downloaded) and its parameters counted, each shared (tied) tensor once. For the
mixture-of-experts families it also counts the parameters one token is multiplied by ("active":
every expert but the `num_experts_per_tok` routed ones left out). With `--lora` it wraps each
dense model in PEFT's LoRA (rank 16, the projections `gaccwb estimate --lora-rank 16` targets by
default) and counts the adapter parameters. The mixtures are left out there: `transformers` 5
keeps a layer's experts as two 3-D tensors, not as linear modules, so PEFT's `target_modules`
no longer reach them the way the planner counts (one adapter per expert's projection, the
`transformers` 4 layout).

The planner's own counts are held against these figures in the engine's tests
(`crates/engine/src/hf/` and tests/cli/planner_cli.rs); rerun this after adding a fixture.

Usage: PYTHONPATH=DIR_WITH_TORCH_TRANSFORMERS_PEFT python3 benches/hf_param_counts.py [--lora]
"""

import argparse
import glob
import json
import os
import warnings

warnings.filterwarnings("ignore")
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "hf")

# The default LoRA targets of `gaccwb estimate`: every projection of the blocks (attention and
# MLP, each expert's and the shared expert's), by each family's module names; not the router,
# the embeddings or the head.
TARGETS = {
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "gpt_neox": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    "mixtral": ["q_proj", "k_proj", "v_proj", "o_proj", "w1", "w2", "w3"],
}
DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def config_of(path):
    with open(path, encoding="utf-8-sig") as f:
        d = json.load(f)
    d = d.get("text_config", d) if "text_config" in d and "model_type" not in d else d
    model_type = d.pop("model_type")
    return AutoConfig.for_model(model_type, **d)


def count(model):
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def routed_out(cfg):
    """Parameters of the experts a token does not visit, over all layers."""
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if not experts:
        return 0
    k = cfg.num_experts_per_tok
    f = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    dense = set(getattr(cfg, "mlp_only_layers", []) or [])
    moe_layers = [
        i for i in range(cfg.num_hidden_layers) if i not in dense and (i + 1) % step == 0
    ]
    return len(moe_layers) * (experts - k) * 3 * cfg.hidden_size * f


def lora_count(model, model_type):
    import peft

    cfg = peft.LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS.get(model_type, DEFAULT_TARGETS))
    wrapped = peft.get_peft_model(model, cfg)
    return sum(p.numel() for p in wrapped.parameters() if p.requires_grad)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lora", action="store_true", help="also count rank-16 LoRA adapters (needs peft)")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    rows = {}
    for path in sorted(glob.glob(os.path.join(FIXTURES, "*.json"))):
        name = os.path.basename(path)
        cfg = config_of(path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
        total = count(model)
        row = {"model_type": cfg.model_type, "params": total, "active": total - routed_out(cfg)}
        if args.lora and routed_out(cfg) == 0:
            row["lora_r16"] = lora_count(model, cfg.model_type)
        rows[name] = row
        print(f"{name:24} {cfg.model_type:10} {total:>16,} active {row['active']:>16,}"
              + (f" lora r=16 {row['lora_r16']:>12,}" if "lora_r16" in row else ""))
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
