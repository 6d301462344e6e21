"""Choose the decoding plan for a checkpoint on this machine by measurement (snlp.bench.tune).

Two goals: exact self-speculative decoding (SSD: the plan, draft block B, threads and compile that maximise
measured tokens/s; every measured candidate's greedy output is checked against sequential decoding) and, with
--max-dppl, SNLP decoding under a quality budget (the fastest plan whose calibration PPL is within the budget of
sequential's). Stage 1 measures every plan's teacher-forced Top-1 / PPL on the checkpoint's validation text and
its SSD acceptance profile (a short greedy speculative decode at the largest B), and times the decode steps on
this device (cached single-token steps, the verifier over B+1 positions), predicting each (plan, B); stage 2 decodes
the --top best-predicted plans (SSD: each at its 2 best blocks) end to end in ONE round-robin after one sequential baseline per setting, after a warm-up
(medians), and picks the best MEASURED where the paired rounds resolve its lead (a two-sided sign test; else the best
stage-1 prediction among the candidates they do not separate from it, or the best measured where those
predictions are within 2 % of each other too: snlp.bench.tune.pick, and the summary says which rule made the pick).
Prints the measured table (predicted vs measured) and the pick; --json writes every record. --full-grid measures every candidate and reports the pick against the grid's best
(without it that validation is not run: the JSON records grid_best and pick_vs_best as null).

    snlp tune runs/speedrun/idn                         # SSD, default grid (12 plans at L = 16) x B = 2,3,4,6,8
    snlp tune runs/speedrun/idn --max-dppl 1% --threads 1,2  # also SNLP within +1 % PPL; 1 and 2 torch threads
"""

from __future__ import annotations

import math
import sys
from types import SimpleNamespace

from snlp.bench.stats import fewest_sign_rounds
from snlp.runtime.outputs import complete_in

SUMMARY = "Choose the decoding plan for a checkpoint on this machine by measurement."
DESCRIPTION = """\
Goal (a), exact self-speculative decoding: the plan, draft block B, threads and compile with the highest measured
tokens/s (every candidate's greedy output is checked against sequential decoding). Goal (b), with --max-dppl: the
fastest SNLP decoding within that PPL budget. Stage 1 predicts every candidate from cheap measurements; stage 2
decodes the --top best-predicted plans end to end (SSD: each at its 2 best blocks), round-robin with sequential
decoding, and picks the best measured one. Prints the
table (predicted vs measured) and the pick; minutes on a CPU.

  snlp tune runs/speedrun/idn                        # SSD: 12 plans (15 on CUDA) x B = 2,3,4,6,8
  snlp tune runs/speedrun/idn --max-dppl 1% --threads 1,2 # also SNLP within +1 % PPL; 1, 2 threads
  snlp tune runs/speedrun/idn --full-grid --json tune.json  # every candidate measured
"""
GUIDE = "docs/usage.md#tune-choose-the-plan-by-measurement"
LOCK_OUTPUTS = True  # a second run writing one of its output paths is refused (snlp.apps.cli.output_locks)

# a stand-in for TuneConfig's defaults: the library (and torch) loads in run(), after the flags are parsed, so --help
# answers at once (tests/apps/test_cli_fast.py checks that they agree)
TUNE_DEFAULTS = SimpleNamespace(blocks=(2, 3, 4, 6, 8), top=3, calib_tokens=8192, seq_len=None, prompts=4,
                                prompt_len=16, gen_tokens=64, repeats=6, warmup=1, step_runs=30, accept_tokens=64,
                                seed=0)


