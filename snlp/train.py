"""Train a GPT from scratch, optionally with the SNLP-aware regulariser (--reg idn).

Works out of the box on CPU with no network: `snlp train --out runs/x --depth 8 --minutes 3`
trains a byte-level BPE on the standard library's Python sources and a small model on them.
Training defaults (aspect ratio 32, head dim 64, vocab 4096, seq len 256) are smaller than
`snlp bench`'s so a CPU run makes progress in minutes. Multi-process: `torchrun
--nproc_per_node=P -m snlp train ...` (DDP; NCCL on GPU, gloo on CPU; rank 0 logs and saves).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
import warnings
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from . import data as D
from .checkpoint import load, load_training, save_checkpoint
from .model import GPT, GPTConfig
from .regularizer import RegConfig, parse_suffixes, resolve_suffixes, snlp_gap, snlp_loss
from .tokenizer import Tokenizer

TOKENIZER_CHARS = 20_000_000  # BPE is trained on at most this many characters of the train split


def add_arguments(p) -> None:
    p.add_argument("--out", required=True, help="checkpoint directory (created; with --resume, continued)")
    p.add_argument("--resume", action="store_true", help="continue the run saved in --out (weights, optimizer, data position, RNG)")
    p.add_argument("--init-from", default=None, metavar="CKPT",
                   help="start from this checkpoint's weights and tokenizer (e.g. `snlp convert` of a Hugging Face "
                   "model; paper App. 'Pretrained TinyLlama Fine-Tuning'): no tokenizer training, the model flags "
                   "(--depth, ...) are taken from the checkpoint")
    p.add_argument("--freeze-prefix", type=int, nargs="?", const=-1, default=None, metavar="S",
                   help="train only layers S.. (and the final norm / untied lm_head); the embedding and the first S "
                   "layers stay frozen. Without a value S = depth - max(--reg-n), the SNLP suffix")
    d = p.add_argument_group("data")
    d.add_argument("--data", default="stdlib", help="stdlib | file/folder/glob (.txt, .py, .jsonl, .parquet) | "
                   "hf:NAME[:CONFIG][:SPLIT]; comma-separated to combine")
    d.add_argument("--text-field", default="text", help="text field of .jsonl/.parquet/hf rows")
    d.add_argument("--max-chars", type=int, default=0, help="use at most this many characters (0 = all; hf: 200M)")
    d.add_argument("--val-frac", type=float, default=0.05, help="fraction of documents held out for validation")
    d.add_argument("--vocab-size", type=int, default=4096, help="BPE vocabulary size (specials included)")
    d.add_argument("--cache-dir", default=None, help="token cache folder (default $SNLP_CACHE or ~/.cache/snlp)")
    m = p.add_argument_group("model (one dial: depth)")
    m.add_argument("--depth", type=int, default=8)
    m.add_argument("--width", type=int, default=None, help="model width; default depth * aspect ratio")
    m.add_argument("--aspect-ratio", type=int, default=32, help="width per layer of depth (bench: 64)")
    m.add_argument("--head-dim", type=int, default=64, help="attention head dim (bench: 128)")
    m.add_argument("--kv-heads", type=int, default=None)
    m.add_argument("--window-pattern", default="L")
    m.add_argument("--no-x0", action="store_true", help="disable the x0 residual")
    m.add_argument("--no-ve", action="store_true", help="disable value embeddings")
    m.add_argument("--hc-streams", type=int, default=0, help="mHC with this many residual streams (0 = plain "
                   "residual model); turns the x0 residual off")
    m.add_argument("--hc-static", action="store_true", help="static mHC (learned constant H) instead of dynamic")
    o = p.add_argument_group("optimisation")
    o.add_argument("--seq-len", type=int, default=256)
    o.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch per process")
    o.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    o.add_argument("--steps", type=int, default=None, help="optimizer steps (default 1000 unless --minutes)")
    o.add_argument("--minutes", type=float, default=None, help="wall-clock budget; the LR schedule follows elapsed time")
    o.add_argument("--stop-after", type=int, default=None, help="stop (and save) after this step; schedule still follows --steps")
    o.add_argument("--optimizer", choices=["muon", "adamw"], default="muon", help="for the 2-D block matrices")
    o.add_argument("--matrix-lr", type=float, default=None, help="block-matrix LR (default 0.02 muon, 0.003 adamw)")
    o.add_argument("--embedding-lr", type=float, default=0.2, help="AdamW LR of wte and value embeddings")
    o.add_argument("--unembedding-lr", type=float, default=0.004, help="AdamW LR of lm_head")
    o.add_argument("--scalar-lr", type=float, default=0.5, help="AdamW LR of the x0 scalars (resid scalars: x0.01)")
    o.add_argument("--hc-lr", type=float, default=0.005, help="AdamW LR of the mHC coefficient parameters "
                   "(H biases, dynamic projections and gates)")
    o.add_argument("--weight-decay", type=float, default=0.0)
    o.add_argument("--warmup-steps", type=int, default=10, help="linear LR warm-up")
    o.add_argument("--warmdown", type=float, default=0.4, help="final fraction of the run with linear LR decay to 0")
    o.add_argument("--grad-clip", type=float, default=1.0, help="max grad norm (0 = off)")
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--device", default=None, help="default: cuda if available (per local rank), else cpu")
    r = p.add_argument_group("SNLP-aware regulariser (paper Eq. snlp-training-loss)")
    r.add_argument("--reg", choices=["idn", "hcn", "diag", "none"], default="none", help="surrogate of the regulariser's "
                   "K=1 solve (hcn: mHC models, --hc-streams; diag: DiagN, one FD Hutchinson probe per step, "
                   "the diagonal estimate detached: gradients flow through the chunk forwards)")
    r.add_argument("--reg-lambda", type=float, default=0.5)
    r.add_argument("--reg-n", default="4", help="suffix lengths N, e.g. 8,16,24 (N >= depth is clipped to depth-1); also the N of the logged gap")
    r.add_argument("--reg-stride", type=int, default=0, help="0 = final layer only; s > 0 adds L-s, L-2s, ...")
    r.add_argument("--reg-detach", action=argparse.BooleanOptionalAction, default=None,
                   help="detach the sequential target (default: on for --reg hcn as in the paper's mHC run, "
                   "off otherwise)")
    r.add_argument("--reg-warmup", type=int, default=0, help="steps to ramp lambda from 0")
    e = p.add_argument_group("logging")
    e.add_argument("--eval-every", type=int, default=50, help="validation every N steps (and at the end)")
    e.add_argument("--eval-batches", type=int, default=4)
    e.add_argument("--save-every", type=int, default=0, help="also save every N steps (0 = only at the end)")
    e.add_argument("--log-every", type=int, default=10)
    e.add_argument("--no-progress", action="store_true", help="no tqdm bar")


# ----- distributed -----
def setup_dist(device_arg):
    """(rank, world, device); initialises the process group when launched by torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if device_arg:
        device = torch.device(device_arg)
    else:
        device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda requested but CUDA is not available; use --device cpu")
        if device.index is None:
            device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return rank, world, device


