"""Analyse a checkpoint: the paper's layer-parallelism diagnostics and inference ablations.

`snlp analyze CKPT --out DIR` writes DIR/analysis.md (paper-style tables), DIR/analysis.json and PNG
plots; every section is a module of snlp.eval.analysis (config dataclass in, result dataclass out):

  jacobian     per suffix layer l, on real validation windows at the sequential input h_{l-1}:
               sigma_max of J_g (g_l = the non-residual branch, f_l(h) = x_in,l(h) + g_l(h)) by power
               iteration on J_g^T J_g with JVP/VJP (`power_iters`, the last relative change reported),
               Hutchinson ||J_g||_F (E_v ||J_g v||^2 = ||J_g||_F^2 for Rademacher v), amplification
               ||J_f v|| / ||v|| (Gaussian v), and the substitution errors |eps_l|, C_eps(l), Delta_g(l)
               of the paper's variance-reduction paragraph (Sec. "Inference effect"), relative to the
               prefix-state scale. J is the Jacobian of the whole window map (tokens couple through
               attention); sigma_max is the window's, ||J||_F is reported per token: sqrt(||J||_F^2 / T).
               mHC models: the same on the stream state (x_in = h, g = f - h).
  ordering     per suffix size N: forward, reversed and R random shuffles of the IDN correction order:
               Seq-Perm PPL (the permuted suffix run sequentially), IDN K = 1 / K = 4 PPL, no-correction
               PPL, AR-ness (DiffuCoder, Gong et al. 2025: mean of local AR-ness@1, the fraction of
               the N - 1 steps that visit the position right after the previous one, and global
               AR-ness@1, the fraction of the N steps that visit the leftmost unvisited position;
               forward 1, reversed 1 / (2N), the paper's values); summary: best shuffle, shuffle std
               over finite values, "diverged" for non-finite PPL (paper Table ordering_summary, App.
               "Correction Ordering").
  propagation  PPL with only the last j of N suffix layers active (the others skipped), j = 1..N, at
               K = 1..N, IDN vs no correction: the staircase (App. "Correction Propagation") + heat map.
  early-exit   K = 0 PPL with the last N layers skipped (paper Table early_exit).
  elk          PPL over ELK a x init {h0, fwd, preheat} x chunkings of N layers at K = 1 (App. "ELK
               Tempering and Preheat Initialization"); preheat from the checkpoint's calibration or a
               random-token one fitted here.
  preheat      preheat calibrated on random tokens vs on data, per chunking (K = 1, a = 0), h0 alongside.
  jacobi       JD x SNLP coupling (App. "Coupling SNLP with Jacobi Decoding"): naive composition (a
               fresh SNLP solve per JD iteration) and h0-JD (deeper chunk states warm-started from the
               previous JD iteration), K = 1, 2, lookahead window W, unverified: token match vs
               sequential greedy, accepted tokens per JD iteration, JD iterations per round, forwards
               per token.
All PPLs are token-weighted over non-overlapping windows of `seq_len` validation tokens (snlp.eval).
"""

from __future__ import annotations

from types import SimpleNamespace

SUMMARY = "Run the paper's layer-parallelism diagnostics and ablations on a checkpoint."
DESCRIPTION = """\
Sections (--only): jacobian (per-layer Jacobian norms, amplification, substitution errors), ordering (correction
orders), propagation (the staircase), early-exit, elk (ELK x init), preheat and jacobi (coupling with Jacobi
decoding). PPLs are over non-overlapping --seq-len windows of the checkpoint's validation text. OUT gets analysis.md
(the tables), analysis.json and PNG plots.

  snlp analyze runs/speedrun/idn --out runs/analysis-idn     # every section (minutes on a CPU)
  snlp analyze runs/speedrun/idn --out /tmp/ana --only jacobian,early-exit --max-tokens 512
"""
GUIDE = "docs/analysis.md"
LOCK_OUTPUTS = True  # it rewrites --out after each section: a second run there is refused (snlp.apps.cli.output_locks)

# stand-ins for snlp.eval.analysis.common's SECTIONS and AnalysisConfig's defaults: the library (and torch) loads in
# run(), after the flags are parsed, so --help answers at once (tests/apps/test_cli_fast.py checks that they agree)
SECTIONS = ("jacobian", "ordering", "propagation", "early-exit", "elk", "preheat", "jacobi")
ANALYSIS_DEFAULTS = SimpleNamespace(seq_len=128, max_tokens=1024, shuffles=6, preheat_rank=32)


