"""Every JSON file snlp writes parses with a strict JSON parser (jq, JavaScript's JSON.parse, Go, serde): no bare NaN /
Infinity, which Python's json writes and they refuse. Each writer runs on a record holding NaN and inf (a diverged
training run, a diverged evaluation plan, a speedrun summary with a diverged PPL, an adaptation result with NaN) and
its file is parsed with json.loads(parse_constant=<raise>), Python's strict mode; then each reader reads what the
writers wrote as it read NaN / inf before (a diverged row stays diverged: not 0, not a crash)."""

from __future__ import annotations

import copy
import io
import json
import math
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_speedrun import _rec, _report_ctx

SHAKESPEARE = Path(__file__).resolve().parents[1] / "data/tinyshakespeare-head.txt"


def refuse(name):
    raise ValueError(f"non-strict JSON constant {name}")


def strict(text: str):
    """json.loads as a strict parser reads: NaN, Infinity and -Infinity refused."""
    return json.loads(text, parse_constant=refuse)


def strict_lines(text: str) -> list:
    return [strict(line) for line in text.splitlines() if line.strip()]


def diverging_cfg(tmp_path, **kw):
    """A tiny training run whose learning rates blow the weights up: step 1's x0 scalars step by 1e38 (scalar LR), so
    step 2's loss is NaN, which the trainer logs and then raises FloatingPointError on (1-2 s on 2 cores). With the
    x0 scalars' LR at its default, the Muon and head LRs (1e30) make step 2's gradients NaN while its loss is still
    finite: test_a_nan_gradient_stops_the_run_before_anything_saves_it."""
    from snlp.train.config import TrainConfig

    data = tmp_path / "c.txt"
    if not data.exists():
        data.write_text(SHAKESPEARE.read_text()[:120_000])
    return TrainConfig(**{**dict(out=str(tmp_path / "run"), data=str(data), cache_dir=str(tmp_path / "cache"), depth=2,
                                 width=32, head_dim=16, vocab_size=300, seq_len=16, batch_size=2, steps=6,
                                 eval_every=100, eval_batches=1, no_progress=True, device="cpu", reg_n="1",
                                 matrix_lr=1e30, unembedding_lr=1e30, scalar_lr=1e38, log_every=1, grad_clip=0.0), **kw})


# ----- the writers -----
def write_training_log(tmp_path) -> list[Path]:
    from snlp.train.trainer import fit

    cfg = diverging_cfg(tmp_path)
    with pytest.raises(FloatingPointError, match="training loss became nan at step 2"):
        fit(cfg)
    return [Path(cfg.out) / "log.jsonl"]


def write_train_summary(tmp_path) -> list[Path]:
    """finish(): train_summary.json of a run whose last train loss is NaN and whose validation is inf."""
    from snlp.train.job import Job
    from snlp.train.trainer import LoopState, finish
    from snlp.train.validate import ValidationResult

    out = tmp_path / "run"
    out.mkdir()
    job = Job(model=None, tokenizer=None, batch=None, val_batches=[], loss=None, validate=None)  # finish reads its hooks
    run = SimpleNamespace(bar=None, t_start=time.perf_counter(), ctx=SimpleNamespace(master=True, world=1), out=out,
                          progress=SimpleNamespace(elapsed=1.5), interrupt=None, job=job)
    state = LoopState(step=3, tokens=96, train_loss=math.nan,
                      validation=ValidationResult(loss=math.inf, gaps={1: math.nan}), stopped_by="budget")
    res = finish(run, state, time.perf_counter())
    assert math.isnan(res.train_loss) and res.val_loss == math.inf  # the result keeps the floats
    return [out / "train_summary.json"]


def diverged_eval_rows() -> list[dict]:
    """A sequential row, a plan that diverged (PPL inf, note "diverged", no metric) and one whose PPL is NaN."""
    seq = _rec("sequential", 20.0, [1.0] * 3, 1.0, 1.0)
    div = _rec("12xF1-h0-K1", math.inf, [1.9, 2.0, 2.1], 0.5, 0.5)
    return [seq.to_dict(), {**div.to_dict(), "delta_ppl": math.inf, "note": "diverged", "top1": None},
            {**_rec("12xF1-h0-K4", math.nan, [1.1, 1.2, 1.3], 0.5, 0.5).to_dict(), "delta_ppl": math.nan}]


