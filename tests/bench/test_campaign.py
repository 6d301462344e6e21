"""The GPU campaign's CPU smoke run (scripts/gpu_campaign.sh --quick): a lent GPU must never be spent on a crash.
The parts that need the paper's code run when a checkout of it is beside the repository (as in CI); the heavier
parts (compiled prefill, decode and train suites) have their own quick tests (test_decode_suite, test_train_bench,
test_vs_paper, the host part below) and are run by the campaign's --quick by hand."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from test_vs_paper import PAPER

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # the whole CPU smoke campaign: ~3.5 min on a 2-core box (docs/records/test-durations-2026-11-26.md)
def test_quick_campaign_runs_its_parts_and_prints_the_table_last(tmp_path):
    parts = "attn,profile,profile_compiled,vs_paper_eager" if PAPER else "attn"
    cmd = ["bash", str(ROOT / "scripts" / "gpu_campaign.sh"), "--quick", "--out", str(tmp_path), "--parts", parts]
    if PAPER:
        cmd += ["--paper", PAPER]
    env = {**os.environ, "LIMIT_vs_paper_eager": "600"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    merged = json.loads((tmp_path / "campaign.json").read_text())
    assert set(merged["status"]) == set(parts.split(","))
    assert all(s["rc"] == 0 for s in merged["status"].values()), merged["status"]
    table = (tmp_path / "campaign.md").read_text()
    assert out.stdout.rstrip().endswith(table.rstrip().splitlines()[-1])  # the table is printed last
    assert "Attention formulations" in table
    if PAPER:
        assert "vs_paper_eager" in table and "Correctness" in table
        # the compiled profile (no CUDA graphs on a CPU) and its split, with K = 0 beside it, reach the table
        assert "Compiled, profiled (kernels)" in table and "stack once" in table and "(graphs)" not in table


def test_the_table_keeps_each_parts_failures_and_correctness(tmp_path):
    """The eager vs-paper part's per-callable table is left to the JSON, but its failures and its correctness check
    reach the printed table (a device call returns only the tail of its output)."""
    part = tmp_path / "parts" / "vs_paper_eager"
    part.mkdir(parents=True)
    (part / "vs_paper.md").write_text("## x\n\n| a |\n\nEvery timed callable:\n\n| every |\n\nFailures (the JSON has "
                                      "the tracebacks):\n\n- s c: RuntimeError: boom\n")
    out = subprocess.run(["python3", str(ROOT / "scripts" / "campaign_table.py"), str(tmp_path)], capture_output=True,
                         text=True, check=True).stdout
    assert "boom" in out and "| every |" not in out
    (part / "vs_paper.md").write_text("## x\n\nEvery timed callable:\n\n| every |\n\nCorrectness (fp32):\n\n| c |\n")
    out = subprocess.run(["python3", str(ROOT / "scripts" / "campaign_table.py"), str(tmp_path)], capture_output=True,
                         text=True, check=True).stdout
    assert "Correctness" in out and "| every |" not in out


def test_a_part_named_not_run_shows_no_section_of_an_earlier_call(tmp_path):
    """A call on an --out where an earlier call (with the paper's code) left vs_paper_eager's files: this call names
    the part NOT RUN and the table still printed the earlier call's results under it, as if this call had them."""
    parts = tmp_path / "parts"
    (parts / "vs_paper_eager").mkdir(parents=True)
    (parts / "vs_paper_eager" / "vs_paper.md").write_text("## x\n\n| stale eager |\n")
    (parts / "vs_paper_eager" / "vs_paper.json").write_text("{}")
    (parts / "vs_paper_eager.status.json").write_text(json.dumps(
        {"part": "vs_paper_eager", "rc": None, "seconds": 0, "not_run": "no checkout of the paper's code"}))
    out = subprocess.run(["python3", str(ROOT / "scripts" / "campaign_table.py"), str(tmp_path)], capture_output=True,
                         text=True, check=True).stdout
    assert "- part vs_paper_eager: NOT RUN" in out and "stale eager" not in out and "## vs_paper_eager" not in out
    merged = json.loads((tmp_path / "campaign.json").read_text())
    assert "vs_paper_eager" not in merged["parts"], merged["parts"]


def test_a_part_cut_short_while_writing_costs_its_section_only(tmp_path):
    """A part's limit (timeout's SIGTERM / SIGKILL) can land while it writes its files: flex.json cut mid-way, or a
    decode.md whose decode.json never came. The table is still written and printed last, with every part's status,
    the other parts' sections, and the unreadable output named (it crashed with a traceback, and no table)."""
    parts = tmp_path / "parts"
    (parts / "flex").mkdir(parents=True)
    (parts / "flex" / "flex.json").write_text('{"rows": [{"case": ')  # truncated
    (parts / "decode").mkdir()
    (parts / "decode" / "decode.md").write_text("# Decode\n")  # its .json not written yet
    (parts / "attn.json").write_text(json.dumps({"device": "cpu", "T": 8, "window": 4, "rows": [
        {"case": "c", "heads": 2, "formulation": "masked", "ms": 1.0, "max_abs_err": 0.0, "first_call_s": 0.1}]}))
    for name, rc in (("flex", 124), ("decode", 137), ("attn", 0)):
        (parts / f"{name}.status.json").write_text(json.dumps({"part": name, "rc": rc, "seconds": 9}))
    (parts / "host.status.json").write_text('{"part": "host", "rc"')  # cut short too
    out = subprocess.run(["python3", str(ROOT / "scripts" / "campaign_table.py"), str(tmp_path)], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    table = (tmp_path / "campaign.md").read_text()
    assert out.stdout.rstrip().endswith(table.rstrip().splitlines()[-1])
    assert "- part flex: rc 124 in 9 s (TIMED OUT)" in table and "- part attn: rc 0 in 9 s" in table
    assert "Attention formulations" in table
    assert "- flex: JSONDecodeError" in table and "- decode: FileNotFoundError" in table and "- host: " in table
    merged = json.loads((tmp_path / "campaign.json").read_text())
    assert set(merged["unreadable"]) == {"flex", "decode", "host"} and set(merged["parts"]) == {"attn"}


def test_the_compiled_profile_table_shows_the_host_gap_and_graph_replays(tmp_path):
    """What settles where the compiled K = 1 plan's fixed cost goes (docs/records/2026-11-28-prefill-once.md) reaches
    the printed table: wall time, host gap and CUDA graph replays per call; profiles written before these fields
    existed still print, with '-'."""
    for mode, row in (("graphs", {"kernels": 300, "device_ms": 2.5, "wall_ms": 3.5, "host_gap_ms": 1.0,
                                  "graph_launches": 1, "kernel_launches": 0}),
                      ("kernels", {"kernels": 310, "device_ms": 2.6})):
        d = tmp_path / "parts" / f"profile_compiled_{mode}"
        d.mkdir(parents=True)
        (d / "profile.json").write_text(json.dumps({f"snlp 12xF2-h0-K1 ({mode})": row}))
        (d / "profile.txt").write_text("")
    out = subprocess.run(["python3", str(ROOT / "scripts" / "campaign_table.py"), str(tmp_path)], capture_output=True,
                         text=True, check=True).stdout
    assert "| host gap ms | graph replays | single launches |" in out
    assert "| snlp 12xF2-h0-K1 (graphs) | 300 | 2.50 | 3.50 | 1.00 | 1 | 0 |" in out
    assert "| snlp 12xF2-h0-K1 (kernels) | 310 | 2.60 | - | - | - | - |" in out


@pytest.mark.slow
def test_quick_flex_parts_run_and_reach_the_table(tmp_path):
    """The FlexAttention parts (compiled prefill, masked vs flex, round-robin; one compiled training step per kernel)
    at CPU smoke size: both succeed, every forward has both kernels timed, flex's logits match masked's, and their
    tables are printed."""
    cmd = ["bash", str(ROOT / "scripts" / "gpu_campaign.sh"), "--quick", "--out", str(tmp_path), "--parts",
           "flex,flex_train"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1500, cwd=ROOT,
                         env={**os.environ, "LIMIT_flex": "900", "LIMIT_flex_train": "600"})
    assert out.returncode == 0, out.stderr[-2000:]
    merged = json.loads((tmp_path / "campaign.json").read_text())
    assert all(s["rc"] == 0 for s in merged["status"].values()), (merged["status"], (tmp_path / "log.txt").read_text())
    flex = merged["parts"]["flex"]
    assert not flex["failures"]
    assert {(r["forward"], r["kernel"]) for r in flex["rows"]} == {
        (f, k) for f in ("sequential", "12xF2-h0-K1", "12xF2-h0-K2") for k in ("masked", "flex")}
    assert all(d < 1e-4 for d in flex["max_abs_diff_logits"].values()) and len(flex["max_abs_diff_logits"]) == 3
    table = (tmp_path / "campaign.md").read_text()
    assert "FlexAttention window kernel" in table
    assert "window kernel masked" in table and "window kernel flex (not taken" in table
    assert "Smoke run off a GPU" in table  # CPU smoke timings are labelled as comparing nothing


def test_flex_table_calls_overlapping_timings_a_tie():
    """The flex part's table marks a kernel whose median lies inside masked's p10-p90 and vice versa as a tie, and
    says a run off a GPU compares nothing."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("flex_windows", ROOT / "scripts" / "flex_windows.py")
    fw = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fw)
    row = dict(forward="sequential", runs=5)
    out = {"device": "cpu", "shape": "s", "pattern": "SSSL", "window": 8, "T": 64, "dtype": "float32",
           "cuda_graphs": False, "compile_s": {}, "max_abs_diff_logits": {}, "failures": [],
           "rows": [dict(row, kernel="masked", median_ms=10.0, p10_ms=8.0, p90_ms=12.0, vs_masked=1.0),
                    dict(row, kernel="flex", median_ms=9.0, p10_ms=7.0, p90_ms=11.0, vs_masked=10 / 9),
                    dict(row, forward="p", kernel="masked", median_ms=10.0, p10_ms=9.5, p90_ms=10.5, vs_masked=1.0),
                    dict(row, forward="p", kernel="flex", median_ms=5.0, p10_ms=4.5, p90_ms=5.5, vs_masked=2.0)]}
    md = fw.prefill_markdown(out)
    assert "Smoke run off a GPU" in md
    lines = [ln for ln in md.splitlines() if ln.startswith("| ")]
    assert "1.11x (tie" in next(ln for ln in lines if ln.startswith("| sequential | flex"))
    assert "2.00x |" in next(ln for ln in lines if ln.startswith("| p | flex"))


def test_the_lease_plans_decode_call_passes_its_settings_through(tmp_path):
    """docs/gpu.md's call 1 at CPU smoke size (eager, the quick random model): the environment and flags it sets
    reach the decode suite (batch 1, the two blocks, speculative rows only, a prompts file, several prompts per
    call) and every row gives sequential decoding's tokens."""
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([[(7 * i + j) % 256 for j in range(20)] for i in range(3)]))
    env = {**os.environ, "DECODE_BATCHES": "1", "DECODE_BLOCKS": "2,3", "DECODE_METHODS": "speculative",
           "DECODE_TREATMENTS": "eager", "DECODE_PROMPTS": "3"}
    out = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_campaign.sh"), "--quick", "--out", str(tmp_path / "c1"),
                          "--parts", "decode", "--decode-plans", "3xF1-h0-K1", "--decode-prompts", str(prompts)],
                         capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads((tmp_path / "c1" / "parts" / "decode" / "decode.json").read_text())
    ours = [r for r in res["rows"] if r["library"] == "snlp"]
    assert [(r["method"], r["treatment"], r["batch"], r["block"]) for r in ours] == [
        ("snlp sequential", "eager", 1, None), ("snlp speculative", "eager", 1, 2),
        ("snlp speculative", "eager", 1, 3)]
    assert all(r["prompts"] == 3 and r["matches_sequential"] for r in ours)
    assert res["prompts"] == [p[:16] for p in json.loads(prompts.read_text())]  # --prompt-len's default


