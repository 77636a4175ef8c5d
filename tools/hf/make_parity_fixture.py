#!/usr/bin/env python3
"""Makes the Hugging Face parity fixture of //tests/models:hf_parity_test.

A small random Qwen3.5 text model (two Gated DeltaNet and two gated-attention layers,
Hv > Hk, partial RoPE, tied embeddings, every norm, A_log, dt_bias and the conv filter
drawn off their defaults) and what transformers computes for it on one fixed batch:
logits, the causal-LM loss (labels = input_ids) and the gradient of every parameter, in
FP64. The same model run by transformers in FP32 gives transformers' own FP32 error
against that FP64 reference, per tensor; the C++ test derives gdr's FP32 tolerances from
it (Note [HF parity tolerances] in tests/models/hf_parity_test.cc).

Run with transformers on the CPU (CI machines do not have it; the output is committed):

    /work/pyenv/bin/python tools/hf/make_parity_fixture.py [--out tests/data/hf_parity]

Writes into --out:
  config.json          the transformers config (model_type qwen3_5_text)
  model.safetensors    the weights in FP64 under HF's names (no lm_head.weight: tied)
  reference.safetensors
      input_ids [B, T] int64; logits [B, T, V], loss [1] and grad.<name> for every
      parameter, FP64; hf_fp32_error.<name> / hf_fp32_error.logits / hf_fp32_error.loss
      [2] FP64 = (max |transformers FP32 - reference|, max |reference|)
  errors.json          the same error figures, readable, plus the ones of transformers'
                       stock code run in FP64 (see "FP64 reference" below) and, per head,
                       how ill-conditioned the sums behind the A_log and dt_bias gradients
                       are (sum |terms| / |sum|) with transformers' FP32 relative error

FP64 reference: transformers' Qwen3.5 code casts to FP32 in several places (the rotary
tables, RMSNorm, the gate, the GDR core, the attention softmax, the loss), so a model
merely moved to FP64 still computes those in FP32. The reference therefore runs a copy of
transformers' modeling_qwen3_5.py in which every cast to FP32 is a cast to FP64 (a text
substitution, checked below), and computes the loss with the formula transformers uses
(mean cross-entropy of logits[:, :-1] against input_ids[:, 1:]) in FP64. Everything else is
transformers' own code: the torch fallback of the chunked gated delta rule (no fla), the
causal conv1d fallback and the eager attention.
"""

import argparse
import importlib.util
import json
import math
import os
import re
import sys
import types

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

import transformers
import transformers.models.qwen3_5.modeling_qwen3_5 as hf_modeling
from transformers import Qwen3_5TextConfig

SEED = 20240533
BATCH, TOKENS = 2, 100  # T > 64: the GDR core runs two chunks, the second one padded


def make_config():
    return Qwen3_5TextConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        # Not the full_attention_interval pattern (L L L F), so a loader that ignored
        # layer_types would build another model.
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,  # Hv > Hk: each key head serves two value heads
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        rms_norm_eps=1e-6,
        # rotary dim 8 of head_dim 32; theta 1e4 so that all four frequencies turn visibly
        # over T tokens (1e7, Qwen3.5's, leaves the last ones nearly still).
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
        tie_word_embeddings=True,
        hidden_act="silu",
        max_position_embeddings=4096,
        attn_output_gate=True,
    )


def fp64_modeling_module():
    """transformers' modeling_qwen3_5 with every FP32 cast made an FP64 cast."""
    with open(hf_modeling.__file__, encoding="utf-8") as f:
        source = f.read()
    substitutions = [
        (r"\.float\(\)", ".double()"),
        (r"torch\.float32\b", "torch.float64"),
        (r"torch\.float\b(?!\d)", "torch.float64"),
    ]
    for pattern, replacement in substitutions:
        source, count = re.subn(pattern, replacement, source)
        if count == 0:
            sys.exit(f"make_parity_fixture: no '{pattern}' in {hf_modeling.__file__}; "
                     "transformers changed, review the FP64 substitution")
    leftover = re.findall(r"\.float\(|float32|torch\.float\b(?!\d)|\.half\(|bfloat16", source)
    if leftover:
        sys.exit(f"make_parity_fixture: casts left after the FP64 substitution: {leftover}")
    name = "transformers.models.qwen3_5._modeling_qwen3_5_fp64"
    module = types.ModuleType(name)
    module.__package__ = "transformers.models.qwen3_5"
    module.__file__ = hf_modeling.__file__
    sys.modules[name] = module
    exec(compile(source, hf_modeling.__file__ + " (FP64 casts)", "exec"), module.__dict__)
    return module


