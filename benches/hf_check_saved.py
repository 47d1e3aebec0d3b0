#!/usr/bin/env python3
"""Load a model directory (and optionally a PEFT adapter) in transformers and print one batch's loss.

Checks that a model or adapter gaccwb saved loads in transformers/peft and gives the loss gaccwb
gives. The model: AutoModelForCausalLM.from_pretrained(DIR) in float32 on the CPU with eager
attention; the adapter: peft.PeftModel.from_pretrained(model, ADIR). The batch file is JSON with
`input_ids` (a list of equal-length lists of token ids) and optionally `labels` (default: the
input_ids; transformers shifts them), either at the top level or under `batch` (so a fixture's
reference.json works as is). Prints {"loss": L} (full precision) on stdout.

Usage:
  PYTHONPATH=~/.cache/gaccwb-hf python3 benches/hf_check_saved.py DIR [--adapter ADIR] --batch FILE.json
      [--expect LOSS [--rtol 1e-5]]     # exit 1 when |loss - LOSS| > rtol * |LOSS|
Install outside the repo:
  pip install --target ~/.cache/gaccwb-hf torch transformers peft tokenizers safetensors
Example (a committed fixture against its own reference):
  benches/hf_check_saved.py tests/fixtures/hf/models/gpt2-tied --adapter tests/fixtures/hf/models/gpt2-tied/lora \\
      --batch tests/fixtures/hf/models/gpt2-tied/lora/reference.json
Exit status: 0 ok, 1 loss differs from --expect, 2 bad input (one line on stderr naming the file).
"""

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
warnings.filterwarnings("ignore")


def fail(msg):
    print(f"hf_check_saved: {msg}", file=sys.stderr)
    sys.exit(2)


def read_batch(path):
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        fail(f"{path}: cannot read JSON ({e})")
    batch = doc.get("batch", doc) if isinstance(doc, dict) else None
    ids = batch.get("input_ids") if isinstance(batch, dict) else None
    if not (isinstance(ids, list) and ids and all(isinstance(r, list) and r for r in ids)):
        fail(f"{path}: needs \"input_ids\": a non-empty list of lists of token ids (top level or under \"batch\")")
    if len({len(r) for r in ids}) != 1:
        fail(f"{path}: input_ids rows differ in length; give rows of one length")
    return ids, batch.get("labels", ids)


def check_adapter_keys(model, adapter):
    """Every LoRA tensor the model expects is in the file and nothing else is (peft only warns)."""
    from peft import get_peft_model_state_dict
    from safetensors import safe_open

    path = adapter / "adapter_model.safetensors"
    with safe_open(str(path), "pt") as f:
        saved = set(f.keys())
    wanted = set(get_peft_model_state_dict(model))
    if saved != wanted:
        fail(f"{path}: missing {sorted(wanted - saved)[:3]}, unexpected {sorted(saved - wanted)[:3]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path, help="directory with config.json and model.safetensors")
    ap.add_argument("--adapter", type=Path,
                    help="PEFT adapter directory (adapter_config.json, adapter_model.safetensors)")
    ap.add_argument("--batch", type=Path, required=True, help="JSON file with input_ids (and labels)")
    ap.add_argument("--expect", type=float, help="the loss to compare with")
    ap.add_argument("--rtol", type=float, default=1e-5, help="relative tolerance for --expect (default 1e-5)")
    args = ap.parse_args()
    ids, labels = read_batch(args.batch)
    if not (args.model / "config.json").is_file():
        fail(f"{args.model}: no config.json; give a model directory saved in Hugging Face's layout")
    if args.adapter and not (args.adapter / "adapter_config.json").is_file():
        fail(f"{args.adapter}: no adapter_config.json; give a PEFT adapter directory")

    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(1)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            args.model, attn_implementation="eager", dtype=torch.float32, output_loading_info=True)
        if args.adapter:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, args.adapter)
    except Exception as e:  # noqa: BLE001 - any load failure is the answer this script exists to give
        fail(f"{args.adapter or args.model}: transformers/peft cannot load it: {type(e).__name__}: {e}")
    # transformers fills a missing tensor with fresh random values and only warns: refuse instead.
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        if info.get(kind):
            fail(f"{args.model}/model.safetensors: {kind.replace('_', ' ')}: {sorted(map(str, info[kind]))[:5]}")
    if args.adapter:
        check_adapter_keys(model, args.adapter)
    vocab = model.config.vocab_size if not args.adapter else model.base_model.model.config.vocab_size
    top = max(max(r) for r in ids)
    if top >= vocab:
        fail(f"{args.batch}: token id {top} >= the model's vocab_size {vocab}")
    model.eval()
    with torch.no_grad():
        loss = model(input_ids=torch.tensor(ids), labels=torch.tensor(labels)).loss.item()
    print(json.dumps({"loss": loss}))
    if args.expect is not None and abs(loss - args.expect) > args.rtol * abs(args.expect):
        print(f"hf_check_saved: loss {loss!r} differs from the expected {args.expect!r} "
              f"by more than {args.rtol} relative", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
