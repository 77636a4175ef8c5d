# GDN anchor accuracy (issue 31): FLA 0.6.0's chunk_gated_delta_rule (FlashQLA backend, or FLA's
# Triton kernels with FLA_FLASH_QLA=0, as gdn_anchor.py selects them) on the inputs that gdr's
# bench/gdr_core_accuracy wrote, against an FP64 reference computed here, with the keys of
# gdr's `ACCURACY {json}` lines so the two sit in one table.
#   python3 tools/gpu/gdn_anchor_accuracy.py LABEL INPUTS.safetensors [--paths=bf16,fp32]
# LABEL: flashqla or fla (the report's impl name). Needs the anchor wheels on PYTHONPATH
# (../shared/tools/anchor_wheels.sh) and a GPU.
#
# What is compared (the same definition as gdr's core, ops/gdr_core/gdr_core_op.h):
#   q, k <- x * rsqrt(sum(x^2) + 1e-6) per head row (use_qk_l2norm_in_kernel; FLA's l2norm
#   is the same formula), value head h reads key head h // (H / Hk); q <- scale * q;
#   per token: S = exp(g_t) S; u = beta_t (v_t - S^T k_t); S = S + k_t u^T; o_t = S^T q_t,
#   S [dk, dv] per (batch, head) from zeros; the final state is S after the last token.
# Gradients are those of sum(o * d_o) (the final state gets none, as in gdn_anchor.py).
# The reference is that recurrence in FP64 with torch autograd (on the GPU when there is one),
# a form independent of gdr's FP64 reference (the chunked composite) stored in the file: the
# script prints how far the two references are apart (ACCURACY_REF), which should be ~1e-12.
# Paths: bf16 = the stored BF16 q, k, v, beta and FP32 g as gdn_anchor.py passes them; fp32 =
# the same values in FP32 (FlashQLA takes 16-bit only, so FLA would route fp32 to Triton; the
# flashqla run skips it). Each line says which backend FLA dispatched to (its dispatcher's
# record, else whether flash_qla.chunk_gated_delta_rule was called).
import argparse
import json
import os
import sys
import time

import torch


def read_safetensors(path):
    """Tensors and metadata of a safetensors file (the format is small; no extra package)."""
    with open(path, "rb") as f:
        data = f.read()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    metadata = header.pop("__metadata__", {})
    dtypes = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    base = 8 + n
    tensors = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        buf = bytearray(data[base + begin:base + end])
        tensors[name] = torch.frombuffer(buf, dtype=dtypes[entry["dtype"]]).reshape(entry["shape"])
    return tensors, metadata


def l2_normalize(x):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def reference(inputs, scale, device):
    """o, final state and gradients of the plain recurrence in FP64 (autograd)."""
    f64 = torch.float64
    leaves = {n: inputs[n].to(device, f64).requires_grad_() for n in ("q", "k", "v", "g", "beta")}
    q, k, v, g, beta = (leaves[n] for n in ("q", "k", "v", "g", "beta"))
    B, T, Hk, dk = q.shape
    H, dv = v.shape[2], v.shape[3]
    qn, kn = l2_normalize(q), l2_normalize(k)
    if H != Hk:
        qn, kn = qn.repeat_interleave(H // Hk, dim=2), kn.repeat_interleave(H // Hk, dim=2)
    qn = qn * scale
    S = torch.zeros(B, H, dk, dv, dtype=f64, device=device)
    outs = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None, None]
        k_t = kn[:, t]                                            # [B, H, dk]
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k_t, S))
        S = S + k_t[..., :, None] * u[..., None, :]
        outs.append(torch.einsum("bhk,bhkv->bhv", qn[:, t], S))
    o = torch.stack(outs, dim=1)                                  # [B, T, H, dv]
    o.backward(inputs["d_o"].to(device, f64))
    out = {"o": o.detach(), "final_state": S.detach()}
    for n in ("q", "k", "v", "g", "beta"):
        out["d" + n] = leaves[n].grad
    return {n: t.cpu() for n, t in out.items()}


def error_of(x, ref):
    """gdr's error figures (bench/gdr_core_accuracy.h): max |err|, that / max |ref|,
    ||err|| / ||ref||, max |ref|; all in FP64."""
    r = ref.double().cpu()
    d = x.detach().double().cpu() - r
    max_abs_ref = r.abs().max().item()
    max_abs_err = d.abs().max().item()
    ref_norm = r.norm().item()
    return dict(max_abs_err=max_abs_err,
                max_rel_err=max_abs_err / max_abs_ref if max_abs_ref > 0 else max_abs_err,
                rel_l2_err=d.norm().item() / ref_norm if ref_norm > 0 else d.norm().item(),
                max_abs_ref=max_abs_ref)


class CallCounter:
    """Counts calls into flash_qla.chunk_gated_delta_rule (FLA's backend calls it by
    attribute at call time), so the report says which backend FLA dispatched to."""

    def __init__(self):
        self.calls = 0
        try:
            import flash_qla
        except Exception:
            self.module = None
            return
        self.module = flash_qla
        inner = flash_qla.chunk_gated_delta_rule

        def counted(*args, **kwargs):
            self.calls += 1
            return inner(*args, **kwargs)

        flash_qla.chunk_gated_delta_rule = counted


def backends_logged():
    """The backends FLA's dispatcher has used so far for the gated delta rule (it records
    each "operation:function:backend" once, as it logs it); empty where FLA has no registry."""
    try:
        from fla.ops.backends import BackendRegistry
        registry = BackendRegistry._registries.get("gated_delta_rule")
        return set(registry._logged) if registry is not None else set()
    except Exception:
        return set()