def init_weights(model, generator):
    """Every parameter drawn in FP64 from `generator`, in named_parameters() order, off
    transformers' defaults (zero norms, dt_bias 1, gated norm 1, log U(0.01, 16) A_log)."""

    def normal(shape, std, mean=0.0):
        return torch.randn(shape, generator=generator, dtype=torch.float64) * std + mean

    def uniform(shape, low, high):
        return torch.rand(shape, generator=generator, dtype=torch.float64) * (high - low) + low

    with torch.no_grad():
        for name, p in model.named_parameters():
            shape = p.shape
            if name.endswith("linear_attn.A_log"):
                # Decays of 0.02 .. 0.4 per token at a + dt_bias = 0: the state carries
                # across the 64-token chunk boundary.
                value = uniform(shape, 0.05, 0.6).log()
            elif name.endswith("linear_attn.dt_bias"):
                value = normal(shape, 0.5, mean=-0.5)
            elif name.endswith("linear_attn.norm.weight"):
                value = normal(shape, 0.2, mean=1.0)
            elif name.endswith("linear_attn.conv1d.weight"):
                value = uniform(shape, -0.6, 0.6)
            elif name.endswith("norm.weight"):  # the zero-centred norms: (1 + w)
                value = normal(shape, 0.2)
            elif name == "model.embed_tokens.weight":
                value = normal(shape, 0.15)
            elif p.dim() == 2:  # the projections: unit-ish activations
                value = normal(shape, 0.8 / math.sqrt(shape[1]))
            else:
                sys.exit(f"make_parity_fixture: no init rule for {name} {tuple(shape)}")
            p.copy_(value.to(p.dtype))


def causal_lm_loss(logits, input_ids):
    """transformers' ForCausalLMLoss with labels = input_ids and no ignored label, in the
    logits' dtype (transformers itself casts the logits to FP32 first)."""
    vocab = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1].reshape(-1, vocab), input_ids[:, 1:].reshape(-1))


