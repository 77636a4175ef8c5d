#!/usr/bin/env python3
"""Loads a model written by //tools:export_hf with transformers and compares its logits on
gdr's reference batch (export_hf --reference_logits=FILE) with gdr's.

    python3 tools/hf/check_export.py --model=runs/tiny/hf --reference=runs/tiny/ref.safetensors

Needs torch, transformers >= 5 (Qwen3_5ForCausalLM) and safetensors; runs on the CPU in FP32
(weights upcast from the stored dtype, as gdr's reference logits were computed). Prints the
max absolute logit difference and the largest logit magnitude; exits 1 when the difference
exceeds --tolerance (default 1e-3: both sides compute in FP32 with different summation
orders, so a correct export differs by FP32 rounding, ~1e-6 relative to the logits).
"""
import argparse
import sys

import torch
from safetensors.torch import load_file
from transformers import Qwen3_5ForCausalLM


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the export_hf output directory")
    parser.add_argument("--reference", required=True, help="export_hf --reference_logits file")
    parser.add_argument("--tolerance", type=float, default=1e-3)
    args = parser.parse_args()

    reference = load_file(args.reference)
    ids, gdr_logits = reference["input_ids"], reference["logits"]
    model = Qwen3_5ForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        hf_logits = model(input_ids=ids).logits.float()
    if hf_logits.shape != gdr_logits.shape:
        print(f"check_export: logits shape {tuple(hf_logits.shape)} (transformers) vs "
              f"{tuple(gdr_logits.shape)} (gdr)", file=sys.stderr)
        return 1
    diff = (hf_logits - gdr_logits).abs().max().item()
    scale = gdr_logits.abs().max().item()
    ok = diff <= args.tolerance
    print(f"transformers {__import__('transformers').__version__} {type(model).__name__} from "
          f"{args.model}: input {tuple(ids.shape)}, max |logits transformers - gdr| = "
          f"{diff:.3e} (max |logit| {scale:.3e}, tolerance {args.tolerance:g}): "
          f"{'OK' if ok else 'MISMATCH'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
