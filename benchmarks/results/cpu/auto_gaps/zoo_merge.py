import json, sys
from pathlib import Path
models = ["vgg19", "resnet50", "unet", "densenet121", "googlenet", "inception_v3", "pspnet"]
rows = []
data = {"machine": "x86_64, 2 cores, CPU only, shared (load average 2.4-5.6 during the run)", "graphs": []}
for m in models:
    b = json.load(open(f"/tmp/milp_h/zoo_before/{m}/gaps.json"))["graphs"][0]
    n = json.load(open(f"/tmp/milp_h/zoo_now/{m}/gaps.json"))["graphs"][0]
    g = {"graph": n["graph"], "nodes": n["nodes"], "budgets": {}}
    for label, r in n["budgets"].items():
        rb = b["budgets"][label]
        g["budgets"][label] = {"main": rb, "now": r}
        def cell(x):
            if x.get("infeasible"): return "no plan"
            return f"{x['extra_time_s']*1e6:.4g} us ({x['chosen']}, {x['seconds']:.1f} s)"
        def rat(x, k):
            v = x.get(k); return "-" if v is None else f"{v:.3f}x"
        rows.append(f"| {n['graph']} ({n['nodes']} nodes) | {label} | {cell(rb)} | {cell(r)} | {rat(rb,'over_bound')} / {rat(r,'over_bound')} | {rat(rb,'over_best')} / {rat(r,'over_best')} | {'yes' if r.get('proven_optimal') else 'no'} |")
    data["graphs"].append(g)
Path(sys.argv[1]).write_text(json.dumps(data, indent=1))
print("\n".join(rows))
