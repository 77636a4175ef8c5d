# Markdown tables of a tools/gpu/gdr_core_vs_anchors.sh run (issue 31): reads the lines that
# gdr_core_bench --json (GDR), gdn_anchor.py (ANCHOR), gdr_core_accuracy and
# gdn_anchor_accuracy.py (ACCURACY, ACCURACY_REF) printed, in any order, mixed with other
# output, and prints the side-by-side GPU-time table and the accuracy tables.
#   python3 tools/gpu/gdr_vs_anchors_table.py results.log [GPU name]
# Plain Python (no torch): it runs wherever the log is.
import json
import sys

IMPLS = (("gdr", "gdr"), ("flashqla", "FlashQLA"), ("fla", "FLA Triton"))
TENSORS = ("o", "final_state", "dq", "dk", "dv", "dg", "dbeta")


def parse(lines):
    timing, accuracy, refs, other = [], [], [], []
    for line in lines:
        tag, _, rest = line.strip().partition(" ")
        if tag not in ("GDR", "ANCHOR", "ACCURACY", "ACCURACY_REF"):
            continue
        try:
            record = json.loads(rest)
        except json.JSONDecodeError:
            other.append(line.strip())
            continue
        {"GDR": timing, "ANCHOR": timing, "ACCURACY": accuracy, "ACCURACY_REF": refs}[tag].append(record)
    return timing, accuracy, refs, other


def one_line(text):
    return " ".join(str(text).split())


def ms(x):
    return "-" if x is None else f"{x:.3f}"


def ratio(a, b):
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def timing_tables(timing):
    out = []
    # The anchors' shapes: H = Hk, one document per row, as gdn_anchor.py runs them.
    def key(r):
        return (r["B"], r["T"], r["H"])
    plain = [r for r in timing if r.get("documents", 1) == 1 and r.get("Hk", r["H"]) == r["H"]]
    shapes = []
    for r in plain:
        if key(r) not in shapes:
            shapes.append(key(r))
    by = {(r["impl"], key(r)): r for r in plain}
    out.append("| B x T (H) | gdr fwd / fwd+bwd | FlashQLA fwd / fwd+bwd | FLA Triton fwd / fwd+bwd "
               "| gdr / FlashQLA fwd, fwd+bwd | gdr / FLA fwd, fwd+bwd | bwd bit-exact gdr / FQ / FLA |")
    out.append("|---|---|---|---|---|---|---|")
    notes = []
    for s in shapes:
        cells = []
        rec = {impl: by.get((impl, s)) for impl, _ in IMPLS}
        for impl, name in IMPLS:
            r = rec[impl]
            if r is None:
                cells.append("(not run)")
                continue
            cells.append(f"{ms(r.get('fwd_ms_graph'))} / {ms(r.get('fwdbwd_ms_graph'))}")
            for k in ("graph_error", "eager_error", "replay_error", "error"):
                if k in r:
                    notes.append(f"- {name} {s[0]} x {s[1]}: {k}: {one_line(r[k])}")
        g = rec["gdr"] or {}
        ratios = []
        for impl in ("flashqla", "fla"):
            a = rec[impl] or {}
            ratios.append(f"{ratio(g.get('fwd_ms_graph'), a.get('fwd_ms_graph'))}, "
                          f"{ratio(g.get('fwdbwd_ms_graph'), a.get('fwdbwd_ms_graph'))}")
        exact = " / ".join("-" if rec[i] is None else str(rec[i].get("bwd_bitexact_3_replays", "-")).lower()
                           for i, _ in IMPLS)
        out.append(f"| {s[0]} x {s[1]} ({s[2]}) | " + " | ".join(cells) + f" | {ratios[0]} | {ratios[1]} | {exact} |")
    out.append("")
    out.append("Eager (CUDA events around one call; host overhead counts, so compare GPU time above):")
    out.append("")
    out.append("| B x T (H) | gdr fwd / fwd+bwd | FlashQLA fwd / fwd+bwd | FLA Triton fwd / fwd+bwd |")
    out.append("|---|---|---|---|")
    for s in shapes:
        cells = []
        for impl, _ in IMPLS:
            r = by.get((impl, s))
            cells.append("(not run)" if r is None else f"{ms(r.get('fwd_ms_eager'))} / {ms(r.get('fwdbwd_ms_eager'))}")
        out.append(f"| {s[0]} x {s[1]} ({s[2]}) | " + " | ".join(cells) + " |")
    extra = [r for r in timing if r not in plain and r["impl"] == "gdr"]
    if extra:
        out.append("")
        out.append("gdr only (packed documents, Hv != Hk; the anchors' script has no such shapes):")
        out.append("")
        out.append("| B x T | H / Hk | documents | fwd / fwd+bwd GPU ms | fwd / fwd+bwd eager ms | bwd bit-exact |")
        out.append("|---|---|---|---|---|---|")
        for r in extra:
            out.append(f"| {r['B']} x {r['T']} | {r['H']} / {r.get('Hk', r['H'])} | {r.get('documents', 1)} | "
                       f"{ms(r.get('fwd_ms_graph'))} / {ms(r.get('fwdbwd_ms_graph'))} | "
                       f"{ms(r.get('fwd_ms_eager'))} / {ms(r.get('fwdbwd_ms_eager'))} | "
                       f"{str(r.get('bwd_bitexact_3_replays', '-')).lower()} |")
            for k in ("graph_error", "eager_error", "replay_error", "error"):
                if k in r:
                    notes.append(f"- gdr {r['B']} x {r['T']} H {r['H']}/{r.get('Hk')} docs {r.get('documents')}: "
                                 f"{k}: {one_line(r[k])}")
    if notes:
        out.append("")
        out.extend(notes)
    return out