@pytest.mark.slow  # compiles five callables on the CPU: ~1-3 min on a 2-core box
def test_quick_host_part_runs_and_reaches_the_table(tmp_path):
    """The `host` part (scripts/host_per_call.py through the campaign, as a lent GPU runs it with --device cuda): it
    succeeds at smoke size, every callable has its guard count and times, and the table says what it measured."""
    cmd = ["bash", str(ROOT / "scripts" / "gpu_campaign.sh"), "--quick", "--out", str(tmp_path), "--parts", "host"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT,
                         env={**os.environ, "LIMIT_host": "800"})
    assert out.returncode == 0, out.stderr[-2000:]
    merged = json.loads((tmp_path / "campaign.json").read_text())
    assert merged["status"]["host"]["rc"] == 0, (tmp_path / "log.txt").read_text()[-3000:]
    rec = merged["parts"]["host"]
    assert rec["config"]["device"] == "cpu"
    assert set(rec["guards"]) == {"seq forward", "plan forward", "seq step", "draft step", "verify step"}
    assert all(n > 0 for n in rec["guards"].values())
    assert {"seq step [guard cut]", "draft step [snapshot]", "verify step [guard cut]"} <= set(rec["rows"])
    assert all(r["synced_us"] is None for r in rec["rows"].values())  # no device to wait for on a CPU
    assert "Host time per compiled call (cpu" in (tmp_path / "campaign.md").read_text()


