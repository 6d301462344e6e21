"""Merge the GPU campaign's parts (scripts/gpu_campaign.sh) into DIR/campaign.json and DIR/campaign.md, and
print the markdown: the part statuses, then each part's own table, the side-by-side table last."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _opt(v, fmt: str = "{:.2f}") -> str:
    """A value that older campaign JSON (or a CPU run) lacks: '-' for None."""
    return "-" if v is None else fmt.format(v)


def main(out: str) -> int:
    root = Path(out)
    parts = root / "parts"
    merged: dict = {"status": {}, "parts": {}}
    for f in sorted(parts.glob("*.status.json")):
        s = json.loads(f.read_text())
        merged["status"][s["part"]] = s
    for name, path in (("vs_paper_eager", parts / "vs_paper_eager" / "vs_paper.json"),
                       ("vs_paper_compiled", parts / "vs_paper_compiled" / "vs_paper.json"),
                       ("attn", parts / "attn.json"), ("profile", parts / "profile" / "profile.json")):
        if path.is_file():
            merged["parts"][name] = json.loads(path.read_text())
    lines = ["# GPU campaign", ""]
    lines += [f"- part {k}: rc {v['rc']} in {v['seconds']} s" + (" (TIMED OUT)" if v["rc"] in (124, 137) else "")
              for k, v in merged["status"].items()]
    a = merged["parts"].get("attn")
    if a:
        lines += ["", f"## Attention formulations ({a['device']}, T = {a['T']}, window {a['window']})", "",
                  "| case | heads | formulation | ms | max abs err | first call s |", "|---|---|---|---|---|---|"]
        for r in a["rows"]:
            lines.append(f"| {r['case']} | {r['heads']} | {r['formulation']} | " +
                         (f"ERROR {r['error'][:100]} | | |" if "error" in r else
                          f"{r['ms']:.3f} | {r['max_abs_err']:.1e} | {r['first_call_s']:.1f} |"))
    p = merged["parts"].get("profile")
    if p:
        lines += ["", "## One call profiled", "", "| callable | kernels | device ms |", "|---|---|---|"]
        lines += [f"| {k} | {_opt(v['kernels'], '{:g}')} | {_opt(v['device_ms'])} |" for k, v in p.items()]
    for mode in ("graphs", "kernels"):  # the compiled profiles: totals, then what the K = 1 plan pays once
        d = parts / f"profile_compiled_{mode}"
        if (d / "profile.json").is_file():
            pc = merged["parts"][f"profile_compiled_{mode}"] = json.loads((d / "profile.json").read_text())
            # wall = host clock around a synchronise per call; gap = wall - the kernels' device time (host time, and
            # on a replay the device's gaps between the graph's kernels);
            # replays / launches: CUDA graph replays and single kernel launches per call (1 / 0: captured whole)
            lines += ["", f"## Compiled, profiled ({mode})", "",
                      "| callable | kernels | device ms | wall ms | host gap ms | graph replays | single launches |",
                      "|---|---|---|---|---|---|---|"]
            lines += [f"| {k} | {_opt(v['kernels'], '{:g}')} | {_opt(v['device_ms'])} | {_opt(v.get('wall_ms'))} | "
                      f"{_opt(v.get('host_gap_ms'))} | {_opt(v.get('graph_launches'), '{:g}')} | "
                      f"{_opt(v.get('kernel_launches'), '{:g}')} |" for k, v in pc.items()]
            txt = (d / "profile.txt").read_text()
            i = txt.find("== snlp")
            i = txt.find("paid once", i) if i >= 0 else -1
            if i >= 0:  # the snlp split table (the paper's and the per-callable tables stay in profile.txt)
                block = txt[txt.rfind("== ", 0, i):].split("\n\n")[0].splitlines()
                lines += ["", block[0].lstrip("= ")] + block[1:12]
            (root / f"profile_compiled_{mode}.txt").write_text(txt)
    for name in ("vs_paper_compiled", "vs_paper_eager"):
        md = parts / name / "vs_paper.md"
        if md.is_file():
            text = md.read_text()
            if name == "vs_paper_eager":  # the summary and the correctness check; every callable is in the JSON
                head, _, rest = text.partition("\nEvery timed callable:")
                cut = [i for i in (rest.find("\nCorrectness"), rest.find("\nFailures")) if i >= 0]
                tail = rest[min(cut):] if cut else ""
                text = head + tail
            lines += ["", f"## {name}", "", text]
    flex = parts / "flex" / "flex.json"
    if flex.is_file():
        merged["parts"]["flex"] = json.loads(flex.read_text())
        lines += ["", "#" + (parts / "flex" / "flex.md").read_text()]
    for kind in ("masked", "flex"):  # one compiled training step per window kernel
        md = parts / f"flex_train_{kind}" / "train.md"
        if md.is_file():
            rec = json.loads(md.with_suffix(".json").read_text())
            merged["parts"][f"flex_train_{kind}"] = rec
            note = ""
            if kind == "flex" and rec.get("device_type") != "cuda":  # torch has no CPU backward for FlexAttention:
                note = " (not taken: on the CPU a training graph falls back to the auto kernel)"  # a label, not a claim
            lines += ["", f"## Compiled training step, window kernel {kind}{note}", "", md.read_text()]
    host = parts / "host" / "host_per_call.json"
    if host.is_file():  # host time per compiled call (scripts/host_per_call.py)
        merged["parts"]["host"] = rec = json.loads(host.read_text())
        c = rec["config"]
        lines += ["", f"## Host time per compiled call ({c['device_name']}, depth {c['depth']}, width {c['width']}, "
                  f"plan {c['plan']}, block {c['block']}; thread time, medians)", "",
                  (parts / "host" / "host_per_call.md").read_text()]
    for md in (parts / "decode_shape" / "prediction.md", parts / "decode" / "decode.md",
               parts / "decode_trained" / "decode.md", parts / "train" / "train.md"):
        if md.is_file():
            lines += ["", "#" + md.read_text()]
            merged["parts"][md.parent.name] = json.loads(md.with_suffix(".json").read_text())
    prof = parts / "profile" / "profile.txt"
    if prof.is_file():  # beside campaign.md, so one folder holds what a device call brings back
        (root / "profile.txt").write_text(prof.read_text())
    text = "\n".join(lines) + "\n"
    (root / "campaign.md").write_text(text)
    (root / "campaign.json").write_text(json.dumps(merged, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "runs/gpu-campaign"))
