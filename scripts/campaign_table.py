"""Merge the GPU campaign's parts (scripts/gpu_campaign.sh) into DIR/campaign.json and DIR/campaign.md, and
print the markdown: the part statuses, then each part's own table, the side-by-side table last. A part whose files
cannot be read (its limit killed it while it wrote them: truncated JSON, a .md without its .json) loses its own
section only, and is named under the statuses: the table is still written and printed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

UNREADABLE = (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError)


def _opt(v, fmt: str = "{:.2f}") -> str:
    """A value that older campaign JSON (or a CPU run) lacks: '-' for None."""
    return "-" if v is None else fmt.format(v)


def status_line(name: str, v: dict, call: str | None = None) -> str:
    """A part's line: its exit status and time (with a failed part's last line of output), or why it did not run
    (gpu_campaign.sh writes {"rc": null, "not_run": why} for a part it skipped). `call`: the call that prints the
    table; a status another call into the same --out wrote (a part this call did not run) says so. Where this call
    ran the part and did not finish it, the folder the script moved an earlier call's output of it to is named."""
    if v.get("rc") is None:
        line = f"- part {name}: NOT RUN ({v.get('not_run', 'no exit status')})"
    else:
        line = (f"- part {name}: rc {v['rc']} in {v['seconds']} s" + (" (TIMED OUT)" if v["rc"] in (124, 137) else "")
                + (f" (STOPPED by {v['stopped']})" if v.get("stopped") else "")
                + (f": {v['last_line']}" if v.get("last_line") else ""))
    if call and v.get("call") != call:
        line += f" [an earlier call's status{': ' + v['call'] if v.get('call') else ''}]"
    elif v.get("earlier") and v.get("rc") != 0:
        line += f" [an earlier call's output of this part, not shown: {v['earlier']}/]"
    return line


def attn_section(parts: Path, merged: dict) -> list[str]:
    path = parts / "attn.json"
    if not path.is_file():
        return []
    a = merged["parts"]["attn"] = json.loads(path.read_text())
    lines = ["", f"## Attention formulations ({a['device']}, T = {a['T']}, window {a['window']})", "",
             "| case | heads | formulation | ms | max abs err | first call s |", "|---|---|---|---|---|---|"]
    for r in a["rows"]:
        lines.append(f"| {r['case']} | {r['heads']} | {r['formulation']} | " +
                     (f"ERROR {r['error'][:100]} | | |" if "error" in r else
                      f"{r['ms']:.3f} | {r['max_abs_err']:.1e} | {r['first_call_s']:.1f} |"))
    return lines


def profile_section(parts: Path, merged: dict) -> list[str]:
    path = parts / "profile" / "profile.json"
    if not path.is_file():
        return []
    p = merged["parts"]["profile"] = json.loads(path.read_text())
    lines = ["", "## One call profiled", "", "| callable | kernels | device ms |", "|---|---|---|"]
    return lines + [f"| {k} | {_opt(v['kernels'], '{:g}')} | {_opt(v['device_ms'])} |" for k, v in p.items()]


