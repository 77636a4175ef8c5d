# Copied unchanged from ../shared/tools/gdn_anchor.py (the project's shared anchor script; only the checkout travels to the GPU machine). Re-copy it rather than edit it here.
# GDN anchor timings: FLA 0.6.0 chunk_gated_delta_rule (autograd op, q/k L2 norm in kernel) at the
# Qwen3.5-0.8B head shape (H=16, dk=dv=128, BF16). With flash_qla installed FLA dispatches to FlashQLA
# (TileLang); FLA_FLASH_QLA=0 selects FLA's Triton kernels. GPU time = CUDA-graph replay; eager = events
# around each Python call. usage: python3 gdn_anchor.py LABEL   (one JSON line per shape)
import json, os, statistics, sys, torch, torch.nn.functional as F
from fla.ops.gated_delta_rule import chunk_gated_delta_rule
label = sys.argv[1] if len(sys.argv) > 1 else "fla"
def ev_time(fn, iters=20, warm=3):
    for _ in range(warm): fn()
    torch.cuda.synchronize(); ts = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e))
    return statistics.median(ts)
def graph_time(fn, reps=20):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3): fn()
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps): fn()
    g.replay(); torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b) / reps)
    return statistics.median(ts)
H, K, V = 16, 128, 128
for B, T in ((1, 2048), (4, 2048), (1, 8192), (1, 16384), (1, 65536)):
    torch.manual_seed(0)
    mk = lambda *s, dt=torch.bfloat16: torch.randn(*s, device="cuda", dtype=dt)
    q, k, v = mk(B, T, H, K).requires_grad_(), mk(B, T, H, K).requires_grad_(), mk(B, T, H, V).requires_grad_()
    g = F.logsigmoid(mk(B, T, H, dt=torch.float32)).requires_grad_()
    beta = torch.rand(B, T, H, device="cuda", dtype=torch.bfloat16).requires_grad_()
    do = mk(B, T, H, V)
    f = lambda: chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]
    def fb():
        for t in (q, k, v, g, beta): t.grad = None
        f().backward(do)
    r = dict(impl=label, B=B, T=T, H=H)
    try:
        r["fwd_ms_eager"] = round(ev_time(f), 4); r["fwdbwd_ms_eager"] = round(ev_time(fb), 4)
    except Exception as e:
        r["eager_error"] = str(e)[:200]
    try:
        with torch.no_grad():
            r["fwd_ms_graph"] = round(graph_time(f), 4)
        r["fwdbwd_ms_graph"] = round(graph_time(fb), 4)
    except Exception as e:
        r["graph_error"] = str(e)[:200]
    try:
        outs = []
        for _ in range(3):
            fb(); torch.cuda.synchronize(); outs.append(torch.cat([t.grad.float().flatten() for t in (q, k, v, g, beta)]))
        r["bwd_bitexact_3_replays"] = all(torch.equal(outs[0], o) for o in outs[1:])
    except Exception as e:
        r["replay_error"] = str(e)[:200]
    print("ANCHOR", json.dumps(r), flush=True)
    del q, k, v, g, beta, do; torch.cuda.empty_cache()
