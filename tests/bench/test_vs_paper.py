"""snlp bench --vs-paper against the paper's own code (nanochat-snlp). The code is the user's checkout, never
vendored: these tests use the copy beside the repository (../shared/anchors/nanochat-snlp, present in CI) or
$SNLP_PAPER_CODE, and skip, saying so, on a clone with nothing beside it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from snlp.bench.paper_peer import load_paper_code

ROOT = Path(__file__).resolve().parents[2]
CANDIDATES = [os.environ.get("SNLP_PAPER_CODE", ""), str(ROOT / ".paper" / "nanochat-snlp"),
              str(ROOT.parent / "shared" / "anchors" / "nanochat-snlp")]
PAPER = next((p for p in CANDIDATES if p and (Path(p) / "nanochat" / "gpt.py").is_file()), None)
needs_paper = pytest.mark.skipif(PAPER is None, reason="no checkout of the paper's code beside the repository "
                                                       "(../shared/anchors/nanochat-snlp or $SNLP_PAPER_CODE)")


def test_a_folder_that_is_not_the_papers_code_is_refused_before_any_import(tmp_path):
    import torch

    with pytest.raises(ValueError, match="not a checkout of the paper's code"):
        load_paper_code(str(tmp_path), torch.float32)


@pytest.mark.parametrize("body", ["", "import a_module_this_checkout_lacks\n"])
def test_a_folder_with_the_files_but_not_the_papers_code_is_one_line(body, tmp_path):
    """A folder holding files of the paper's names (empty, or one that does not import) crashed with a KeyError
    traceback ('nanochat.common'), after the timing note, or failed every shape as a run failure. It is one line now,
    before any timing. In a fresh process: the folder's `nanochat` must not stay imported beside the real one."""
    import subprocess
    import sys

    for f in ("nanochat/__init__.py", "nanochat/gpt.py", "nanochat/jacobi_forward.py", "snlp/inference_idn.py",
              "snlp/inference_hcn.py"):
        (tmp_path / "p" / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "p" / f).write_text(body if f.endswith("jacobi_forward.py") else "")
    run = subprocess.run([sys.executable, "-m", "snlp.apps.cli", "bench", "--vs-paper", str(tmp_path / "p"), "--quick",
                          "--device", "cpu", "--threads", "1", "--treatments", "eager", "--out", str(tmp_path / "o")],
                         capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    err = [ln for ln in run.stderr.splitlines() if ln.strip()]
    assert run.returncode == 2 and len(err) == 1, run.stderr
    assert ("lacks nanochat.common.COMPUTE_DTYPE" if not body else "does not import here: ModuleNotFoundError") in err[0]
    assert not (tmp_path / "o").exists()


def test_cli_refuses_bad_vs_paper_input_in_one_line(tmp_path, capsys):
    from snlp.apps.cli import main

    assert main(["bench", "--vs-paper", str(tmp_path), "--suite", "paper", "--device", "cpu"]) == 2
    assert "two runs" in capsys.readouterr().err
    assert main(["bench", "--vs-paper", str(tmp_path), "--device", "cpu", "--out", str(tmp_path / "o")]) == 2
    assert "not a checkout of the paper's code" in capsys.readouterr().err
    assert main(["bench", "--vs-paper", str(tmp_path), "--device", "cpu", "--shapes", "7B"]) == 2
    assert "unknown shape" in capsys.readouterr().err
    for flag in ("--suite-tokens", "--suite-runs"):  # 0 is refused, not taken for the default
        assert main(["bench", "--vs-paper", str(tmp_path), "--device", "cpu", flag, "0"]) == 2
        assert "must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("flag", [["--tokens", "64"], ["--runs", "9"], ["--compile"], ["--plans", "2xF1-h0-K1"],
                                  ["--no-decode"], ["--suite-new-tokens", "5"], ["--depth", "4"], ["--ckpt", "x"],
                                  ["--dtype", "bfloat16"]])
