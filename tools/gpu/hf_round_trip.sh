#!/usr/bin/env bash
# On the GPU machine, from the repository root, with .gpu.tar.xz (tools/gpu/make_bundle.sh)
# carried: issue 33's round trip with the machine's own transformers. train_cuda trains the
# tiny config 3 steps on the GPU (BF16, checkpoint at the end), export_hf writes the HF
# directory and gdr's reference logits, and tools/hf/check_export.py loads it with
# Qwen3_5ForCausalLM.from_pretrained and compares the logits. Results under $OUT.
set -uo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bundle_env.sh"
W=/tmp/gdr_hf_round_trip
rm -rf "$W"
(cd "$G/tools/train_cuda" && ./train_cuda --config=configs/train_tiny.yaml --set=train.device=cuda \
  --set=train.dtype=bf16 --set=train.steps=3 --set=train.checkpoint_dir="$W/ckpt") \
  >"$OUT/hf_round_trip.log" 2>&1 || { tail -5 "$OUT/hf_round_trip.log"; exit 1; }
tail -2 "$OUT/hf_round_trip.log"
"$G/tools/export_hf/export_hf" --checkpoint="$W/ckpt" --output="$W/hf" \
  --reference_logits="$W/reference.safetensors" 2>&1 | tee -a "$OUT/hf_round_trip.log"
python3 tools/hf/check_export.py --model="$W/hf" --reference="$W/reference.safetensors" 2>&1 |
  grep -v "falling back\|Loading weights" | tee -a "$OUT/hf_round_trip.log"