@pytest.mark.parametrize("argv, env, says", [
    (["--parts", "decdoe"], {}, "unknown part decdoe"),
    (["--parts", ","], {}, "names no part"),
    (["--parts", "attn"], {"LIMIT_decdoe": "400"}, "LIMIT_decdoe names no part"),
    (["--parts", "attn"], {"LIMIT_attn": "5m"}, "LIMIT_attn=5m: a part's limit is whole seconds"),
    (["--parts", "decode"], {"DECODE_BLOCK": "4,8"}, "unknown knob DECODE_BLOCK"),
    (["--parts", "attn"], {"DECODE_BATCHES": "1"}, "DECODE_BATCHES sets the decode part's rows"),
    (["--parts", "attn"], {"TRAIN_REGS": "none"}, "TRAIN_REGS sets the train part's variants"),
    (["--parts", "attn"], {"TRAINED_STEPS": "5"}, "TRAINED_STEPS sets decode_trained's training"),
    (["--parts", "decode_trained", "--decode-plans", "2xF1-h0-K1"], {}, "--decode-plans set the decode part"),
    (["--parts", "attn", "--out"], {}, "--out needs a value"),
    # the next flag is no value: `--out --quick` ran the full campaign into a folder named --quick
    (["--parts", "attn", "--out", "--paper", "/none/nanochat-snlp"], {}, "--out needs a value"),
    (["--parts", "attn", "--out", "--quick"], {}, "--out needs a value"),
    (["--parts", "decode", "--decode-prompts", "/none.json", "--paper", "/none/nanochat-snlp"], {},
     "no nanochat/gpt.py there"),
    (["--parts", "decode", "--decode-prompts", "/none.json", "--out", "/dev/null/c"], {},
     "--out /dev/null/c: cannot write there"),
])
def test_a_knob_the_call_would_ignore_is_refused_before_anything_runs(argv, env, says, tmp_path):
    """A part name, a LIMIT_ / DECODE_ / TRAIN_ knob or a --decode-* flag the call would not use (a typo, or a part it
    does not run) is refused in one line with status 2, before any part runs or the output folder is made: a lent
    GPU's call is never spent on a table without the part it was for."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("LIMIT_", "DECODE_", "TRAIN_", "TRAINED_"))}
    out = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_campaign.sh"), "--quick", "--out",
                          str(tmp_path / "c"), *argv], capture_output=True, text=True, timeout=60,
                         env={**base, **env}, cwd=ROOT)
    assert out.returncode == 2 and says in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not (tmp_path / "c").exists()


def test_without_the_papers_code_its_parts_are_named_not_run_and_the_others_still_run(tmp_path):
    """A call whose parts need the paper's code (docs/gpu.md's call 3, --parts profile_compiled) on a machine it was
    not carried to: each such part is named NOT RUN in the log and the table, the call's other parts still run and
    the table is printed last. It printed "vs-paper parts skipped" and a table with no line for profile_compiled."""
    repo = tmp_path / "repo"  # a clone with no .paper/ and no ../shared beside it
    (repo / "scripts").mkdir(parents=True)
    for f in ("gpu_campaign.sh", "campaign_table.py"):
        (repo / "scripts" / f).write_text((ROOT / "scripts" / f).read_text())
    base = {k: v for k, v in os.environ.items() if not k.startswith(("LIMIT_", "DECODE_", "TRAIN_", "TRAINED_"))}
    out = subprocess.run(["bash", str(repo / "scripts" / "gpu_campaign.sh"), "--quick", "--out", str(tmp_path / "c"),
                          "--parts", "profile_compiled,vs_paper_eager,decode", "--decode-prompts", "/nonexistent.json"],
                         capture_output=True, text=True, timeout=300, env={**base, "PYTHONPATH": str(ROOT)}, cwd=repo)
    assert out.returncode == 0, out.stderr[-2000:]
    table = (tmp_path / "c" / "campaign.md").read_text()
    assert "- part profile_compiled: NOT RUN (no checkout of the paper's code)" in table
    assert "- part vs_paper_eager: NOT RUN (no checkout of the paper's code)" in table
    assert "- part decode: rc 2" in table  # it ran (and refused its missing prompts file)
    assert "part profile_compiled NOT RUN" in out.stdout and out.stdout.rstrip().endswith(table.rstrip().splitlines()[-1])


def test_a_failed_parts_error_line_reaches_the_printed_table(tmp_path):
    """A device call returns the tail of its output, the table: a failed part's line there carries its last line of
    output (docs/gpu.md's call 1 without runs/sr-idn carried: the missing prompts file), not only "rc 2"."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("LIMIT_", "DECODE_", "TRAIN_", "TRAINED_"))}
    out = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_campaign.sh"), "--quick", "--out", str(tmp_path / "c"),
                          "--parts", "decode", "--decode-prompts", str(tmp_path / 'no "such".json')],
                         capture_output=True, text=True, timeout=300, env=base, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("- part decode:"))
    assert line.startswith("- part decode: rc 2 in ") and line.endswith('no "such".json does not exist'), line
    status = json.loads((tmp_path / "c" / "parts" / "decode.status.json").read_text())
    assert status["rc"] == 2 and "does not exist" in status["last_line"]