def write_stage_record(tmp_path) -> list[Path]:
    """The speedrun's stage record of an evaluation with a diverged plan (Stages.finish)."""
    from rich.console import Console

    from snlp.apps.speedrun.records import Stages

    stages = Stages(tmp_path, force=False, total=1, console=Console(file=io.StringIO()))
    stages.begin("eval-noreg", "evaluate")
    stages.finish("eval-noreg", {"plans": ["12xF1-h0-K1"]}, {"records": diverged_eval_rows()})
    return [stages.path("eval-noreg")]


def write_speedrun_summary(tmp_path) -> list[Path]:
    """summary.json's writer (snlp.apps.speedrun.records.write_json) on a summary with a diverged PPL, a training
    whose validation loss is NaN and an early exit at PPL inf."""
    from snlp.apps.speedrun.records import write_json

    summary = {"command": "snlp speedrun", "wall_seconds": 10.0, "budget_exceeded_s": None,
               "stages": {"eval-noreg": {"seconds": 1.0, "result": {"records": diverged_eval_rows()}},
                          "train-idn": {"seconds": 2.0, "result": {"val_loss": math.nan, "gap": math.nan}},
                          "early-exit": {"seconds": 3.0, "result": {"rows": {"noreg": [{"N": 4, "ppl": math.inf}]}}}}}
    write_json(tmp_path / "summary.json", summary)
    return [tmp_path / "summary.json"]


def adapt_result():
    from snlp.train.adapt import AdaptResult

    return AdaptResult(out="d", plan="2xF1-h0-K1", kv="exact", steps=2, tokens=64, minutes=0.1, stopped_by="budget",
                       before={"step": 0, "val_loss": math.nan, "top1": math.nan, "top1_ssd": 0.5},
                       after={"step": 2, "val_loss": math.inf, "top1": 0.25, "top1_ssd": math.nan})


def write_adapt_json(tmp_path) -> list[Path]:
    from snlp.apps.adapt import write_result

    write_result(tmp_path / "adapt.json", adapt_result())
    return [tmp_path / "adapt.json"]


def write_drafter_record(tmp_path) -> list[Path]:
    """drafter.json: the adaptation record (its validation before / after, NaN here) beside the drafter's weights."""
    import torch

    from snlp.io.drafter import save_drafter
    from snlp.method.drafter import make_drafter
    from conftest import make_model

    base = make_model(dtype=torch.float32, n_layer=3, n_embd=32, n_head=2, n_kv_head=2, vocab_size=40)
    save_drafter(tmp_path / "d", make_drafter(base, "2xF1-h0-K1"), adapt_result().to_dict())
    return [tmp_path / "d" / "drafter.json"]


def write_mc_json(tmp_path) -> list[Path]:
    """`snlp eval --task --json`: multiple-choice accuracy with a plan that diverges (the blow-up model)."""
    from snlp.apps.cli import main
    from snlp.io.checkpoint import save_checkpoint
    from snlp.io.tokenizer import Tokenizer
    from conftest import blowup_model

    task = tmp_path / "q.jsonl"
    task.write_text("".join(json.dumps(q) + "\n" for q in (
        {"question": "Which number is largest?", "choices": ["1", "7", "3"], "answer": 1},
        {"question": "Which one is a colour?", "choices": ["red", "dog", "ten"], "answer": 0})))
    tok = Tokenizer.train(["Which number is largest? Which one is a colour? red dog ten 1 7 3 A B C"] * 20, 300)
    ckpt = save_checkpoint(tmp_path / "m", blowup_model(tok.vocab_size, sequence_len=128), tokenizer=tok)
    assert main(["eval", str(ckpt), "--task", f"mc:{task}", "--plans", "8xF1-h0-K1-newton", "--mc-scoring", "letter",
                 "--json", str(tmp_path / "mc.json"), "--device", "cpu"]) == 0
    assert strict((tmp_path / "mc.json").read_text())["records"][1]["diverged"] is True
    return [tmp_path / "mc.json"]


def write_analysis(tmp_path) -> list[Path]:
    """analysis.json of a run whose sections' timings hold NaN and inf (every float of the result goes one way)."""
    from snlp.eval.analysis.common import AnalysisConfig
    from snlp.eval.analysis.report import AnalysisResult, environment, write

    res = AnalysisResult(checkpoint="x", config=AnalysisConfig(), environment=environment(),
                         seconds={"jacobian": math.nan, "ordering": math.inf})
    write(res, tmp_path / "a")
    return [tmp_path / "a" / "analysis.json"]