def test_flags_vs_paper_does_not_read_are_refused_before_any_import(flag, tmp_path, capsys):
    """--vs-paper reads --shapes, --quick, --treatments, --suite-tokens/-warmup/-runs, --no-ablations (and --device,
    --threads, --seed): the forward benchmark's --tokens, --runs, --compile, --plans, the suite's decode flags and a
    dtype other than the paper code's own were accepted and changed nothing. Each is refused in one line, before the
    path is even looked at (tmp_path is no checkout: that refusal would come later)."""
    from snlp.apps.cli import main

    assert main(["bench", "--vs-paper", str(tmp_path), "--device", "cpu", "--out", str(tmp_path / "o"), *flag]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag[0] in err and "not a checkout" not in err, err
    assert not (tmp_path / "o").exists()


def test_vs_paper_runs_each_shape_once_and_refuses_an_empty_shape_list(tmp_path, capsys):
    """--shapes 0.5B,0.5B timed the shape twice (its rows twice in the JSON, the table reading the first); --shapes ","
    ran the three default shapes. A repeat now runs once and an empty list is refused, before any import."""
    from snlp.apps.cli import main
    from snlp.bench.vs_paper import VsPaperConfig

    assert VsPaperConfig(paper="x", device="cpu", shapes=("0.5B", "0.5B-mhc", "0.5B")).resolved().shapes == \
        ("0.5B", "0.5B-mhc")
    assert main(["bench", "--vs-paper", str(tmp_path), "--device", "cpu", "--shapes", ",", "--out",
                 str(tmp_path / "o")]) == 2
    assert "--shapes names no shape" in capsys.readouterr().err
    assert main(["bench", "--suite", "paper", "--quick", "--device", "cpu", "--shapes", ",", "--out",
                 str(tmp_path / "s")]) == 2  # the paper suite read "," as all four shapes
    assert "--shapes names no shape" in capsys.readouterr().err and not (tmp_path / "s").exists()


@pytest.mark.parametrize("quick", [True, False])
def test_a_quick_vs_paper_table_marks_its_rows_smoke_and_the_papers_column_full_shape(quick):
    """Under --quick (width 64) the table set "16xF1-h0-K1-hcn ... 1.61x" beside the paper's 1.60x as if it were a
    reproduction. As in the paper suite's table, its rows now read "SHAPE (smoke)" and the paper's column "(full
    shape)"; a full run keeps both plain. Fabricated rows (no paper code needed)."""
    from snlp.bench.paper_peer import summarise
    from snlp.bench.vs_paper import VsPaperConfig, VsPaperResult, markdown

    cfg = VsPaperConfig(paper="unused", device="cpu", quick=quick, shapes=("0.5B-mhc",), runs=2, warmup=0).resolved()
    plan = "16xF1-h0-K1-hcn"
    meta = {f"{side}/{p}": (side, p, "as published" if side == "paper" else "eager", "")
            for side in ("paper", "snlp") for p in ("sequential", plan)}
    res = VsPaperResult(config=cfg, meta=dict(weights="random", dtype="float32", device="cpu", torch="t", cuda=None,
                                              date="d", paper_root="p", paper_stubs=[]), complete=True,
                        rows=summarise("0.5B-mhc", {name: [2.0, 2.0] for name in meta}, meta))
    text = markdown(res)
    row = next(ln for ln in text.splitlines() if f"`{plan}`" in ln and "1.60x" in ln)
    assert row.startswith("| 0.5B-mhc (smoke) |" if quick else "| 0.5B-mhc |"), row
    assert ("| paper's table (full shape) |" in text) == quick and ("| paper's table |" in text) != quick


@pytest.mark.parametrize("notes,says", [
    (("stacks the chunk weights inside every call", "the plan's own function"), "compute the plans' own functions"),
    (("drops the sliding windows in the suffix (full causal attention); stacks the chunk weights inside every call",
      "drops the value embeddings in fused chunks"), "drops the sliding windows in the suffix (full causal "
     "attention); drops the value embeddings in fused chunks (each")])
def test_the_table_footnote_on_the_papers_paths_follows_from_their_notes(notes, says):
    """The footnote said "The paper's parallel paths compute a different function ... (windows dropped in the suffix;
    value embeddings too in fused chunks)" in every run: also where its correctness table showed every path
    agreeing with snlp's plan (0.5B w/o x0ve, --suite-tokens 100: no value embeddings, windows of 128 that do not
    bite; the notes "the plan's own function"). It now says what the timed paths' notes say. Fabricated rows."""
    from snlp.bench.paper_peer import summarise
    from snlp.bench.vs_paper import VsPaperConfig, VsPaperResult, markdown

    cfg = VsPaperConfig(paper="unused", device="cpu", quick=True, shapes=("0.5B-nox0ve",), runs=1, warmup=0).resolved()
    plans = ("12xF2-h0-K1", "1xF12-h0-K1")
    meta = {"paper/sequential": ("paper", "sequential", "as published", "fp32 weights cast per Linear call"),
            **{f"paper/{p}": ("paper", p, "as published", f"its parallel path: {n}") for p, n in zip(plans, notes)}}
    res = VsPaperResult(config=cfg, meta=dict(weights="random", dtype="float32", device="cpu", torch="t", cuda=None,
                                              date="d", paper_root="p", paper_stubs=[]), complete=True,
                        rows=summarise("0.5B-nox0ve", {name: [1.0] for name in meta}, meta))
    foot = next(ln for ln in markdown(res).splitlines() if ln.startswith("*paper ms / snlp ms*"))
    assert says in foot and "value embeddings too" not in foot, foot
    assert "stacks" not in foot  # a cost of the path, not another function


def test_the_vs_paper_help_states_its_own_defaults(monkeypatch):
    """--vs-paper's help pointed at --suite-tokens / -warmup / -runs, whose help states the paper suite's defaults (200
    runs on cuda, 5 on cpu, T = 16 quick); --vs-paper resolves others. Its help now states the ones it resolves."""
    import argparse
    import re

    import torch

    from snlp.apps.bench import add_arguments
    from snlp.bench.vs_paper import VsPaperConfig

    p = argparse.ArgumentParser()
    add_arguments(p)
    text = " ".join(next(a.help for a in p._actions if a.dest == "vs_paper").split())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    gpu, cpu = (VsPaperConfig(paper="x", device=d).resolved() for d in ("cuda", "cpu"))
    quick = VsPaperConfig(paper="x", device="cpu", quick=True).resolved()
    assert f"--suite-tokens {gpu.tokens} ({quick.tokens} --quick)" in text and cpu.tokens == gpu.tokens, text
    assert f"--suite-warmup {gpu.warmup} and --suite-runs {gpu.runs} on cuda, {cpu.warmup} and {cpu.runs} on cpu" in text
    assert re.search(r"--shapes the three 0\.5B", text) and all(k.startswith("0.5B") for k in cpu.shapes)


@needs_paper
@pytest.mark.slow  # ~50 s: both codebases' quick suite, every plan (a bare clone skips it: no paper checkout)
def test_quick_vs_paper_agrees_where_the_functions_agree_and_names_the_approximation(tmp_path):
    """Same weights (the paper model's, mapped by snlp.io.nanochat), same tokens, fp32 on the CPU: every plan agrees
    with the paper's path to round-off on a window-free model (M = 1 with value embeddings, fused chunks without them,
    static mHC with HCN), and where the published windows bite the paper's path differs and the report says why."""
    from snlp.bench.vs_paper import AGREE_TOL, VsPaperConfig, run_vs_paper

    res = run_vs_paper(VsPaperConfig(paper=PAPER, quick=True, treatments=("eager",), ablations=False, runs=1,
                                     warmup=0, out=str(tmp_path)))
    assert not res.failures, res.failures
    assert {r.side for r in res.rows} == {"paper", "snlp"}
    free = [a for a in res.agreement if a.windows == "L"]
    windowed = [a for a in res.agreement if a.windows == "SSSL"]
    assert free and all(a.same_function and a.paper_vs_snlp <= AGREE_TOL * a.logit_scale and a.why == "-" for a in free)
    assert windowed and all(not a.same_function and "drops the sliding windows" in a.why for a in windowed
                            if not a.plan.endswith("-causal"))
    causal = [a for a in windowed if a.plan.endswith("-causal")]  # the paper's full-causal suffix, named
    assert causal and all(a.same_function == (a.why == "-") for a in causal), [(a.plan, a.why) for a in causal]
    assert any(a.same_function for a in causal)
    assert {r.variant for r in res.rows if r.side == "snlp" and r.variant.startswith("causal")} == {"causal (eager)"}
    data = json.loads((tmp_path / "vs_paper.json").read_text())
    assert len(data["agreement"]) == len(res.agreement) and "Correctness" in (tmp_path / "vs_paper.md").read_text()
    # one timed round resolves no ratio: every one the table prints is a tie, with its round in the JSON
    assert data["ratios"] and all(r["verdict"] == "tie" and len(r["rounds"]) == 1 for r in data["ratios"])
    assert all(len(r["times_ms"]) == 1 for r in data["rows"])


@needs_paper
def test_the_timing_tables_note_on_a_paper_path_says_what_that_path_does(tmp_path, monkeypatch):
    """The note beside each paper plan's timing said "no value embeddings, chunk weights stacked inside the call" for
    every fused plan: on the 0.5B w/o x0ve shape, which has no value embeddings, and for 1xF12, whose path
    (forward_idn_fused) uses chunk weights built once. It now names what applies: stacking for C x FM with C > 1
    only, value embeddings only where the model has them, windows where they bite. The timings are stand-ins."""
    from snlp.bench import vs_paper as V

    monkeypatch.setattr(V, "time_side_by_side", lambda fns, *a: {name: [1.0] for name in fns})
    monkeypatch.setattr(V, "agreement", lambda *a, **k: [])
    res = V.run_vs_paper(V.VsPaperConfig(paper=PAPER, quick=True, shapes=("0.5B-nox0ve",), ablations=False,
                                         treatments=("eager",), runs=1, warmup=0, out=str(tmp_path)))
    notes = {r.plan: r.note for r in res.rows if r.side == "paper" and r.plan != "sequential"}
    assert set(notes) == {"12xF2-h0-K1", "12xF2-h0-K2", "1xF12-h0-K1"} and not res.failures, res.failures
    assert all("drops the sliding windows" in n and "value embeddings" not in n for n in notes.values()), notes
    assert "stacks the chunk weights" in notes["12xF2-h0-K1"] and "stack" not in notes["1xF12-h0-K1"], notes


@needs_paper
def test_treatments_compiled_alone_times_no_eager_snlp_rows(tmp_path, monkeypatch):
    """--treatments compiled timed snlp's eager rows (and their windows-off ablation) all the same: only "compiled" was
    ever read. Now snlp's eager rows run only when asked; the paper's rows are its own (eager) code either way. The
    compile is a stand-in (the callable itself) and the timings are too: what is tested is which rows run."""
    from snlp.bench import vs_paper as V

    monkeypatch.setattr(V, "compile_step", lambda fn, device: fn)
    monkeypatch.setattr(V, "time_side_by_side", lambda fns, *a: {name: [1.0] for name in fns})
    monkeypatch.setattr(V, "agreement", lambda *a, **k: [])
    for treatments in (("compiled",), ("eager", "compiled")):
        res = V.run_vs_paper(V.VsPaperConfig(paper=PAPER, quick=True, shapes=("0.5B-mhc",), treatments=treatments,
                                             runs=1, warmup=0, out=str(tmp_path)))
        snlp = {r.variant for r in res.rows if r.side == "snlp"}
        assert not res.failures and "compiled" in snlp, res.failures
        assert ("eager" in snlp and "windows off (eager)" in snlp) == ("eager" in treatments), (treatments, snlp)
        assert {r.variant for r in res.rows if r.side == "paper"} == {"as published", "windows off"}


@needs_paper
def test_every_disagreement_names_its_cause():
    """Shapes the CLI does not time, where the paper's forward_idn_fused (1 x FM) holds the backout layer and re-applies
    its block for K > 1: wherever paper and snlp disagree the report names why; where it names nothing they agree."""
    from dataclasses import replace

    import torch

    from snlp.bench import vs_paper as V
    from snlp.bench.suite import PAPER_SHAPES
    from snlp.method.plan import Plan

    cfg = V.VsPaperConfig(paper=PAPER, quick=True).resolved()
    code = load_paper_code(PAPER, torch.float32)
    shape = replace(PAPER_SHAPES[0], depth=6, width=64, head_dim=32, plans=("1xF4-h0-K1", "1xF4-h0-K2", "2xF2-h0-K1"))
    rows = V.agreement(code, shape, shape, [Plan.parse(p, 6) for p in shape.plans], cfg, 256, torch.device("cpu"))
    assert all(a.same_function == (a.why == "-") for a in rows), [(a.plan, a.windows, a.why) for a in rows]
    assert any("backout" in a.why for a in rows) and any("own output" in a.why for a in rows)


@needs_paper
def test_snlps_causal_plan_is_the_papers_windowed_path_where_it_computes_that_function():
    """On a windowed (SSSL), value-embedding-free model the paper's parallel paths run the suffix full causal: snlp's
    plain plan differs there (it keeps the windows), its `causal` plan gives the paper's logits within fp32 round-off
    wherever the report names no other approximation."""
    from dataclasses import replace

    import torch

    from snlp.bench import vs_paper as V
    from snlp.bench.suite import PAPER_SHAPES
    from snlp.method.plan import Plan

    cfg = V.VsPaperConfig(paper=PAPER, quick=True).resolved()
    code = load_paper_code(PAPER, torch.float32)
    base = next(s for s in PAPER_SHAPES if s.key == "0.5B-nox0ve")
    plans = ("6xF1-h0-K1", "6xF1-h0-K2", "3xF2-h0-K1", "2xF2-h0-K2", "4xF1-h0-K4")
    shape = replace(base, depth=8, width=64, head_dim=32, plans=plans)
    rows = V.agreement(code, shape, shape, [Plan.parse(p, 8) for p in plans], cfg, 256, torch.device("cpu"))
    sssl = {a.plan: a for a in rows if a.windows == "SSSL"}
    for p in plans:
        plain, causal = sssl[p], sssl[p + "-causal"]
        assert not plain.same_function and "drops the sliding windows" in plain.why, (p, plain)
        assert causal.why == "-" and causal.same_function, (p, causal)
        assert causal.paper_vs_snlp <= V.AGREE_TOL * causal.logit_scale
    assert all(not a.plan.endswith("-causal") for a in rows if a.windows == "L")  # nothing to drop there


@needs_paper
@pytest.mark.parametrize("pattern, T", [("SSSL", 256), ("SL", 256), ("L", 128)])
def test_training_flops_equal_the_papers_estimate_flops(pattern, T):
    """snlp's model FLOPs per token (snlp.train.flops, what MFU divides) on a copy of the paper's model equal the
    paper code's own estimate_flops, sliding windows charged their window, up to the smear gate's matmul, which
    it leaves out of its count (6 FLOPs per weight per token) and snlp counts as the matmul it runs."""
    from contextlib import nullcontext

    import torch

    from snlp.bench.paper_peer import build_paper_model, snlp_model_from_paper
    from snlp.train.flops import step_flops
    from snlp.train.job import TrainStep
    from snlp.train.regularizer import RegConfig

    code = load_paper_code(PAPER, torch.float32)
    cfg = code.gpt.GPTConfig(sequence_len=T, vocab_size=512, n_layer=4, n_head=2, n_kv_head=2, n_embd=64,
                             window_pattern=pattern)
    paper = build_paper_model(code, cfg, torch.device("cpu"))
    ours = snlp_model_from_paper(paper, "cpu", torch.float32).train()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 512, (2, T), generator=g), torch.randint(0, 512, (2, T), generator=g)
    got = step_flops(TrainStep(ours, RegConfig()), x, y, 0.0, nullcontext) / x.numel()
    assert got == paper.estimate_flops() + 6 * paper.smear_gate.weight.numel()


