"""Adapt an SNLP drafter to a pretrained model: `snlp adapt SRC --plan PLAN --out DIR --data D [--minutes M | --steps N]`.

The model itself is not changed: it stays the verifier of self-speculative decoding (`snlp generate SRC --mode
speculative --drafter DIR`, output identical to the model's own greedy decoding). Only the plan's suffix layers
are copied and distilled so that the plan's K-iteration SNLP forward through them matches the model run
sequentially (KL on the logits + MSE on the normalised final states; by default under self-speculative
conditions: earlier positions' K/V exact, snlp.method.ssd_solve). SRC: an snlp checkpoint or anything
`snlp convert` takes (.gguf, transformers directory). DIR gets the suffix weights, the plan, the base's weights
fingerprint (another base is refused) and the adaptation record; `snlp export DIR --base SRC --out HF_DIR` writes it
as a transformers model. Library: snlp.train.adapt.adapt(AdaptConfig).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import replace
from pathlib import Path

from types import SimpleNamespace

SUMMARY = "Distil an SNLP drafter for a pretrained model, for exact speculative decoding."
DESCRIPTION = """\
The model is not changed: it stays the verifier. Only the plan's suffix layers are copied (or given LoRA deltas) and
distilled so that the plan's SNLP forward matches the model run sequentially; decoding with the drafter gives the
model's own greedy output. SRC: an snlp checkpoint, a .gguf file or a transformers directory. OUT gets the drafter
(drafter.safetensors, drafter.json) and its training log.

  snlp adapt runs/smol --plan 8xF1-h0-K1 --out runs/smol-d8 --minutes 30 --data chat:chats.jsonl
  snlp generate runs/smol --mode speculative --drafter runs/smol-d8 --chat --prompt "Hello!"
  snlp export runs/smol-d8 --out runs/smol-d8-hf        # as a transformers model