def add_arguments(p) -> None:
    d = TUNE_DEFAULTS
    p.add_argument("ckpt", help="checkpoint directory (snlp train --out / snlp.save_checkpoint)")
    p.add_argument("--plans", default=None, help="comma-separated candidate plans (default: 12 plans on suffixes "
                   "of L/4, L/2, 3L/4 layers: F1-h0-K1, F1-h0-K2, F1-fwd-K1, F2-h0-K1; on CUDA also LxF1-h0-K2, -K3, -K4)")
    p.add_argument("--blocks", default=",".join(map(str, d.blocks)), help="SSD draft block sizes B")
    p.add_argument("--threads", default=None, help="comma-separated torch thread counts to measure (default: the "
                   "current count)")
    p.add_argument("--compile", action="store_true", help="also measure compiled static-shape steps (compile time "
                   "is spent once per plan and setting, never timed)")
    p.add_argument("--max-dppl", default=None, help="goal (b): SNLP decoding within this PPL increase over "
                   "sequential, e.g. 1%% or 0.01")
    p.add_argument("--no-ssd", action="store_true", help="skip goal (a), exact SSD (needs --max-dppl)")
    p.add_argument("--top", type=int, default=d.top, help="plans per goal measured end to end (stage 2), "
                   "SSD ones at their 2 best-predicted blocks, plus each setting's best plan")
    p.add_argument("--full-grid", action="store_true", help="measure every candidate end to end: the pick vs the "
                   "best of the grid (validation)")
    m = p.add_argument_group("measurement")
    m.add_argument("--calib-tokens", type=int, default=d.calib_tokens, help="teacher-forced calibration tokens")
    m.add_argument("--seq-len", type=int, default=d.seq_len, help="calibration window (default: min(256, the "
                   "model's sequence_len))")
    m.add_argument("--prompts", type=int, default=d.prompts, help="stage-2 prompts from the validation text")
    m.add_argument("--prompt-len", type=int, default=d.prompt_len)
    m.add_argument("--gen-tokens", type=int, default=d.gen_tokens, help="greedy tokens per prompt and run")
    m.add_argument("--repeats", type=int, default=d.repeats, help="stage-2 timed rounds (medians); "
                   f"below {fewest_sign_rounds()} the sign test over paired rounds (candidates of one setting) resolves no "
                   "lead, and the summary's tie rule picks among them")
    m.add_argument("--warmup", type=int, default=d.warmup, help="stage-2 untimed rounds")
    m.add_argument("--step-runs", type=int, default=d.step_runs, help="stage-1 timed steps per cost")
    m.add_argument("--accept-tokens", type=int, default=d.accept_tokens, help="stage-1 acceptance profile: greedy "
                   "SSD tokens per prompt and plan at the largest B (0: predict from teacher-forced Top-1 alone)")
    m.add_argument("--seed", type=int, default=d.seed, help="prompt sampling seed")
    m.add_argument("--data", default=None, help="validation data spec (default: the checkpoint's training data)")
    m.add_argument("--cache-dir", default=None, help="token cache folder (default: training's / $SNLP_CACHE)")
    m.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    m.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="default: bfloat16 on cuda, float32 on cpu")
    m.add_argument("--all-rows", action="store_true", help="print the predicted-only rows too")
    m.add_argument("--no-progress", action="store_true")
    m.add_argument("--json", default=None, help="write the TuneResult (config, costs, every candidate, picks) here")


def parse_budget(text: str | None) -> float | None:
    """--max-dppl: '1%' or a fraction '0.01'; a bare number >= 1 is refused (ambiguous: 1 % or +100 %?)."""
    if text is None:
        return None
    t = text.strip()
    try:
        v = float(t[:-1]) / 100 if t.endswith("%") else float(t)
    except ValueError:
        raise ValueError(f"--max-dppl must be a percentage (1%) or a fraction (0.01), got {text!r}") from None
    if not (math.isfinite(v) and v >= 0):
        raise ValueError(f"--max-dppl must be >= 0 and finite, got {text!r}")
    if not t.endswith("%") and v >= 1:
        raise ValueError(f"--max-dppl {text!r} is ambiguous: write a percentage ({t}%) or a fraction < 1")
    return v


def _ints(text: str | None, flag: str) -> tuple[int, ...]:
    if text is None:
        return ()
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None


def config_from_args(args):
    """The TuneConfig of the flags (checked)."""
    from snlp.bench.tune import TuneConfig
    from snlp.method.plan import parse_plans

    # each plan as the command line reads one (a K beyond the exact count capped, with a warning)
    # an empty --plans is no list at all (parse_plans refuses it), never the default grid
    cfg = TuneConfig(plans=[str(p) for p in parse_plans(args.plans)] if args.plans is not None else None,
                     blocks=_ints(args.blocks, "--blocks"), threads=_ints(args.threads, "--threads"),
                     compile=args.compile, ssd=not args.no_ssd, max_dppl=parse_budget(args.max_dppl), top=args.top,
                     full_grid=args.full_grid, seq_len=args.seq_len, calib_tokens=args.calib_tokens,
                     prompts=args.prompts, prompt_len=args.prompt_len, gen_tokens=args.gen_tokens,
                     repeats=args.repeats, warmup=args.warmup, step_runs=args.step_runs,
                     accept_tokens=args.accept_tokens, seed=args.seed,
                     progress=not args.no_progress)
    cfg.check()
    # the draft blocks and the acceptance profile belong to goal (a): under --no-ssd nothing reads them
    unread = [f for f in ("blocks", "accept_tokens") if f in getattr(args, "given", ())]
    if args.no_ssd and unread:
        flags = " and ".join("--" + f.replace("_", "-") for f in unread)
        raise ValueError(f"{flags} set{'s' if len(unread) == 1 else ''} SSD decoding (goal (a)), which --no-ssd skips: "
                         f"drop {flags} or --no-ssd")
    return cfg