def sci(x):
    return "-" if x is None else f"{x:.2e}"


def accuracy_tables(accuracy, refs):
    out = []
    shape = next(({k: r[k] for k in ("B", "T", "H", "Hk", "dk", "dv")} for r in accuracy if "B" in r), None)
    if shape:
        out.append("Inputs: B {B}, T {T}, H {H}, Hk {Hk}, dk {dk}, dv {dv} (gdr_core_accuracy's seeded file); "
                   "errors against the FP64 reference: max |err| / max |err| over max |ref|.".format(**shape))
        out.append("")
    notes = []
    for path in ("bf16", "fp32"):
        rows = [r for r in accuracy if r.get("path") == path]
        if not rows:
            continue
        by = {(r["impl"], r.get("tensor")): r for r in rows}
        out.append(f"{path} path:")
        out.append("")
        out.append("| tensor | " + " | ".join(name for _, name in IMPLS) + " |")
        out.append("|---|---|---|---|")
        for t in TENSORS:
            cells = []
            for impl, _ in IMPLS:
                r = by.get((impl, t))
                cells.append("-" if r is None or "max_abs_err" not in r
                             else f"{sci(r['max_abs_err'])} / {sci(r['max_rel_err'])}")
            out.append(f"| {t} | " + " | ".join(cells) + " |")
        out.append("")
        for impl, name in IMPLS:
            failed = by.get((impl, None))
            if failed and "error" in failed:
                notes.append(f"- {name}, {path}: {one_line(failed['error'])}")
            backends = sorted({r.get("backend") for r in rows if r["impl"] == impl and r.get("backend")})
            if backends:
                notes.append(f"- {name}, {path}: backend that ran: {', '.join(backends)}")
            for r in rows:
                if r["impl"] == impl and r.get("note"):
                    notes.append(f"- {name}, {path}, {r['tensor']}: {r['note']}")
    for r in refs:
        diff = r.get("max_rel_diff_vs_gdr_reference", {})
        worst = max(diff.values()) if diff else None
        notes.append(f"- reference check ({r.get('label')}): the script's FP64 recurrence vs gdr's FP64 reference "
                     f"({r.get('gdr_reference', '')}): max relative difference {sci(worst)} "
                     f"({r.get('computed_on')}, {r.get('seconds')} s)")
    out.extend(notes)
    return out


def main():
    with open(sys.argv[1], errors="replace") as f:
        timing, accuracy, refs, other = parse(f)
    gpu = sys.argv[2] if len(sys.argv) > 2 else "(GPU not recorded)"
    print(f"## GDR core vs FlashQLA and FLA (one device call, {gpu})")
    print()
    print("GPU time = 20 calls captured in one CUDA graph and replayed, median of 5 replays / 20 (ms); "
          "BF16, q/k L2 norm in kernel, dk = dv = 128.")
    print()
    print("\n".join(timing_tables(timing)))
    print()
    print("## Accuracy against FP64")
    print()
    print("\n".join(accuracy_tables(accuracy, refs)))
    if other:
        print()
        print("Unparsed result lines:")
        print("\n".join("    " + line for line in other))


if __name__ == "__main__":
    main()