def _ints(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"expected comma-separated integers, got {text!r}") from None


# the sections that read each option (snlp.eval.analysis): with none of them in --only a changed value would be
# silently unused, so it is refused (jacobian reads jac_windows * --seq-len tokens, jacobi its own prompts)
USED_BY = {"seq_len": ("jacobian", "ordering", "propagation", "early-exit", "elk", "preheat"),
           "max_tokens": ("ordering", "propagation", "early-exit", "elk", "preheat"),
           "layers": ("jacobian",), "suffixes": ("ordering", "early-exit"), "shuffles": ("ordering",),
           "preheat_rank": ("elk", "preheat"), "seed": ("jacobian", "ordering", "elk", "preheat", "jacobi")}
FLAG_DEFAULTS = {"layers": None, "suffixes": None, "seed": 0, **vars(ANALYSIS_DEFAULTS)}


def check_sections(args) -> tuple[str, ...]:
    """The --only sections, refusing an empty or unknown one and a changed option none of them reads (one line, before
    the checkpoint loads)."""
    only = tuple(dict.fromkeys(s.strip() for s in args.only.split(",") if s.strip()))
    if not only:
        raise ValueError(f"--only names no section: choose from {', '.join(SECTIONS)}")
    bad = [s for s in only if s not in SECTIONS]
    if bad:
        raise ValueError(f"unknown analysis section(s) {bad}: valid sections are {', '.join(SECTIONS)}")
    unused = [k for k, users in USED_BY.items() if getattr(args, k) != FLAG_DEFAULTS[k] and not set(users) & set(only)]
    if unused:
        flags = "; ".join(f"--{k.replace('_', '-')} only by {', '.join(USED_BY[k])}" for k in unused)
        raise ValueError(f"an option no section in --only {','.join(only)} reads would be unused: {flags} (drop it "
                         f"or add such a section)")
    return only


def add_arguments(p) -> None:
    p.add_argument("ckpt", help="checkpoint directory")
    p.add_argument("--data", default=None, help="validation data spec (default: the checkpoint's training data)")
    p.add_argument("--seq-len", type=int, default=ANALYSIS_DEFAULTS.seq_len, help="tokens per PPL window")
    p.add_argument("--max-tokens", type=int, default=ANALYSIS_DEFAULTS.max_tokens, help="predicted tokens per PPL")
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections: {', '.join(SECTIONS)}")
    p.add_argument("--layers", default=None, help="jacobian layers, 0-based, comma-separated (default: the last 8)")
    p.add_argument("--suffixes", default=None, help="ordering / early-exit suffix sizes N (default 8,12,L)")
    p.add_argument("--shuffles", type=int, default=ANALYSIS_DEFAULTS.shuffles, help="random correction orders per N")
    p.add_argument("--preheat-rank", type=int, default=ANALYSIS_DEFAULTS.preheat_rank,
                   help="rank of the preheat fits made here (preheat; elk when the checkpoint has no preheat.pt)")
    p.add_argument("--seed", type=int, default=0, help="seed of the probes, shuffles, preheat fits and Jacobi prompts")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: on a shared or busy CPU "
                   "more threads only add contention; raise it on a free machine)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", required=True, help="output folder for analysis.md, analysis.json and plots")


def finished(args) -> str | None:
    """Where a signal came after the complete files were written (snlp.apps.cli: status 0): what holds them."""
    return f"{args.out}/analysis.md and analysis.json hold every section" if getattr(args, "complete", False) else None


def interrupt_hint(args) -> str:
    """What `snlp analyze` says after Ctrl-C or SIGTERM (snlp.apps.cli): the sections its --out keeps."""
    kept = getattr(args, "kept", None)
    if not kept:
        return "no section had finished: nothing written"
    return (f"kept the finished sections ({', '.join(kept)}) in {args.out}/analysis.md and analysis.json, marked "
            f"partial (\"complete\": false)" + ("; they replaced the analysis an earlier run had written there"
                                                 if getattr(args, "replaced", False) else "")
            + "; a rerun computes every section again (--only picks the rest)")