# ----- model and optimizers -----
def build_config(args, vocab_size: int) -> GPTConfig:
    return GPTConfig.from_depth(args.depth, aspect_ratio=args.aspect_ratio, head_dim=args.head_dim, width=args.width,
                                n_kv_head=args.kv_heads, vocab_size=vocab_size, sequence_len=args.seq_len,
                                window_pattern=args.window_pattern, x0_residual=False if args.no_x0 else None,
                                value_embeds=not args.no_ve, hc_streams=getattr(args, "hc_streams", 0),
                                hc_dynamic=not getattr(args, "hc_static", False))


def build_optimizers(model: GPT, args) -> list[torch.optim.Optimizer]:
    """AdamW for embeddings, lm_head and scalars; Muon (torch.optim.Muon) or AdamW for the 2-D
    block matrices. LRs are nanochat's, scaled by (width/768)^-0.5 for the AdamW embedding groups.
    The mHC coefficient parameters (blocks.*.hc_*: tiny H biases, projections, gates) go to AdamW."""
    scale = (model.config.n_embd / 768) ** -0.5
    hc = [p for name, p in model.blocks.named_parameters() if ".hc_" in name]
    matrices = [p for name, p in model.blocks.named_parameters() if p.dim() == 2 and ".hc_" not in name]
    vectors = [p for name, p in model.blocks.named_parameters() if p.dim() == 1 and ".hc_" not in name]
    vectors += [model.ln_f] if model.ln_f is not None else []  # Llama family: norm weights, q/k/v biases
    groups = [{"params": [model.wte.weight] + ([model.value_embeds] if hasattr(model, "value_embeds") else []),
               "lr": args.embedding_lr * scale}]
    if not model.config.tie_embeddings:
        groups.append({"params": [model.lm_head.weight], "lr": args.unembedding_lr * scale})
    if vectors:
        groups.append({"params": vectors, "lr": args.unembedding_lr * scale})
    if model.config.x0_residual:
        groups += [{"params": [model.x0_lambdas], "lr": args.scalar_lr},
                   {"params": [model.resid_lambdas], "lr": args.scalar_lr * 0.01}]
    if hc:
        groups.append({"params": hc, "lr": getattr(args, "hc_lr", 0.005)})
    known = {id(p) for g in groups for p in g["params"]} | {id(p) for p in matrices}
    rest = [p for p in model.parameters() if id(p) not in known]
    if rest:
        raise ValueError(f"{len(rest)} parameters have no optimizer group")
    for g in groups:  # --freeze-prefix: frozen parameters are not optimised
        g["params"] = [p for p in g["params"] if p.requires_grad]
    groups = [g for g in groups if g["params"]]
    matrices = [p for p in matrices if p.requires_grad]
    opts = []
    if args.optimizer == "muon" and matrices:
        opts.append(torch.optim.Muon(matrices, lr=args.matrix_lr or 0.02, weight_decay=args.weight_decay,
                                     momentum=0.95))
    elif matrices:
        groups.append({"params": matrices, "lr": args.matrix_lr or 0.003})
    opts.insert(0, torch.optim.AdamW(groups, betas=(0.8, 0.95), eps=1e-10, weight_decay=args.weight_decay))
    return opts