def run(model, input_ids):
    """(logits, loss, {name: grad}) of one forward and backward."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=input_ids).logits
    loss = causal_lm_loss(logits, input_ids)
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return logits.detach(), loss.detach(), grads


class GateTerms:
    """Records, during one FP64 run, the per-token terms whose per-head sums are the gate's
    parameter gradients: d loss / d A_log[h] = sum over (b, t) of dL/dg * g = dL/dsp * sp
    (sp = softplus(a + dt_bias), g = -exp(A_log) sp) and d loss / d dt_bias[h] = sum of
    dL/da. Wraps the FP64 module's softplus (the gate's only one) and hooks in_proj_a."""

    def __init__(self, module, model):
        self.softplus_outputs, self.a_outputs, self.layers = [], [], []
        real_functional = module.F
        recorder = self

        class Functional:
            def __getattr__(self, name):
                return getattr(real_functional, name)

            def softplus(self, x, *args, **kwargs):
                y = real_functional.softplus(x, *args, **kwargs)
                y.retain_grad()
                recorder.softplus_outputs.append(y)
                return y

        module.F = Functional()
        for i, layer in enumerate(model.model.layers):
            if hasattr(layer, "linear_attn"):
                self.layers.append(i)
                layer.linear_attn.in_proj_a.register_forward_hook(self._keep_a)

    def _keep_a(self, module, inputs, output):
        output.retain_grad()
        self.a_outputs.append(output)

    def conditioning(self, grads, fp32_grads):
        """Per layer and head: the sum, sum |terms| / |sum| and transformers' FP32 relative
        error, for A_log and dt_bias."""
        out = {}
        for k, layer in enumerate(self.layers):
            sp, a = self.softplus_outputs[k], self.a_outputs[k]
            for param, terms in (("A_log", sp.grad * sp), ("dt_bias", a.grad)):
                name = f"model.layers.{layer}.linear_attn.{param}"
                terms = terms.reshape(-1, terms.shape[-1])
                total = terms.sum(0)
                assert torch.allclose(total, grads[name], rtol=1e-12, atol=0), name
                out[name] = {
                    "gradient": total.tolist(),
                    "sum_abs_terms_over_abs_sum": (terms.abs().sum(0) / total.abs()).tolist(),
                    "hf_fp32_relative_error":
                        ((fp32_grads[name].double() - total).abs() / total.abs()).tolist(),
                }
        return out


def max_abs(t):
    return t.abs().max().item()


def error_of(got, ref):
    """(max |got - ref|, max |ref|) in FP64."""
    return (max_abs(got.double() - ref), max_abs(ref))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="tests/data/hf_parity", help="output directory")
    args = parser.parse_args()
    torch.manual_seed(SEED)
    torch.use_deterministic_algorithms(True)
    for package in ("fla", "causal_conv1d"):  # their kernels would replace the torch path
        if importlib.util.find_spec(package) is not None:
            sys.exit(f"make_parity_fixture: run in an environment without {package}: the "
                     "reference is transformers' torch implementation")

    config = make_config()
    config._attn_implementation = "eager"
    fp64 = fp64_modeling_module()

    # The FP64 reference.
    ref_model = fp64.Qwen3_5ForCausalLM(config).to(torch.float64)
    ref_model.train()
    generator = torch.Generator().manual_seed(SEED)
    init_weights(ref_model, generator)
    assert ref_model.lm_head.weight is ref_model.model.embed_tokens.weight, "expected tied"
    weights = {n: p.detach().clone() for n, p in ref_model.named_parameters()}
    input_ids = torch.randint(0, config.vocab_size, (BATCH, TOKENS), generator=generator)
    gate_terms = GateTerms(fp64, ref_model)
    logits, loss, grads = run(ref_model, input_ids)

    # The loss formula is transformers' (its own loss, on FP32 logits, agrees to FP32).
    hf_loss = ref_model(input_ids=input_ids, labels=input_ids).loss.item()
    assert abs(hf_loss - loss.item()) < 1e-5 * abs(loss.item()), (hf_loss, loss.item())

    def other_run(model_class, dtype):
        model = model_class(config).to(dtype)
        model.train()
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(weights[n].to(dtype))
        return run(model, input_ids)

    # transformers as it ships, in FP32, and (for the record) in FP64 with its FP32 casts.
    errors, other_grads = {}, {}
    for label, model_class, dtype in [("hf_fp32", transformers.Qwen3_5ForCausalLM, torch.float32),
                                      ("hf_stock_fp64", transformers.Qwen3_5ForCausalLM,
                                       torch.float64)]:
        o_logits, o_loss, o_grads = other_run(model_class, dtype)
        table = {"logits": error_of(o_logits, logits), "loss": error_of(o_loss, loss)}
        for n in grads:
            table["grad." + n] = error_of(o_grads[n], grads[n])
        errors[label] = table
        other_grads[label] = o_grads
    gate_sums = gate_terms.conditioning(grads, other_grads["hf_fp32"])

    os.makedirs(args.out, exist_ok=True)
    config.save_pretrained(args.out)  # config.json
    with open(os.path.join(args.out, "config.json"), encoding="utf-8") as f:
        saved = json.load(f)
    for key, want in [("layer_types", config.layer_types), ("tie_word_embeddings", True),
                      ("linear_num_value_heads", 4)]:
        assert saved.get(key) == want, (key, saved.get(key))
    save_file({n: t.contiguous() for n, t in weights.items()},
              os.path.join(args.out, "model.safetensors"), metadata={"format": "pt"})
    reference = {"input_ids": input_ids.contiguous(), "logits": logits.contiguous(),
                 "loss": loss.reshape(1)}
    for n, g in grads.items():
        reference["grad." + n] = g.contiguous()
    for key, (err, scale) in errors["hf_fp32"].items():
        name = key[len("grad."):] if key.startswith("grad.") else key
        reference["hf_fp32_error." + name] = torch.tensor([err, scale], dtype=torch.float64)
    # One metadata key: safetensors writes several in no fixed order, and the files must be
    # byte-for-byte reproducible (the versions are in errors.json).
    save_file(reference, os.path.join(args.out, "reference.safetensors"),
              metadata={"generator": "tools/hf/make_parity_fixture.py"})
    summary = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "seed": SEED,
        "batch": [BATCH, TOKENS],
        "loss": loss.item(),
        "columns": ["max |x - reference|", "max |reference|"],
    }
    summary.update(errors)
    summary["gate_parameter_gradients"] = gate_sums
    with open(os.path.join(args.out, "errors.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1)
        f.write("\n")

    print(f"loss {loss.item():.17g}; wrote {args.out}")
    print(f"{'tensor':48s} {'hf fp32 abs':>11s} {'rel':>9s} {'stock fp64':>11s} {'max|ref|':>9s}")
    for key, (err, scale) in errors["hf_fp32"].items():
        stock = errors["hf_stock_fp64"][key][0]
        print(f"{key:48s} {err:11.3e} {err / scale:9.2e} {stock:11.3e} {scale:9.3e}")
    print("gate parameter gradients: per head sum|terms| / |sum| and transformers' FP32 "
          "relative error")
    for name, row in gate_sums.items():
        cond = " ".join(f"{c:7.1f}" for c in row["sum_abs_terms_over_abs_sum"])
        rel = " ".join(f"{r:8.1e}" for r in row["hf_fp32_relative_error"])
        print(f"  {name:42s} {cond} | {rel}")


if __name__ == "__main__":
    main()