def compiled_profile_section(root: Path, parts: Path, mode: str, merged: dict) -> list[str]:
    """The compiled profiles: totals, then what the K = 1 plan pays once."""
    d = parts / f"profile_compiled_{mode}"
    if not (d / "profile.json").is_file():
        (root / f"profile_compiled_{mode}.txt").unlink(missing_ok=True)  # an earlier call's copy
        return []
    pc = merged["parts"][f"profile_compiled_{mode}"] = json.loads((d / "profile.json").read_text())
    # wall = host clock around a synchronise per call; gap = wall - the kernels' device time (host time, and
    # on a replay the device's gaps between the graph's kernels);
    # replays / launches: CUDA graph replays and single kernel launches per call (1 / 0: captured whole)
    lines = ["", f"## Compiled, profiled ({mode})", "",
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
    return lines


def vs_paper_section(parts: Path, name: str, merged: dict) -> list[str]:
    path = parts / name / "vs_paper.json"
    if path.is_file():
        merged["parts"][name] = json.loads(path.read_text())
    md = parts / name / "vs_paper.md"
    if not md.is_file():
        return []
    text = md.read_text()
    if name == "vs_paper_eager":  # the summary and the correctness check; every callable is in the JSON
        head, _, rest = text.partition("\nEvery timed callable:")
        cut = [i for i in (rest.find("\nCorrectness"), rest.find("\nFailures")) if i >= 0]
        tail = rest[min(cut):] if cut else ""
        text = head + tail
    return ["", f"## {name}", "", text]


def flex_section(parts: Path, merged: dict) -> list[str]:
    flex = parts / "flex" / "flex.json"
    if not flex.is_file():
        return []
    merged["parts"]["flex"] = json.loads(flex.read_text())
    return ["", "#" + (parts / "flex" / "flex.md").read_text()]


def flex_train_section(parts: Path, kind: str, merged: dict) -> list[str]:
    """One compiled training step per window kernel."""
    md = parts / f"flex_train_{kind}" / "train.md"
    if not md.is_file():
        return []
    rec = merged["parts"][f"flex_train_{kind}"] = json.loads(md.with_suffix(".json").read_text())
    note = ""
    if kind == "flex" and rec.get("device_type") != "cuda":  # torch has no CPU backward for FlexAttention:
        note = " (not taken: on the CPU a training graph falls back to the auto kernel)"  # a label, not a claim
    return ["", f"## Compiled training step, window kernel {kind}{note}", "", md.read_text()]


def host_section(parts: Path, merged: dict) -> list[str]:
    """Host time per compiled call (scripts/host_per_call.py)."""
    host = parts / "host" / "host_per_call.json"
    if not host.is_file():
        return []
    merged["parts"]["host"] = rec = json.loads(host.read_text())
    c = rec["config"]
    return ["", f"## Host time per compiled call ({c['device_name']}, depth {c['depth']}, width {c['width']}, "
            f"plan {c['plan']}, block {c['block']}; thread time, medians)", "",
            (parts / "host" / "host_per_call.md").read_text()]


def suite_section(md: Path, merged: dict) -> list[str]:
    if not md.is_file():
        return []
    text = md.read_text()
    merged["parts"][md.parent.name] = json.loads(md.with_suffix(".json").read_text())
    return ["", "#" + text]


def main(out: str, call: str | None = None) -> int:
    """`call`: the gpu_campaign.sh call printing the table (its statuses name it), None: no status is marked."""
    root = Path(out)
    parts = root / "parts"
    merged: dict = {"status": {}, "parts": {}}
    unreadable: dict[str, str] = {}

    def guarded(name: str, section) -> list[str]:
        """A part's section, or none when its files cannot be read (recorded in `unreadable`) or when this call
        named its part NOT RUN (files there are an earlier call's, whose status this call replaced)."""
        part = next((p for p in ("profile_compiled", "flex_train") if name.startswith(p + "_")), name)
        if "not_run" in merged["status"].get(part, {}):
            return []
        try:
            return section()
        except UNREADABLE as e:
            merged["parts"].pop(name, None)
            unreadable[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            return []

    for f in sorted(parts.glob("*.status.json")):
        def status(f=f):
            s = json.loads(f.read_text())
            merged["status"][s["part"]] = s
            return []
        guarded(f.name.removesuffix(".status.json"), status)
    body = guarded("attn", lambda: attn_section(parts, merged))
    body += guarded("profile", lambda: profile_section(parts, merged))
    for mode in ("graphs", "kernels"):
        body += guarded(f"profile_compiled_{mode}", lambda mode=mode: compiled_profile_section(root, parts, mode, merged))
    for name in ("vs_paper_compiled", "vs_paper_eager"):
        body += guarded(name, lambda name=name: vs_paper_section(parts, name, merged))
    body += guarded("flex", lambda: flex_section(parts, merged))
    for kind in ("masked", "flex"):
        body += guarded(f"flex_train_{kind}", lambda kind=kind: flex_train_section(parts, kind, merged))
    body += guarded("host", lambda: host_section(parts, merged))
    for md in (parts / "decode_shape" / "prediction.md", parts / "decode" / "decode.md",
               parts / "decode_trained" / "decode.md", parts / "train" / "train.md"):
        body += guarded(md.parent.name, lambda md=md: suite_section(md, merged))
    prof = parts / "profile" / "profile.txt"
    if prof.is_file():  # beside campaign.md, so one folder holds what a device call brings back
        (root / "profile.txt").write_text(prof.read_text())
    else:  # an earlier call's copy: its part's files were set aside (or never written)
        (root / "profile.txt").unlink(missing_ok=True)
    lines = ["# GPU campaign", ""] + [status_line(k, v, call) for k, v in merged["status"].items()]
    if unreadable:
        merged["unreadable"] = unreadable
        lines += ["", "Output that could not be read (a part cut short while it wrote?):"]
        lines += [f"- {k}: {v}" for k, v in unreadable.items()]
    text = "\n".join(lines + body) + "\n"
    (root / "campaign.md").write_text(text)
    (root / "campaign.json").write_text(json.dumps(merged, indent=1))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "runs/gpu-campaign",
                  sys.argv[2] if len(sys.argv) > 2 else None))