@needs_paper
def test_training_flops_of_an_mhc_model_are_the_papers_estimate_over_its_streams():
    """An mHC model: the paper code's estimate_flops multiplies its whole count by the stream count S ("each layer
    processes S x more samples"), but its width connection pools the S streams into ONE branch input per sublayer,
    so each block's matmuls run once per token (its own forward + backward under FlopCounterMode is under half its
    estimate); snlp counts what runs: the estimate over S, the smear gate, and the streams' mixing (H_res, S x S,
    and H_pre's pooling, S, over the D channels: matmuls, 6 FLOPs per coefficient and channel, per sublayer)."""
    from contextlib import nullcontext

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from snlp.bench.paper_peer import build_paper_model, snlp_model_from_paper
    from snlp.train.flops import step_flops
    from snlp.train.job import TrainStep
    from snlp.train.regularizer import RegConfig

    S, L, D, T, V = 4, 4, 64, 64, 128
    code = load_paper_code(PAPER, torch.float32)
    cfg = code.gpt.GPTConfig(sequence_len=T, vocab_size=V, n_layer=L, n_head=2, n_kv_head=2, n_embd=D,
                             window_pattern="SSSL", use_mhc=True, mhc_num_streams=S, no_x0_resid=True)
    paper = build_paper_model(code, cfg, torch.device("cpu"))
    ours = snlp_model_from_paper(paper, "cpu", torch.float32).train()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, V, (2, T), generator=g), torch.randint(0, V, (2, T), generator=g)
    got = step_flops(TrainStep(ours, RegConfig()), x, y, 0.0, nullcontext) / x.numel()
    mixing = 2 * L * 6 * (S * S * D + S * D)
    assert got == paper.estimate_flops() // S + 6 * paper.smear_gate.weight.numel() + mixing
    with FlopCounterMode(display=False) as counter:
        paper(x, y).backward()
    assert counter.get_total_flops() / x.numel() < paper.estimate_flops() / 2