"""
GUIDE = "docs/adapt.md"
# --out is the drafter folder this command writes: an output file there may not take one of its files' names
# (snlp.apps.cli.check_outputs)
OUT_IS_MODEL = True

# stand-ins for snlp.train.adapt's constants and AdaptConfig's defaults: the library (and torch) loads in run(), after
# the flags are parsed, so --help answers at once (tests/apps/test_cli_fast.py checks that they agree)
KV_MODES = ("exact", "own")
LOSS_ON = ("all", "replies")
SAVE_EVERY = 50
ADAPT_DEFAULTS = SimpleNamespace(
    data="stdlib", self_distill=0, self_distill_prompts=0, loss_on="all", seq_len=128, batch_size=4, lr=3e-4,
    kv="exact", lora_rank=0, lora_alpha=None, hidden_weight=1.0, kl_weight=1.0, tau=1.0, warmup_steps=10,
    warmdown=0.3, grad_clip=1.0, val_frac=0.05, max_chars=0, eval_every=50, eval_batches=2, save_every=None,
    log_every=10, seed=0, dtype="float32")


def add_arguments(p) -> None:
    d = ADAPT_DEFAULTS
    p.add_argument("src", nargs="?", default=None, help="the base: snlp checkpoint directory, .gguf file or "
                   "transformers directory (required, but with --resume: the saved run's)")
    p.add_argument("--plan", default=None, help="SNLP plan of the drafter, e.g. 8xF1-h0-K1 (required, but with "
                   "--resume: the saved run's)")
    p.add_argument("--out", required=True, help="drafter directory to write")
    p.add_argument("--data", default=d.data, help="text data as for `snlp train --data`, and/or chat sets as "
                   "chat:PATH.jsonl / chat:hf:NAME (rendered with the model's chat template); comma-separated")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 200 without --minutes)")
    p.add_argument("--cache-dir", default=None, help="keep the tokenised text data (and --self-distill's "
                   "generated replies) in this folder and reuse them (default: tokenise / generate on every run)")
    p.add_argument("--self-distill", type=int, default=d.self_distill, metavar="N", help="train on the base's own "
                   "greedy replies: each training conversation of the chat: parts becomes its opening user turn plus "
                   "the base's greedy reply of up to N tokens (generated once, kept in --cache-dir when given); text "
                   "parts and the held-out split are unchanged (0: the data's own replies)")
    p.add_argument("--self-distill-prompts", type=int, default=d.self_distill_prompts, metavar="P",
                   help="with --self-distill: at most P training prompts per chat part, the first in file order "
                   "(0: all)")
    p.add_argument("--loss-on", choices=LOSS_ON, default=d.loss_on, help="all: the loss over every window position "
                   "(prompt and reply tokens alike); replies (chat data only): over the positions that predict an "
                   "assistant reply token, what self-speculative decoding drafts (prompts stay as context)")
    p.add_argument("--init-drafter", default=None, metavar="DIR", help="start the suffix weights (LoRA deltas or full) "
                   "from this saved drafter of the same base, suffix, LoRA setting and data split, with a fresh "
                   "optimizer and LR schedule (--resume continues one run instead)")
    p.add_argument("--minutes", type=float, default=None, help="training-time budget (the LR schedule follows it)")
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--lr", type=float, default=d.lr, help="AdamW peak LR of the suffix weights")
    p.add_argument("--kv", choices=KV_MODES, default=d.kv, help="exact: train under self-speculative conditions "
                   "(earlier positions attend to the base's exact K/V); own: teacher-forced windows (pure SNLP)")
    p.add_argument("--lora-rank", type=int, default=d.lora_rank, help="> 0: train rank-R deltas of the base's own "
                   "suffix matrices (LoRA, merged into the weights before fusion) instead of full copies: the drafter "
                   "adds only the deltas to memory and disk (0: full suffix weights)")
    p.add_argument("--lora-alpha", type=float, default=d.lora_alpha, help="LoRA scale alpha / R (default alpha = R; only "
                   "with --lora-rank R > 0)")
    p.add_argument("--from-model", default=None, metavar="CKPT", help="no training: package CKPT's suffix layers as "
                   "the drafter (CKPT = SRC fine-tuned with its prefix frozen, e.g. the paper's route `snlp train "
                   "--init-from SRC --reg idn --freeze-prefix --unembedding-lr 0`), validated against SRC like an "
                   "adapted one")
    p.add_argument("--hidden-weight", type=float, default=d.hidden_weight, help="weight of the final-state MSE")
    p.add_argument("--kl-weight", type=float, default=d.kl_weight, help="weight of the logit KL")
    p.add_argument("--tau", type=float, default=d.tau, help="distillation temperature of the KL")
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--warmdown", type=float, default=d.warmdown)
    p.add_argument("--grad-clip", type=float, default=d.grad_clip)
    p.add_argument("--val-frac", type=float, default=d.val_frac)
    p.add_argument("--max-chars", type=int, default=d.max_chars, help="cap on the text data's characters (0: all)")
    p.add_argument("--eval-every", type=int, default=d.eval_every)
    p.add_argument("--eval-batches", type=int, default=d.eval_batches)
    p.add_argument("--save-every", type=int, default=d.save_every,
                   help=f"resumable checkpoints in OUT/run every N steps (default {SAVE_EVERY}; 0: end only; "
                        "refused with --lora-rank, whose runs save at the end only)")
    p.add_argument("--log-every", type=int, default=d.log_every)
    p.add_argument("--stop-after", type=int, default=None, help="stop after this step, resumable with --resume")
    p.add_argument("--resume", action="store_true", help="continue the run in OUT/run: SRC, --plan and every "
                   "flag left out keep the saved values; only the budget (--steps, --minutes, --stop-after), the "
                   "intervals, --device, --cache-dir and --no-progress may change (another value of any other flag is "
                   "refused)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=d.dtype, choices=["float32", "bfloat16"], help="the base's weight dtype")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", default=None, help="write the AdaptResult to this JSON file")


def run(args) -> int:
    from snlp.apps.common import check_plans_fit
    from snlp.method.plan import cli_plan
    from snlp.runtime.device import json_number
    from snlp.runtime.outputs import locked_output
    from snlp.train.adapt import RUN, AdaptConfig, adapt, check_resume_left_adapt, resumed_adapt
    from snlp.apps.train import finished_despite
    from snlp.train.hooks import TrainHooks

    cfg = AdaptConfig(**{k: getattr(args, k) for k in AdaptConfig.__dataclass_fields__})
    cfg = resumed_adapt(cfg, getattr(args, "given", None))  # --resume: the flags not typed keep the saved values
    check_cache_dir(cfg, getattr(args, "given", None))
    if cfg.resume:  # a finished run, or no step left: nothing to continue (the drafter's record is kept)
        check_resume_left_adapt(cfg)
    if cfg.src is None or cfg.plan is None:
        raise ValueError("SRC and --plan are required" + (f" (--resume takes them from the run saved in "
                                                           f"{Path(args.out) / RUN}: there is none)" if args.resume
                                                           else ""))
    # a K beyond the exact count capped (with a warning), as for every --plan
    cfg = replace(cfg, plan=str(cli_plan(cfg.plan)))
    check_plans_fit(cfg.src, [cfg.plan], transformers_ok=True)  # the base's depth from its config, before its weights load
    master = int(os.environ.get("RANK", "0")) == 0  # torchrun: rank 0 writes --out, so it holds the lock
    with locked_output(args.out) if master else contextlib.nullcontext():  # a second run on --out is refused
        res = adapt(cfg, hooks=TrainHooks(pass_late_signal=False))  # a late signal: the drafter written, exit 0
    if res.stopped_by == "interrupt" and cfg.lora_rank:  # written, but a LoRA run cannot resume (AdaptConfig.check)
        import sys

        from snlp.apps.train import interrupt_status

        if res.rank == 0:
            print(f"snlp adapt: interrupted by {res.signal}: the drafter at step {res.steps} is written to {res.out}; "
                  f"a LoRA run cannot be resumed: run the command again in another --out for the whole budget",
                  file=sys.stderr)
        return interrupt_status(res.signal)
    if res.stopped_by == "interrupt":  # its checkpoint is saved in OUT/run
        from snlp.apps.train import interrupted, not_inherited

        return interrupted("adapt", res.out, res.steps, res.signal, ["--out", res.out, *not_inherited(args)])
    if res.rank != 0:  # torchrun: rank 0 reports and writes
        return 0
    b, a = res.before, res.after  # log.jsonl rows (read_log: a NaN Top-1 is NaN again), printed nan
    pct = lambda rec, k: json_number(rec.get(k, 0))  # noqa: E731
    how = f"from {cfg.from_model}" if cfg.from_model else "adapted"
    # a plan ssd_solve does not cover has no SSD-conditions Top-1 (null in log.jsonl): said, never printed as 0 or nan
    ssd = (f"SSD conditions {100 * pct(b, 'top1_ssd'):.1f} -> {100 * pct(a, 'top1_ssd'):.1f} %"
           if "top1_ssd" in a and a["top1_ssd"] is not None else "SSD conditions not measured for this plan")
    skipped = f" (+{res.skipped_steps} skipped: no reply position)" if res.skipped_steps else ""
    print(f"{how} {res.plan} drafter -> {res.out}: {res.steps} steps{skipped}, {res.tokens:,} tokens, "
          f"{res.minutes:.1f} min | "
          f"Top-1 {100 * pct(b, 'top1'):.1f} -> {100 * pct(a, 'top1'):.1f} % ({ssd}) | extra memory "
          f"{res.extra_bytes / 2**20:.1f} MiB")
    if args.json:
        write_result(args.json, res)
    return finished_despite("adapt", res)  # a signal after the last step: the drafter is written, nothing to resume


def check_cache_dir(cfg, given) -> None:
    """Refuse a typed --cache-dir that the run would not use, in one line before any work: a --data with a chat: part
    is rendered again on every run (snlp.train.adapt.token_stream keeps text-only specs), so without --self-distill
    (whose replies it keeps) nothing is written there or read back, and the run said nothing."""
    from snlp.io.data import parts

    if "cache_dir" not in (given or ()) or not cfg.cache_dir or cfg.self_distill:
        return
    if any(p.startswith("chat:") for p in parts(cfg.data)):
        raise ValueError(f"--cache-dir keeps tokenised text data of text parts only and --self-distill's replies: "
                         f"--data {cfg.data!r} has chat: parts (rendered again on every run) and there is no "
                         f"--self-distill, so nothing would be kept there: drop --cache-dir")


def write_result(path, res) -> None:
    """--json: the AdaptResult as strict JSON (snlp.runtime.device.json_text: a NaN of its validation records is null,
    an inf "inf"), written atomically."""
    from snlp.runtime.device import json_text, write_atomic

    write_atomic(path, json_text(res.to_dict(), indent=2))


def speedrun_adaptation(model, tok, src: str, data: str, max_chars: int, val, minutes: float, seed: int = 0,
                        plan: str = "8xF1-h0-K1", prompts: int = 2, gen_tokens: int = 32, block: int = 4,
                        device: str | None = None, cache_dir: str | None = None) -> dict:
    """The speedrun's off-the-shelf adaptation: adapt `plan`'s drafter of the loaded `model` for
    `minutes` on the speedrun's text, then Top-1 (teacher-forced and SSD conditions) before/after from the
    run's validation, and SSD alpha at B = `block` on `prompts` validation prompts for the post-hoc and the
    adapted drafter (both must reproduce the model's greedy output). The drafter is written to a temporary
    directory and removed. `device`: where it trains (default: the model's own device, never another one the
    machine happens to have); `model` itself is neither moved nor changed. `cache_dir`: where the tokenised
    training data is kept and reused (AdaptConfig.cache_dir)."""
    import shutil
    import tempfile

    from snlp.decode.speculative import speculative_benchmark
    from snlp.eval.data import as_tokens, sample_prompts
    from snlp.io.drafter import load_drafter
    from snlp.method.drafter import make_drafter
    from snlp.train.adapt import AdaptConfig, adapt

    out = tempfile.mkdtemp(prefix="snlp-adapt-")
    try:
        cfg = AdaptConfig(src=src, plan=plan, out=str(Path(out) / "drafter"), data=data, max_chars=max_chars,
                          minutes=minutes, seq_len=min(ADAPT_DEFAULTS.seq_len, model.config.sequence_len),  # its context
                          eval_every=10 ** 6, eval_batches=2, save_every=0, seed=seed,
                          no_progress=True, device=device or str(model.wte.weight.device), cache_dir=cache_dir)
        res = adapt(cfg, base=(model, tok))
        if res.stopped_by == "interrupt":  # a signal stopped it after a step: the speedrun stops, not measures it
            from snlp.train.hooks import Interrupted, signal_number
            raise Interrupted(signal_number(res.signal))
        d = load_drafter(cfg.out, model)
        ps = sample_prompts(as_tokens(val), prompts, 16, seed + 2)
        ssd = {}
        for name, drafter in (("post-hoc", make_drafter(model, plan, d.base_fingerprint)), ("adapted", d)):
            rows, _ = speculative_benchmark(model, ps, plan, (block,), gen_tokens, repeats=1, warmup=0,
                                            drafter=drafter)
            ssd[name] = rows[0].to_dict()
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return {"plan": plan, "device": res.device, "minutes": res.minutes, "steps": res.steps, "tokens": res.tokens, "before": res.before,
            "after": res.after, "block": block, "ssd": ssd, "extra_bytes": res.extra_bytes}