WRITERS = {"training log.jsonl of a diverged run": write_training_log,
           "train_summary.json, NaN train loss, inf val loss": write_train_summary,
           "speedrun stage record, a diverged eval plan": write_stage_record,
           "speedrun summary.json, a diverged PPL": write_speedrun_summary,
           "adapt --json, NaN validation": write_adapt_json,
           "drafter.json, NaN in its adaptation record": write_drafter_record,
           "eval --task --json, a diverged plan": write_mc_json,
           "analysis.json": write_analysis}


@pytest.mark.parametrize("writer", list(WRITERS))
def test_every_writer_writes_strict_json(writer, tmp_path):
    for path in WRITERS[writer](tmp_path):
        text = path.read_text()
        parsed = strict_lines(text) if path.suffix == ".jsonl" else [strict(text)]
        assert parsed, path


def test_the_diverged_training_row_is_null_and_reads_back_as_nan(tmp_path):
    """The log holds the diverged step's loss as null (its grad_norm too), and the log's readers (snlp.train's
    read_log, the speedrun's) give NaN back, as they gave the NaN Python's json wrote; mfu's null stays None."""
    from snlp.apps.speedrun.train import _log_state
    from snlp.train.checkpointing import read_log

    (log,) = write_training_log(tmp_path)
    rows = strict_lines(log.read_text())
    assert rows[-1]["step"] == 2 and rows[-1]["loss"] is None
    back = read_log(log)
    assert math.isnan(back[-1]["loss"]) and back[-1]["mfu"] is None and back[1]["loss"] == rows[1]["loss"]
    st = _log_state(log)  # the speedrun's live line: a NaN loss, formatted as such
    assert st["step"] == 2 and math.isnan(st["loss"]) and f"{st['loss']:.3f}" == "nan"


@pytest.mark.parametrize("clip", [1.0, 0.0])
def test_a_nan_gradient_stops_the_run_before_anything_saves_it(tmp_path, clip):
    """The step's gradient norm is measured, with gradient clipping or without (--grad-clip 0: it was not, so the
    check below never saw it): a NaN one (here at step 2, the loss still finite) made the weights NaN while the loop
    checked the logged loss only, so a run whose last step came next saved them with status 0 (`snlp sft
    --reg-lambda 1e300 --steps 1`; `snlp train --grad-clip 0 --reg idn --reg-lambda 1e300 --steps 1`). The run now
    stops at that step, before any save, and the log's row holds the NaN norm as null."""
    from snlp.train.trainer import fit

    cfg = diverging_cfg(tmp_path, grad_clip=clip, steps=2, scalar_lr=0.5)
    with pytest.raises(FloatingPointError, match="training gradient norm became nan at step 2"):
        fit(cfg)
    rows = strict_lines((Path(cfg.out) / "log.jsonl").read_text())
    assert rows[-1]["step"] == 2 and rows[-1]["grad_norm"] is None and rows[-1]["loss"] is not None
    assert not (Path(cfg.out) / "model.safetensors").exists()


def test_a_diverged_step_off_log_every_has_its_row_in_the_log(tmp_path):
    """A run that diverges ends on the diverged step as a stopped run does; its row (the NaN loss, null) is in the
    log off --log-every too, as the last trained step's row always is: the default --log-every 10 left step 2's row
    out, so the log ended at step 1's finite loss. Reference: the same run logged at every step (log_every 1)."""
    from snlp.train.trainer import fit

    rows = {}
    for every in (1, 10):
        (tmp_path / str(every)).mkdir()
        cfg = diverging_cfg(tmp_path / str(every), log_every=every)
        with pytest.raises(FloatingPointError, match="training loss became nan at step 2"):
            fit(cfg)
        rows[every] = [r for r in strict_lines((Path(cfg.out) / "log.jsonl").read_text()) if "loss" in r]
    assert [r["step"] for r in rows[10]] == [r["step"] for r in rows[1]] == [1, 2]
    assert rows[10][-1]["loss"] is None and rows[10][-1]["loss"] == rows[1][-1]["loss"]


def test_resuming_a_run_whose_log_has_a_null_loss(tmp_path):
    """A run saved at step 1 (--stop-after 1, finite weights), resumed: it diverges at step 2 and dies there, its log
    ending in the null loss of step 2 after the save. A second --resume drops the dead leg's rows after the save
    (trim_log reads the strict rows), runs step 2 again and diverges again at the same step, as it did: one
    step-2 row, with a null loss, every row strict."""
    import dataclasses

    from snlp.train.checkpointing import read_log
    from snlp.train.trainer import fit

    first = fit(diverging_cfg(tmp_path, stop_after=1))
    assert first.steps == 1 and math.isfinite(first.train_loss)
    cfg = dataclasses.replace(diverging_cfg(tmp_path), resume=True)
    log = Path(cfg.out) / "log.jsonl"
    for _ in range(2):
        with pytest.raises(FloatingPointError, match="loss became nan at step 2"):
            fit(cfg)
        rows = strict_lines(log.read_text())
        assert [r["step"] for r in rows if "loss" in r] == [1, 2] and rows[-1]["loss"] is None
        assert math.isnan(read_log(log)[-1]["loss"])