class Progress:
    """Fraction of the run done: steps/total, or elapsed/budget with --minutes."""

    def __init__(self, steps: int | None, minutes: float | None):
        self.steps, self.seconds, self.step, self.elapsed = steps, (minutes * 60 if minutes else None), 0, 0.0

    @property
    def frac(self) -> float:
        fr = [self.step / self.steps] if self.steps else []
        if self.seconds:
            fr.append(self.elapsed / self.seconds)
        return min(1.0, max(fr))

    def done(self) -> bool:
        return (self.steps is not None and self.step >= self.steps) or \
            (self.seconds is not None and self.elapsed >= self.seconds)


def lr_lambda(args, progress: Progress):
    """Warm-up then constant then linear warm-down to 0 over the last `warmdown` of the run."""
    def f(step: int) -> float:
        w = min(1.0, (step + 1) / args.warmup_steps) if args.warmup_steps > 0 else 1.0
        left = 1.0 - progress.frac
        return w * (min(1.0, left / args.warmdown) if args.warmdown > 0 else 1.0)
    return f


class TrainStep(nn.Module):
    """One micro-batch: CE and the regulariser from ONE sequential forward (the trace feeds both).
    A module so DDP wraps it and syncs the gradients of both terms."""

    def __init__(self, model: GPT, reg: RegConfig):
        super().__init__()
        self.model, self.reg = model, reg

    def forward(self, x, y, lam: float):
        m = self.model
        ctx = m.embed(x)
        trace = [ctx.x0]
        h = m.run_layers(ctx.x0, ctx, 0, m.config.n_layer, trace)
        logits = m.head(h)
        ce = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1), ignore_index=-1)
        if lam > 0:
            reg = snlp_loss(m, x, trace, self.reg)
            return ce + lam * reg, ce.detach(), reg.detach()
        return ce, ce.detach(), torch.zeros((), device=x.device)


@torch.no_grad()
def evaluate(model: GPT, batches, device, autocast, suffixes, surrogate: str = "idn") -> dict:
    """Validation CE and the measured K=1 SNLP gap (final-state relative error) per suffix N."""
    was = model.training
    model.eval()
    ce, gaps = 0.0, {n: 0.0 for n in suffixes}
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        with autocast():
            ce += float(model(x, y))
            for n in suffixes:
                gaps[n] += snlp_gap(model, x, n, surrogate)
    model.train(was)
    k = len(batches)
    return {"val_loss": ce / k, **{f"gap_N{n}": g / k for n, g in gaps.items()}}