def run_anchor(inputs, path, scale, counter, device):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    dt = torch.bfloat16 if path == "bf16" else torch.float32
    q = inputs["q"].to(device, dt).requires_grad_()
    k = inputs["k"].to(device, dt).requires_grad_()
    v = inputs["v"].to(device, dt).requires_grad_()
    g = inputs["g"].to(device, torch.float32).requires_grad_()
    beta = inputs["beta"].to(device, dt).requires_grad_()
    H, Hk = v.shape[2], q.shape[2]
    # FLA's op takes as many q/k heads as v heads: repeat them as HF's Qwen3.5 layer does
    # (autograd sums the gradients of the copies back into each key head).
    qq, kk = (q, k) if H == Hk else (q.repeat_interleave(H // Hk, 2), k.repeat_interleave(H // Hk, 2))
    before, logged_before = counter.calls, backends_logged()
    o, final_state = chunk_gated_delta_rule(qq, kk, v, g, beta, scale=scale, output_final_state=True,
                                            use_qk_l2norm_in_kernel=True)
    o.backward(inputs["d_o"].to(device, o.dtype))
    if device == "cuda":
        torch.cuda.synchronize()
    new = sorted(k.split(":")[-1] for k in backends_logged() - logged_before if "chunk_gated_delta_rule" in k)
    if new:
        backend = ",".join(new)
    else:
        backend = "flash_qla" if counter.calls > before else "fla default (Triton)"
    out = {"o": o.detach(), "final_state": final_state.detach(), "dq": q.grad, "dk": k.grad,
           "dv": v.grad, "dg": g.grad, "dbeta": beta.grad}
    return {n: t.cpu() for n, t in out.items()}, backend


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("label", help="impl name in the report: flashqla or fla")
    parser.add_argument("inputs", help="safetensors file written by gdr_core_accuracy")
    parser.add_argument("--paths", default="bf16,fp32")
    parser.add_argument("--device", default="cuda", help="where the anchor runs")
    parser.add_argument("--reference_device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--reference_only", action="store_true",
                        help="compute the reference and its agreement with gdr's, run no anchor")
    args = parser.parse_args()

    inputs, metadata = read_safetensors(args.inputs)
    scale = float(json.loads(metadata["scale"]))
    B, T, Hk, dk = inputs["q"].shape
    H, dv = inputs["v"].shape[2], inputs["v"].shape[3]
    shape = dict(B=B, T=T, H=H, Hk=Hk, dk=dk, dv=dv)

    # The reference, cached next to the inputs (keyed by the file's size and time, so a
    # rewritten file is never paired with an old reference): the second anchor's run reuses it.
    cache = args.inputs + ".pyref.pt"
    stat = os.stat(args.inputs)
    key = torch.tensor([stat.st_size, stat.st_mtime_ns], dtype=torch.int64)
    start = time.time()
    cached = torch.load(cache) if os.path.exists(cache) else None
    if cached is not None and torch.equal(cached["key"], key):
        ref = cached["ref"]
        source = "cache"
    else:
        ref = reference(inputs, scale, args.reference_device)
        torch.save(dict(key=key, ref=ref), cache)
        source = args.reference_device
    agreement = {n: error_of(ref[n], inputs["ref_" + n])["max_rel_err"]
                 for n in ref if "ref_" + n in inputs}
    print("ACCURACY_REF", json.dumps(dict(label=args.label, reference="FP64 recurrence, torch autograd",
                                          computed_on=source, seconds=round(time.time() - start, 1),
                                          gdr_reference=metadata.get("reference", ""),
                                          max_rel_diff_vs_gdr_reference=agreement, **shape)),
          flush=True)
    if args.reference_only:
        return

    counter = CallCounter()
    for path in args.paths.split(","):
        head = dict(impl=args.label, path=path, **shape)
        if args.label == "flashqla" and path != "bf16":
            # FLA's FlashQLA verifier takes float16 / bfloat16 only and hands anything else to
            # its Triton kernels, which the fla run measures.
            print("ACCURACY", json.dumps(dict(head, error="not run: FlashQLA takes 16-bit q/k/v only "
                                                           "(FLA sends fp32 to its Triton kernels: the FLA column)")),
                  flush=True)
            continue
        try:
            results, backend = run_anchor(inputs, path, scale, counter, args.device)
        except Exception as e:  # an anchor refusing a dtype is a result, not a crash
            print("ACCURACY", json.dumps(dict(head, error=f"{type(e).__name__}: {str(e)[:300]}")), flush=True)
            continue
        for name in ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta"):
            x = results[name]
            line = dict(impl=args.label, path=path, tensor=name, **shape)
            if x is None or x.shape != ref[name].shape:
                line["error"] = f"shape {None if x is None else list(x.shape)}, expected {list(ref[name].shape)}"
            else:
                line.update(error_of(x, ref[name]))
                if name == "final_state":
                    # A [dv, dk] state layout would show as a huge error: say so instead.
                    t = error_of(x.transpose(-1, -2), ref[name]) if dk == dv else None
                    if t is not None and t["max_rel_err"] < 0.1 * line["max_rel_err"]:
                        line["note"] = "matches the reference transposed ([dv, dk] layout)"
            line["backend"] = backend
            line["dtype"] = str(x.dtype).replace("torch.", "") if x is not None else None
            print("ACCURACY", json.dumps(line), flush=True)


if __name__ == "__main__":
    sys.exit(main())