def test_the_parts_named_as_needing_the_paper_are_those_run_only_with_it():
    """PAPER_PARTS (named NOT RUN without a checkout) is the set of parts inside the script's `if [ -n "$PAPER" ]`
    blocks: a part moved in or out of them without the list would be skipped unnamed, or named and run."""
    import re

    text = (ROOT / "scripts" / "gpu_campaign.sh").read_text()
    listed = re.search(r"^PAPER_PARTS=(\S+)", text, re.M).group(1).split(",")
    blocks = re.findall(r'^if \[ -n "\$PAPER" \]; then\n(.*?)^fi$', text, re.M | re.S)
    inside = {p for b in blocks for p in re.findall(r"^ *part ([a-z_]+)", b, re.M)}
    assert blocks and sorted(listed) == sorted(inside)


def test_the_campaigns_list_of_parts_is_every_part_it_runs():
    """The names the refusal above checks --parts and LIMIT_<part> against are the script's `part NAME` calls."""
    import re

    text = (ROOT / "scripts" / "gpu_campaign.sh").read_text()
    listed = ",".join(v for v in re.findall(r"^ALL_PARTS=(?:\$ALL_PARTS,)?(\S+)", text, re.M)).split(",")
    assert sorted(listed) == sorted(set(re.findall(r"^ *part ([a-z_]+)", text, re.M)))