def rng_state() -> dict:
    st = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    np.random.set_state(st["numpy"])
    random.setstate(st["python"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def prepare_data(args, tok: Tokenizer | None, rank: int, world: int) -> tuple[Tokenizer, D.TokenData]:
    """Tokenizer (trained unless given) and cached token arrays. Rank 0 builds, others wait."""
    cache = Path(args.cache_dir) if args.cache_dir else D.cache_dir()
    key = D.split_key(args.data, args.text_field, args.max_chars, args.val_frac)
    tok_path = cache / f"{key}-bpe{args.vocab_size}.tokenizer.json"

    def build():
        nonlocal tok
        docs = None
        if tok is None and not tok_path.is_file():
            docs = list(D.documents(args.data, args.text_field, args.max_chars))
            train, _ = D.split_documents(docs, args.val_frac)
            tok = Tokenizer.train(_capped(train, TOKENIZER_CHARS), args.vocab_size)
            cache.mkdir(parents=True, exist_ok=True)
            tmp = tok_path.with_name(tok_path.name + f".tmp-{os.getpid()}")
            tok.tok.save(str(tmp))
            os.replace(tmp, tok_path)
        tok = tok or Tokenizer.load(tok_path)
        ptrain, pval = D.token_paths(key, tok, cache)
        if not (ptrain.is_file() and pval.is_file()):
            docs = docs if docs is not None else list(D.documents(args.data, args.text_field, args.max_chars))
            train, val = D.split_documents(docs, args.val_frac)
        else:
            train = val = []
        return tok, D.load_tokens(train, val, tok, key, cache)

    if world > 1:
        if rank == 0:
            out = build()
        dist.barrier()
        if rank != 0:
            out = build()
        return out
    return build()


def _capped(docs, chars):
    n = 0
    for d in docs:
        yield d
        n += len(d)
        if n >= chars:
            return


def check_args(args) -> None:
    for name in ("seq_len", "batch_size", "grad_accum", "depth", "eval_every", "eval_batches", "log_every"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1 (got {getattr(args, name)})")
    if args.steps is not None and args.steps < 1:
        raise ValueError(f"--steps must be >= 1 (got {args.steps})")
    if args.minutes is not None and args.minutes <= 0:
        raise ValueError(f"--minutes must be > 0 (got {args.minutes})")
    if not 0 <= args.warmdown <= 1:
        raise ValueError(f"--warmdown must lie in [0, 1] (got {args.warmdown})")
    if getattr(args, "hc_streams", 0) < 0:
        raise ValueError(f"--hc-streams must be >= 0 (got {args.hc_streams})")
    if args.reg_lambda < 0 or args.reg_warmup < 0 or args.reg_stride < 0:
        raise ValueError("--reg-lambda, --reg-warmup and --reg-stride must be >= 0")
    if args.steps is None and args.minutes is None:
        args.steps = 1000
    if getattr(args, "init_from", None) and args.resume:
        raise ValueError("--init-from starts a new run from a checkpoint's weights; --resume continues --out: pick one")
    if getattr(args, "freeze_prefix", None) is not None and args.freeze_prefix < -1:
        raise ValueError(f"--freeze-prefix must be >= 0 (got {args.freeze_prefix})")


def freeze_prefix(model: GPT, S: int) -> None:
    """Train only layers S.. : the embedding (and a tied lm_head with it) and blocks 0..S-1 stop
    requiring gradients. The paper's cheap CPU fine-tuning: only the SNLP suffix changes."""
    L = model.config.n_layer
    if not 0 <= S < L:
        raise ValueError(f"--freeze-prefix S={S} must lie in [0, {L - 1}] (the model has {L} layers)")
    model.wte.weight.requires_grad_(False)
    if hasattr(model, "value_embeds"):
        model.value_embeds.requires_grad_(False)
    for block in model.blocks[:S]:
        block.requires_grad_(False)


def run(args) -> int:
    check_args(args)
    rank, world, device = setup_dist(args.device)
    master = rank == 0
    out = Path(args.out)
    try:
        return _train(args, rank, world, device, master, out)
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()


def _train(args, rank, world, device, master, out) -> int:
    torch.manual_seed(args.seed)
    resume_state, opt_state, tok, model = None, None, None, None
    if args.resume:
        if not (out / "model.safetensors").is_file():
            raise FileNotFoundError(f"--resume: no checkpoint in {out}; drop --resume to start a new run")
        model, tok = load(out, device="cpu")
        opt_state, resume_state = load_training(out)
        if opt_state is None or resume_state is None:
            raise ValueError(f"--resume: {out} lacks optimizer.pt/train_state.pt (a weights-only checkpoint); "
                             f"start a new run instead")
    elif (out / "model.safetensors").is_file():
        raise ValueError(f"{out} already holds a checkpoint; pass --resume to continue it or choose another --out")
    elif getattr(args, "init_from", None):
        model, tok = load(args.init_from, device="cpu")
        if tok is None:
            raise ValueError(f"--init-from {args.init_from}: the checkpoint has no tokenizer (its token ids would be "
                             f"meaningless); re-save it with one")
    tok, tokens = prepare_data(args, tok, rank, world)
    if model is None:
        model = GPT(build_config(args, tok.vocab_size))
        model.init_weights(seed=args.seed)
    cfg = model.config
    if getattr(args, "freeze_prefix", None) is not None:  # (with --resume pass the same flag again)
        S = args.freeze_prefix
        if S == -1:  # the SNLP suffix of the regulariser: S = L - max(N)
            S = cfg.n_layer - max(resolve_suffixes(cfg.n_layer, parse_suffixes(args.reg_n)))
        freeze_prefix(model, S)
    if args.reg == "hcn" and cfg.hc_streams < 1:
        raise ValueError("--reg hcn needs an mHC model: add --hc-streams N (N >= 1), or use --reg idn")
    detach = args.reg_detach if args.reg_detach is not None else args.reg == "hcn"  # paper: HCN detached, IDN not
    reg = RegConfig(kind=args.reg, lam=args.reg_lambda, suffixes=parse_suffixes(args.reg_n), stride=args.reg_stride,
                    detach=detach, warmup=args.reg_warmup)
    gap_surrogate = args.reg if args.reg in ("hcn", "diag") else "idn"  # the logged K=1 gap uses the regulariser's surrogate
    with warnings.catch_warnings():
        warnings.simplefilter("ignore" if not master else "default")
        gap_suffixes = resolve_suffixes(cfg.n_layer, reg.suffixes) if cfg.n_layer > 1 else []
    model.to(device)
    model.train()
    opts = build_optimizers(model, args)
    progress = Progress(args.steps, args.minutes)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lr_lambda(args, progress)) for o in opts]
    step, micro, elapsed0 = 0, 0, 0.0
    if resume_state is not None:
        for o, s in zip(opts, opt_state["optimizer"]):
            o.load_state_dict(s)
        for sc, s in zip(scheds, opt_state["scheduler"]):
            sc.load_state_dict(s)
        step, micro, elapsed0 = resume_state["step"], resume_state["micro"], resume_state.get("elapsed", 0.0)
        set_rng_state(resume_state["rng"])
    progress.step, progress.elapsed = step, elapsed0
    for sc in scheds:  # LambdaLR evaluated its lambda before progress was restored: refresh the LRs
        for g, f, base in zip(sc.optimizer.param_groups, sc.lr_lambdas, sc.base_lrs):
            g["lr"] = base * f(sc.last_epoch)
    stepper = TrainStep(model, reg)
    if world > 1:
        stepper = nn.parallel.DistributedDataParallel(stepper, device_ids=[device.index] if device.type == "cuda" else None)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda" else nullcontext
    vb = D.val_batches(tokens.val, args.seq_len, args.batch_size, args.eval_batches)
    tok_per_step = args.batch_size * args.seq_len * args.grad_accum * world
    log_path = out / "log.jsonl"
    if master:
        out.mkdir(parents=True, exist_ok=True)
        print(f"snlp train: {cfg.n_layer} layers, width {cfg.n_embd}, {cfg.n_head} heads, vocab {cfg.vocab_size}, "
              f"{model.num_params() / 1e6:.2f}M params | {len(tokens.train):,} train / {len(tokens.val):,} val tokens | "
              f"{tok_per_step} tokens/step on {world} x {device} | reg {args.reg}"
              + (f" lambda={reg.lam} N={gap_suffixes} stride={reg.stride}" if reg.active else ""), flush=True)
    bar = None
    if master and not args.no_progress:
        from tqdm import tqdm
        bar = tqdm(total=args.steps, initial=step, unit="step", dynamic_ncols=True)

    def save(final: bool):
        if master:
            state = {"step": step, "micro": micro, "elapsed": progress.elapsed, "rng": rng_state(), "args": vars(args)}
            save_checkpoint(out, model, tok, optimizer=_Bundle(opts), scheduler=_Bundle(scheds), train_state=state)
        if world > 1:
            dist.barrier()

    def log(rec: dict):
        if master:
            with open(log_path, "a") as f:
                f.write(json.dumps(rec) + "\n")

    t_start = time.perf_counter() - elapsed0
    t_last, last_eval = time.perf_counter(), None
    if step == 0:
        last_eval = evaluate(model, vb, device, autocast, gap_suffixes, gap_surrogate)
        log({"step": 0, **last_eval})
        if master:
            _write(bar, "step 0: " + _fmt(last_eval))
    stop_after = args.stop_after
    while not progress.done() and not (stop_after is not None and step >= stop_after):
        lam = reg.weight(step)
        ce_sum = torch.zeros((), device=device)
        reg_sum = torch.zeros((), device=device)
        for a in range(args.grad_accum):
            x, y = D.batch_at(tokens.train, micro, args.seq_len, args.batch_size, args.seed, rank, world)
            micro += 1
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            sync = nullcontext() if (world == 1 or a == args.grad_accum - 1) else stepper.no_sync()
            with sync:
                with autocast():
                    loss, ce, rg = stepper(x, y, lam)
                (loss / args.grad_accum).backward()
            ce_sum += ce
            reg_sum += rg
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip) if args.grad_clip > 0 else None
        for o in opts:
            o.step()
        for o in opts:
            o.zero_grad(set_to_none=True)
        step += 1
        # progress (time budget): all ranks must agree, so rank 0's clock decides
        el = torch.tensor([time.perf_counter() - t_start], dtype=torch.float64, device=device)
        stats = torch.stack([ce_sum.float(), reg_sum.float()]) / args.grad_accum
        if world > 1:
            dist.broadcast(el, 0)
            dist.all_reduce(stats)
            stats /= world
        progress.step, progress.elapsed = step, float(el)
        for sc in scheds:
            sc.step()
        now = time.perf_counter()
        tps = tok_per_step / max(now - t_last, 1e-9)
        t_last = now
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{stats[0]:.3f}", reg=f"{stats[1]:.3f}", tok_s=f"{tps:,.0f}",
                            lr=f"{scheds[0].get_last_lr()[0]:.2e}", refresh=False)
        if step % args.log_every == 0 or step == 1:
            log({"step": step, "loss": float(stats[0]), "reg": float(stats[1]), "lambda": lam, "tok_s": tps,
                 "elapsed": progress.elapsed, "lr_scale": scheds[0].get_last_lr()[0] / scheds[0].base_lrs[0],
                 "grad_norm": float(gnorm) if gnorm is not None else None})
        if not math.isfinite(float(stats[0])):
            raise FloatingPointError(f"training loss became {float(stats[0])} at step {step}; lower the learning "
                                     f"rates or --reg-lambda")
        end = progress.done() or (stop_after is not None and step >= stop_after)
        if step % args.eval_every == 0 or end:
            last_eval = evaluate(model, vb, device, autocast, gap_suffixes, gap_surrogate)
            log({"step": step, "elapsed": progress.elapsed, **last_eval})
            if master:
                _write(bar, f"step {step}: " + _fmt(last_eval) + f" | train loss {float(stats[0]):.4f}")
        if args.save_every and step % args.save_every == 0 and not end:
            save(False)
    save(True)
    if bar is not None:
        bar.close()
    if master:
        total = time.perf_counter() - t_start
        print(f"saved {out} after {step} steps, {step * tok_per_step:,} tokens in {total:.0f}s "
              f"({step * tok_per_step / max(total, 1e-9):,.0f} tokens/s incl. eval)"
              + (f" | {_fmt(last_eval)}" if last_eval else ""), flush=True)
    return 0


class _Bundle:
    """Several optimizers (or schedulers) saved as one optimizer.pt entry: a list of state dicts."""

    def __init__(self, items):
        self.items = items

    def state_dict(self):
        return [o.state_dict() for o in self.items]


def _fmt(ev: dict) -> str:
    return " ".join(f"{k} {v:.4f}" for k, v in ev.items())


def _write(bar, msg: str) -> None:
    if bar is not None:
        bar.write(msg)
    else:
        print(msg, flush=True)