@needs_paper
def test_vs_paper_says_a_contended_window_and_records_it(tmp_path, capsys, monkeypatch):
    """The run's load window (snlp.runtime.load) in its JSON's meta and, where other work shared the cores, its one
    line in the markdown it prints. The shapes' timings are left out (the quick suite, `slow`, times them): the
    window and its line do not depend on them."""
    import snlp.bench.vs_paper as V
    import snlp.runtime.load as load
    from snlp.apps.cli import main

    monkeypatch.setattr(os, "getloadavg", lambda: (5.0, 5.0, 5.0))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(load, "CPU_MAX", str(tmp_path / "no-cpu.max"))
    monkeypatch.setattr(load, "CFS", (str(tmp_path / "no-quota"), str(tmp_path / "no-period")))
    monkeypatch.setattr(load, "machine_cpus", lambda: 2)
    monkeypatch.setattr(V, "_run_shape", lambda *a, **k: None)
    assert main(["bench", "--vs-paper", PAPER, "--quick", "--shapes", "0.5B-nox0ve", "--device", "cpu",
                 "--out", str(tmp_path / "o")]) == 0
    assert capsys.readouterr().out.count("timings contended: the 1-min load average reached 5.00 on 2 cores") == 1
    meta = json.loads((tmp_path / "o" / "vs_paper.json").read_text())["meta"]
    assert meta["load"] == {"start": 5.0, "end": 5.0, "peak": 5.0, "cores": 2, "machine_cpus": 2}