def campaign(tmp_path, *argv, **env) -> subprocess.Popen:
    """gpu_campaign.sh --quick --out tmp_path/c ARGV, started in a session of its own, with no campaign knob of the
    caller's environment but `env`'s."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("LIMIT_", "DECODE_", "TRAIN_", "TRAINED_"))}
    return subprocess.Popen(["bash", str(ROOT / "scripts" / "gpu_campaign.sh"), "--quick", "--out", str(tmp_path / "c"),
                             *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env={**base, **env}, start_new_session=True)


def test_a_failed_rerun_shows_this_calls_failure_not_the_earlier_calls_section(tmp_path):
    """A part run again into the same --out that fails (here its limit, 1 s, ends it): the table showed the earlier
    call's section for it under this call's failed status, as if the failing call had measured it. The earlier
    output is now moved to earlier/PART/ (named on the failed part's line), the table holds no section of it, and a
    status this call did not write (a part it did not run) is marked as an earlier call's."""
    parts = tmp_path / "c" / "parts"
    parts.mkdir(parents=True)
    (parts / "attn.json").write_text(json.dumps({"device": "cpu", "T": 8, "window": 4, "rows": [
        {"case": "stale", "heads": 2, "formulation": "masked", "ms": 1.0, "max_abs_err": 0.0, "first_call_s": 0.1}]}))
    (parts / "attn.status.json").write_text(json.dumps({"part": "attn", "rc": 0, "seconds": 50}))
    (parts / "host.status.json").write_text(json.dumps({"part": "host", "rc": 0, "seconds": 9}))
    (tmp_path / "c" / "profile.txt").write_text("stale")  # the table's copy of a profile no part holds any more
    proc = campaign(tmp_path, "--parts", "attn", LIMIT_attn="1")
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out[-2000:]
    table = (tmp_path / "c" / "campaign.md").read_text()
    assert out.rstrip().endswith(table.rstrip().splitlines()[-1])
    assert "Attention formulations" not in table and "stale" not in table
    line = next(ln for ln in table.splitlines() if ln.startswith("- part attn:"))
    assert "rc 124" in line and "TIMED OUT" in line and "earlier/attn/" in line, line
    assert "attn" not in json.loads((tmp_path / "c" / "campaign.json").read_text())["parts"]
    assert json.loads((tmp_path / "c" / "earlier" / "attn" / "attn.json").read_text())["rows"][0]["case"] == "stale"
    assert "- part host: rc 0 in 9 s [an earlier call's status]" in table
    assert not (tmp_path / "c" / "profile.txt").exists()


def test_every_path_a_part_writes_is_set_aside_with_it():
    """set_aside moves an earlier call's output of a part before the part runs again: outputs NAME must list every
    $OUT/parts path the part's command writes (a prefix for the ones its loop completes), and no other part's."""
    import re

    text = (ROOT / "scripts" / "gpu_campaign.sh").read_text()
    func = re.search(r"^outputs\(\) \{.*?^\}$", text, re.M | re.S).group(0)
    lines, calls = text.splitlines(), {}
    for i, ln in enumerate(lines):
        if m := re.match(r"^ *part ([a-z_]+) ", ln):
            j, cmd = i, ln
            while lines[j].endswith("\\"):
                j += 1
                cmd += lines[j]
            calls[m.group(1)] = re.findall(r"\$OUT/parts/([A-Za-z_.]+)", cmd)
    outs = {name: subprocess.run(["bash", "-c", f"{func}\noutputs {name}"], capture_output=True, text=True,
                                 check=True).stdout.split() for name in calls}
    for name, written in calls.items():
        assert written, name
        for w in written:
            assert any(o == w or (w.endswith("_") and o.startswith(w)) for o in outs[name]), (name, w, outs[name])
    every = [o for v in outs.values() for o in v]
    assert len(every) == len(set(every)), outs


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_to_the_campaign_stops_its_running_part_and_prints_the_table(tmp_path, sig):
    """Ctrl-C or a kill to gpu_campaign.sh while a part runs: the part (timeout runs it in a process group of its own)
    went on running, after a SIGTERM with no campaign left to print a table. Now the script stops the part's whole
    group, runs no later part (named NOT RUN), prints the table and exits 128 + the signal's number; no process of
    the call is left (ps)."""
    import signal
    import time

    proc = campaign(tmp_path, "--parts", "attn,host", LIMIT_attn="600")
    log, mine = tmp_path / "c" / "log.txt", str(tmp_path / "c")

    def running() -> list[int]:
        ps = subprocess.run(["ps", "-ww", "-eo", "pid=,args="], capture_output=True, text=True, check=True).stdout
        return [int(ln.split()[0]) for ln in ps.splitlines() if mine in ln and "attn_windows.py" in ln
                and "timeout" not in ln]

    try:
        t0 = time.monotonic()
        while not (log.is_file() and "part attn (limit" in log.read_text() and running()):
            assert proc.poll() is None and time.monotonic() - t0 < 120, "the attn part never started"
            time.sleep(0.2)
        time.sleep(1)
        os.kill(proc.pid, getattr(signal, sig))
        out = proc.communicate(timeout=60)[0]
        time.sleep(0.5)
        left = subprocess.run(["ps", "-ww", "-eo", "pid=,args="], capture_output=True, text=True).stdout
        survivors = [ln for ln in left.splitlines() if mine in ln]
        assert not survivors, survivors
    finally:
        for pid in running():  # what a failure left behind, ours by its --out
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 128 + getattr(signal, sig), out[-2000:]
    table = (tmp_path / "c" / "campaign.md").read_text()
    assert out.rstrip().endswith(table.rstrip().splitlines()[-1])
    assert "- part attn: rc 143 in " in table and f"(STOPPED by {sig})" in table, table
    assert f"- part host: NOT RUN (the campaign was stopped by {sig})" in table


def test_a_signal_just_before_a_part_starts_stops_that_part(tmp_path):
    """A SIGTERM that lands after the part's NOT-RUN check but before its process is known to the script (here while
    a `stat` on PATH that sleeps 3 s measures the log, the last step before the start) found no part to stop: the
    part then ran to its end (rc 0) and only later parts were named NOT RUN. The part is now stopped at its start."""
    import signal
    import time

    shim = tmp_path / "bin"
    shim.mkdir()
    real = subprocess.run(["bash", "-c", "command -v stat"], capture_output=True, text=True, check=True).stdout.strip()
    (shim / "stat").write_text(f"#!/bin/sh\nsleep 3\nexec {real} \"$@\"\n")
    (shim / "stat").chmod(0o755)
    proc = campaign(tmp_path, "--parts", "attn,host", LIMIT_attn="600", PATH=f"{shim}:{os.environ['PATH']}")
    log, mine = tmp_path / "c" / "log.txt", str(tmp_path / "c")
    try:
        t0 = time.monotonic()
        while not (log.is_file() and "part attn (limit" in log.read_text()):
            assert proc.poll() is None and time.monotonic() - t0 < 120, "the attn part never started"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
        time.sleep(0.5)
        left = subprocess.run(["ps", "-ww", "-eo", "pid=,args="], capture_output=True, text=True).stdout
        assert not [ln for ln in left.splitlines() if mine in ln]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        ps = subprocess.run(["ps", "-ww", "-eo", "pid=,args="], capture_output=True, text=True).stdout
        for ln in ps.splitlines():  # what a failure left behind, ours by its --out
            if mine in ln and "attn_windows.py" in ln:
                os.kill(int(ln.split()[0]), signal.SIGKILL)
    assert proc.returncode == 143, out[-2000:]
    table = (tmp_path / "c" / "campaign.md").read_text()
    assert "- part attn: rc 143 in " in table and "(STOPPED by SIGTERM)" in table, table
    assert "- part host: NOT RUN (the campaign was stopped by SIGTERM)" in table


def test_torch_compats_summary_counts_a_part_the_campaign_did_not_run_as_not_run(tmp_path):
    """scripts/torch_compat.sh's summary of a campaign a signal stopped: a part named NOT RUN (its status has rc null)
    was counted among the parts that ran and listed as failed with 'rc None (the traceback is in ...)'; it is now
    counted as not run, with the campaign's reason, and a part the signal stopped says so instead of a traceback."""
    import re

    text = (ROOT / "scripts" / "torch_compat.sh").read_text()
    summary = re.search(r"python3 - \"\$OUT\" \"\$PARTS\" <<'EOF'\n(.*?)\nEOF\n", text, re.S).group(1)
    parts = tmp_path / "parts"
    parts.mkdir()
    for s in ({"part": "attn", "rc": 0, "seconds": 3},
              {"part": "profile", "rc": 143, "seconds": 2, "last_line": "Terminated", "stopped": "SIGTERM"},
              {"part": "host", "rc": None, "seconds": 0, "not_run": "the campaign was stopped by SIGTERM"}):
        (parts / f"{s['part']}.status.json").write_text(json.dumps(s))
    out = subprocess.run(["python3", "-c", summary, str(tmp_path), "attn,profile,host,flex"], capture_output=True,
                         text=True)
    assert out.returncode == 1, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "torch_compat: 2 of the campaign's 4 parts ran at smoke size, 1 failed", lines
    assert "  profile: rc 143 (stopped by SIGTERM)" in lines, lines
    assert "  host: did not run (the campaign was stopped by SIGTERM)" in lines, lines
    assert f"  flex: did not run (see {tmp_path}/log.txt)" in lines, lines