def finished(args) -> str | None:
    """Where a signal came after the finished --json was written (snlp.apps.cli: status 0, not 128 + signum, so a
    requeue script does not tune again): what holds the results; else None."""
    from snlp.bench.records import marked_partial

    kept = getattr(args, "kept", None)  # set once this run wrote stage 1: the file is its own
    if kept and not marked_partial(args.json):  # the signal came after the last write (the pick's)
        return complete_in([args.json])
    return None


def interrupt_hint(args) -> str:
    """What `snlp tune` says after Ctrl-C (snlp.apps.cli): what its --json keeps."""
    kept = getattr(args, "kept", None)
    return f"kept {kept}" if kept else "stage 1 had not finished: nothing written" if args.json else ""


def run(args) -> int:
    import torch

    from snlp.apps.common import check_plans_fit, own_threads, plans_preheat, say_contention
    from snlp.runtime.load import begin_timing
    from snlp.bench.records import write_json
    from snlp.bench.tune import default_plans, summary, table, tune
    from snlp.eval.data import DATA_DEFAULTS, checkpoint_data, validation_tokens
    from snlp.io.checkpoint import load
    from snlp.runtime.device import cli_device, cli_dtype, device_label
    from snlp.runtime.load import LoadWindow

    cfg = config_from_args(args)  # bad flags fail before the checkpoint is read
    check_plans_fit(args.ckpt, cfg.plans or [])  # its depth from its config, before its weights load
    device = cli_device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model, tok = load(args.ckpt, device="cpu", need_tokenizer="`snlp tune` needs it for the calibration text")
    plans = cfg.plans or default_plans(model.config.n_layer, device)
    preheat = plans_preheat(args.ckpt, model, plans)
    # unknown / unfit plans, and a diag:fd eps the --dtype cannot take, refused before anything runs
    cfg.plan_list(model.config.n_layer, preheat, device, getattr(torch, cli_dtype(args.dtype, device)))
    from snlp.io.weights import cast_model  # float16 refuses a weight it cannot hold
    model = cast_model(model, device, cli_dtype(args.dtype, device), args.ckpt).eval()
    data = checkpoint_data(args.ckpt, **{k: getattr(args, k, None) for k in DATA_DEFAULTS})
    val = validation_tokens(tok, **data)
    print(f"snlp tune: {args.ckpt}: {len(val):,} validation tokens of {data['data']}; {device_label(device)}",
          file=sys.stderr)
    head = {"checkpoint": str(args.ckpt), "device_label": device_label(device)}
    threads = [t for t, _ in cfg.settings()]
    # the load around each stage's timings (snlp.runtime.load): stage 1's step costs predict what stage 2 measures,
    # so a stage timed under other work is named apart
    whole = begin_timing(threads, device)
    stages = {"stage1": LoadWindow(start=whole.start, peak=whole.start, cores=whole.cores,
                                   machine_cpus=whole.machine_cpus)}

    def load() -> dict:
        return {"load": whole.to_json(), "load_stages": {k: w.to_json() for k, w in stages.items()}}

    def stage(stage1: dict, done: str) -> None:  # a run cut short in stage 2 keeps stage 1, marked partial
        stages["stage1"].close()
        whole.sample()
        stages["stage2"] = LoadWindow.begin()
        if args.json:
            write_json(args.json, {**head, "complete": False, "done": done, **stage1, **load()}, announce=False)
            args.kept = f"{done} in {args.json}, marked partial (\"complete\": false)"

    result = tune(model, val, cfg, preheat=preheat, on_stage=stage)
    stages["stage2"].close()
    whole.close()
    for goal in result.picks:
        title = "exact SSD" if goal == "ssd" else f"SNLP decoding, dPPL <= {100 * cfg.max_dppl:.2f} %"
        print(f"\n{goal}: {title} ({'all rows' if args.all_rows else 'measured rows'}; > pick, * shortlist"
              f"{', P Pareto front' if goal == 'snlp' else ''}; pred = stage-1 model, meas = end to end)")
        print("\n".join(table(result, goal, measured_only=not args.all_rows)))
    print(f"\nstage 1 {result.stage1_s:.1f} s, stage 2 {result.stage2_s:.1f} s")
    contended = [k for k, w in stages.items() if w.note(own_threads(threads, device))]  # one line for both
    if contended:
        say_contention(whole if len(contended) == 2 else stages[contended[0]], threads, device,
                       "stages 1 and 2: " if len(contended) == 2 else f"stage {contended[0][-1]}: ")
    print("\n".join(summary(result)))
    if args.json:
        write_json(args.json, {**head, "complete": True, **result.to_dict(), **load()})
    return 0