@needs_paper
def test_vs_paper_times_with_the_threads_its_oversubscription_line_names(tmp_path, capsys, monkeypatch):
    """The line said before timing names --threads 1 as the remedy: given, the shapes are timed with one thread
    (and the meta says so), rather than the flag being read by nothing."""
    import torch

    import snlp.bench.vs_paper as V
    import snlp.runtime.load as load
    from snlp.apps.cli import main

    monkeypatch.setattr(os, "getloadavg", lambda: (2.5, 2.5, 2.5))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(load, "CPU_MAX", str(tmp_path / "no-cpu.max"))
    monkeypatch.setattr(load, "CFS", (str(tmp_path / "no-quota"), str(tmp_path / "no-period")))
    seen = []
    monkeypatch.setattr(V, "_run_shape", lambda *a, **k: seen.append(torch.get_num_threads()))
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert main(["bench", "--vs-paper", PAPER, "--quick", "--shapes", "0.5B-nox0ve", "--device", "cpu",
                     "--out", str(tmp_path / "o")]) == 0
        assert "--threads 1 times with one" in capsys.readouterr().err  # 2.5 - 1 of other work on 2 cores: 0 free
        assert main(["bench", "--vs-paper", PAPER, "--quick", "--shapes", "0.5B-nox0ve", "--device", "cpu",
                     "--threads", "1", "--out", str(tmp_path / "o")]) == 0
    finally:
        torch.set_num_threads(n)
    assert seen == [2, 1] and "OpenMP" not in capsys.readouterr().err
    assert json.loads((tmp_path / "o" / "vs_paper.json").read_text())["meta"]["threads"] == 1


@needs_paper
def test_an_mhc_plan_of_fused_chunks_is_refused_naming_the_papers_path_for_it():
    """paper_plan_fn refused a C x FM mHC plan with "the paper's mHC-Newton path is C x F1 only"; the paper's
    evaluator runs such plans through forward_hcn_chunkwise. The refusal now names that path as not driven here."""
    import torch

    from snlp.bench.paper_peer import build_paper_model, paper_config, paper_plan_fn
    from snlp.bench.suite import PAPER_SHAPES
    from snlp.method.plan import Plan

    code = load_paper_code(PAPER, torch.float32)
    shape = next(s for s in PAPER_SHAPES if s.key == "0.5B-mhc").quick()
    model = build_paper_model(code, paper_config(code, shape, 64, 64, "L"), torch.device("cpu"))
    with pytest.raises(ValueError, match="forward_hcn_chunkwise") as err:
        paper_plan_fn(code, model, Plan.parse("8xF2-h0-K1-hcn", shape.depth), shape)
    assert "C x F1 only" not in str(err.value)
    assert paper_plan_fn(code, model, Plan.parse("16xF1-h0-K1-hcn", shape.depth), shape) is not None