# ----- the speedrun report from records read back -----
class _Stage:
    def __init__(self, d):
        self.result = d["result"]


def _diverged_ctx() -> dict:
    """_report_ctx with what a diverged run leaves: the IDN model's `12xF1-h0-K4` diverged (PPL inf, no metric) and
    `1xF12-h0-K1`'s PPL NaN, the IDN training's validation loss and final gap NaN (val curve too), the early exit's
    PPL inf (No Reg.) and NaN (IDN Reg.), an SSD row that drafted nothing (alpha NaN), and an off-the-shelf stage whose
    plan diverged and whose drafter adaptation logged NaN / inf validation figures (its post-hoc drafter's alpha
    NaN)."""
    from snlp.apps.speedrun.evaluate import eval_records

    ctx = _report_ctx()
    st = ctx["stages"]
    recs = st["eval-idn"]["result"]["records"]
    for r in recs:
        if r["plan"] == "12xF1-h0-K4":
            r.update(ppl=math.inf, delta_ppl=math.inf, note="diverged", top1=None, logit_sim=None, ar_match=None,
                     ar_beta=None, emb_sim=None)
        if r["plan"] == "1xF12-h0-K1":
            r.update(ppl=math.nan, delta_ppl=math.nan)
    st["train-idn"]["result"] = {**st["train-idn"]["result"], "val_loss": math.nan, "gap": math.nan,
                                 "val_curve": [[0, 5.0, 0.5], [130, math.nan, math.nan]]}
    st["early-exit"]["result"]["rows"] = {"noreg": [{"N": 4, "seq_layers": 12, "ppl": math.inf}],
                                          "idn": [{"N": 4, "seq_layers": 12, "ppl": math.nan}]}
    st["ssd-noreg"]["result"]["rows"][0] = {**st["ssd-noreg"]["result"]["rows"][0], "alpha": math.nan}
    ssd = {"alpha": math.nan, "measured_speedup": math.nan, "matches_sequential": True, "repeats": 3, "prompts": 2,
           "gen_tokens": 16}
    adaptation = {"minutes": 0.5, "plan": "8xF1-h0-K1", "steps": 10, "tokens": 5120, "block": 4,
                  "before": {"step": 0, "val_loss": math.nan, "top1": math.nan, "top1_ssd": 0.25, "mfu": None},
                  "after": {"step": 10, "val_loss": math.inf, "top1": 0.5, "top1_ssd": math.nan, "mfu": None},
                  "ssd": {"post-hoc": dict(ssd), "adapted": {**ssd, "alpha": 0.5, "measured_speedup": 1.1}}}
    st["off-the-shelf"] = dict(st["diagnostics"], result={
        "model": "SmolLM2-135M-Instruct.Q4_1.gguf", "n_layer": 30, "params": 134_515_008,
        "records": [_rec("sequential", 9.06, [1.0] * 3, 1.0, 1.0).to_dict(),
                    {**_rec("8xF1-h0-K1", math.inf, [1.1, 1.2, 1.0], 0.0, 0.0).to_dict(), "note": "diverged",
                     "delta_ppl": math.inf, "top1": None}],
        "adaptation": adaptation})
    ctx["order"] = [*ctx["order"][:-3], "off-the-shelf", *ctx["order"][-3:]]
    ctx["ran"] = ctx["order"]
    ctx["evals"] = {k: eval_records(_Stage(st[f"eval-{k}"])) for k in ("noreg", "idn")}
    return ctx