def check_out(out: str) -> None:
    """Refuse an --out folder holding one of the files this command writes there that is not an earlier analysis:
    write() replaces analysis.json, analysis.md and the plots (and removes those this run does not make), so a user's
    own analysis.md or ordering.png there was lost. An earlier analysis (an analysis.json of this command beside
    them) is replaced by design. One line, before the checkpoint loads."""
    import json
    from pathlib import Path

    from snlp.eval.analysis.report import PLOTS

    folder = Path(out)
    there = [n for n in ("analysis.json", "analysis.md", *PLOTS) if (folder / n).exists()]
    if not there:
        return
    try:
        earlier = json.loads((folder / "analysis.json").read_text())
        ours = isinstance(earlier, dict) and {"checkpoint", "config", "environment", "complete"} <= set(earlier)
    except (OSError, ValueError):
        ours = False
    if not ours:
        raise ValueError(f"--out {out} holds {', '.join(there)} but no earlier analysis (analysis.json of snlp "
                         f"analyze): this run would write over or remove them; name another folder")


def run(args) -> int:
    import torch

    from snlp.eval.analysis.common import AnalysisConfig
    from snlp.eval.analysis.report import PLOTS, analyze, check_model, write
    from snlp.eval.data import checkpoint_data, validation_tokens
    from snlp.io.checkpoint import load, load_preheat

    only = check_sections(args)
    check_out(args.out)
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    from snlp.io.source import check_source

    check_source(args.ckpt, "checkpoint", hub=False)  # one line, with the closest names
    model, tok = load(args.ckpt, need_tokenizer="validation tokens cannot be made")
    # only elk reads the checkpoint's calibration: a stale or foreign preheat.pt is refused there, not for the others
    pre = load_preheat(args.ckpt, model) if "elk" in only else None
    if pre is not None and "elk" in only and "preheat" not in only and args.preheat_rank != pre.rank \
            and args.preheat_rank != ANALYSIS_DEFAULTS.preheat_rank:
        raise ValueError(f"--preheat-rank {args.preheat_rank} would be unused: the elk section uses the checkpoint's "
                         f"preheat.pt (rank {pre.rank}) and only the preheat section fits one (add it to --only)")
    if pre is not None and args.seed != FLAG_DEFAULTS["seed"] and not set(USED_BY["seed"]) - {"elk"} & set(only):
        raise ValueError(f"--seed {args.seed} would be unused: the elk section uses the checkpoint's preheat.pt (no "
                         f"random-token fit to seed) and no other section in --only reads a seed")
    cfg = AnalysisConfig(seq_len=args.seq_len, max_tokens=args.max_tokens, only=only, layers=_ints(args.layers),
                         suffixes=_ints(args.suffixes), shuffles=args.shuffles, preheat_rank=args.preheat_rank,
                         seed=args.seed, progress=not args.no_progress)
    check_model(model, cfg, pre)  # before the validation data is read (tokenising it can take minutes)
    val = validation_tokens(tok, **checkpoint_data(args.ckpt, data=args.data))
    from pathlib import Path

    from snlp.train.hooks import deferred

    args.replaced = (Path(args.out) / "analysis.json").is_file()  # an earlier run's: the first section replaces it

    # a signal during a write is held until the files and what interrupt_hint / finished say of them agree: raised
    # mid-write it left a partial analysis.json beside no analysis.md (write removes the old one before the plots)
    # while the line said "nothing written"
    def keep(partial) -> None:  # each section as it finishes: a run cut short keeps them (a section is minutes)
        with deferred():
            write(partial, args.out, complete=False)
            args.kept = list(partial.seconds)

    res = analyze(model, val, cfg, checkpoint=args.ckpt, preheat=pre, on_section=keep)
    with deferred():
        out = write(res, args.out)
        args.complete = True
    # the plots of the sections that ran (early-exit, elk, preheat and jacobi have none): "and plots" after a run
    # of those alone named files the folder does not hold
    plots = [str(out / p) for p in PLOTS if (out / p).is_file()]
    print(f"wrote {out / 'analysis.md'}, {out / 'analysis.json'}" + (f" and {', '.join(plots)}" if plots else "")
          + f" ({sum(res.seconds.values()):.0f}s)")
    return 0