def test_the_report_from_records_read_back_says_what_the_floats_said(tmp_path):
    """The speedrun writes each stage's record as strict JSON and a re-run reads it back (Stages.lookup) for the
    report: every report formatter takes the null and "inf" they hold where it took NaN and inf, and the report is the
    one made from the floats, the diverged plan still diverged."""
    from snlp.apps.report import render_report
    from snlp.apps.speedrun.evaluate import eval_records
    from snlp.apps.speedrun.records import StageRecord, read_json, write_json

    ctx = _diverged_ctx()
    want = render_report(copy.deepcopy(ctx))
    back = copy.deepcopy(ctx)
    for name, rec in ctx["stages"].items():
        write_json(tmp_path / f"{name}.json", {**rec, "stage": name, "settings": rec.get("settings", {}), "id": "x"})
        strict((tmp_path / f"{name}.json").read_text())
        got = StageRecord.from_json(read_json(tmp_path / f"{name}.json"))
        back["stages"][name] = got.to_json()
    assert back["stages"]["eval-idn"]["result"]["records"][2]["ppl"] == "inf"  # as the file holds it
    assert back["stages"]["train-idn"]["result"]["val_loss"] is None
    back["evals"] = {k: eval_records(_Stage(back["stages"][f"eval-{k}"])) for k in ("noreg", "idn")}
    div = next(r for r in back["evals"]["idn"] if r.plan == "12xF1-h0-K4")
    assert div.ppl == math.inf and div.delta_ppl == math.inf and div.note == "diverged"
    assert math.isnan(next(r for r in back["evals"]["idn"] if r.plan == "1xF12-h0-K1").ppl)
    got = render_report(back)
    assert got == want
    assert "| `12xF1-h0` | 4 | diverged | diverged |" in got  # the main table's row (PPL, ΔPPL)
    assert "| 12xF1-h0-K4 (diverged) | 4 | diverged | diverged |" in got  # the IDN model's own table
    assert "| 4 | 12 | diverged | - |" in got  # the early exit at PPL inf
    assert "Top-1 agreement with the model nan % -> 50.0 %" in got  # the adaptation's NaN, printed as the float was
    assert "acceptance alpha nan -> 0.500" in got


def test_every_float_field_of_an_eval_record_reads_back_from_strict_json():
    """EvalRecord.from_dict reads what to_dict wrote through json_text for every field: an inf of any float field
    ("inf" on disk) is the float inf again, not the string, which the tables' formats refused ("Unknown format code
    'f' for object of type 'str'"); -inf likewise; a string field keeps its text."""
    import dataclasses

    from snlp.eval.present import markdown_table
    from snlp.eval.protocol import EvalRecord
    from snlp.runtime.outputs import json_text

    floats = [f.name for f in dataclasses.fields(EvalRecord) if "float" in str(f.type) and "list" not in str(f.type)]
    assert {"ppl", "top1", "speedup", "prefill_speedup", "latency_ms", "ideal_layer_speedup"} <= set(floats)
    for value in (math.inf, -math.inf):
        rec = EvalRecord(plan="4xF1-h0-K1", K=1, S=0, C=4, M=1, init="h0", note="inf", device="inf",
                         **{k: value for k in floats})
        back = EvalRecord.from_dict(strict(json_text(rec.to_dict())))
        assert back == rec, [k for k in floats if getattr(back, k) != value]
        assert back.note == "inf" and back.device == "inf"  # text stays text
        markdown_table([back])  # the table formats them as it formats the floats


# ----- one CSV cell rule -----
def test_both_csv_writers_write_one_cell_rule(tmp_path):
    """snlp.bench.records.write_csv and snlp.eval.present.write_csv write the same cells for the same rows: a list or
    dict as strict JSON (a NaN inside null, an inf "inf"), a NaN or None cell empty, an inf as inf."""
    import csv

    from snlp.bench.records import write_csv as bench_csv
    from snlp.eval.present import write_csv as present_csv

    rows = [{"plan": "a", "ppl": math.inf, "top1": math.nan, "rounds": [1.0, math.nan, math.inf],
             "load": {"start": math.nan}, "note": None},
            {"plan": "b", "ppl": 2.5, "top1": 0.5, "rounds": [1.0], "load": {"start": 0.5}, "note": "x"}]

    class Row:
        def __init__(self, d):
            self.d = d

        def to_dict(self):
            return self.d

    bench_csv(tmp_path / "b.csv", [Row(r) for r in rows], announce=False)
    present_csv(rows, tmp_path / "p.csv", announce=False)
    assert (tmp_path / "b.csv").read_text() == (tmp_path / "p.csv").read_text()
    got = list(csv.DictReader(io.StringIO((tmp_path / "b.csv").read_text())))
    assert got[0]["top1"] == "" and got[0]["note"] == "" and float(got[0]["ppl"]) == math.inf
    assert strict(got[0]["rounds"]) == [1.0, None, "inf"] and strict(got[0]["load"]) == {"start": None}
    assert strict(got[1]["rounds"]) == [1.0] and got[1]["top1"] == "0.5"
