"""Chat SFT of a checkpoint with the sequential forward or an SNLP forward (paper, "Downstream task evaluation").

`sft(SFTConfig) -> TrainResult` fine-tunes on conversations (snlp.io.chat: JSONL {"messages": [...]}, or
hf:NAME[:CONFIG][:SPLIT]) with the loss on assistant tokens only, on the sequential logits or, with
`forward` a plan, on the SNLP logits of that plan with gradients through all K iterations (SNLP-forward
SFT); the TrainConfig's regulariser settings add the SNLP-aware regulariser. Optimiser, LR schedule,
checkpoints, resume and DDP are `snlp train`'s (snlp.train.trainer.fit, with the SFT `Job` of `sft_job`).
The command line, `snlp sft`, is snlp.apps.sft.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

import snlp.io.chat as chat
from snlp.io.data import check_val_frac
from snlp.io.checkpoint import load, load_train_state
from snlp.method.jacobian import check_fd_step
from snlp.method.plan import Plan
from snlp.runtime.checks import count_error, number_error
from snlp.model.fingerprint import same_weights, weights_fingerprint
from snlp.train.checkpointing import check_resume_command
from snlp.train.config import TrainConfig, TrainResult, resumed
from snlp.train.compiled import check_compile
from snlp.train.distributed import rank0_first
from snlp.train.hooks import TrainHooks
from snlp.train.job import Job, TrainStep, reg_config
from snlp.train.precision import autocast_context, step_dtype
from snlp.train.regularizer import RegConfig
from snlp.train.pretrain import init_from_checkpoint
from snlp.train.trainer import fit
from snlp.train.validate import validate

SEQUENTIAL = "sequential"


@dataclass
class SFTConfig:
    """An SFT run: start from `ckpt`, train on `data`, save to `train.out`. `train` holds the shared
    optimisation settings (its data/model fields are unused: the model and tokenizer are the checkpoint's)."""

    ckpt: str
    data: str
    train: TrainConfig
    forward: str = SEQUENTIAL  # "sequential" or an SNLP plan string
    max_conversations: int = 0  # 0 = all
    val_frac: float = 0.05

    def plan(self) -> Plan | None:
        return None if self.forward == SEQUENTIAL else Plan.parse(self.forward)


def sft_job(scfg: SFTConfig, base_fingerprint: str | None = None):
    """The `make_job` of `snlp.train.trainer.fit` for SFT (see `fit`). `base_fingerprint`: a resumed run's base
    weights fingerprint (checked against scfg.ckpt by `check_resume_sft`), recorded again in its saves."""

    def make_job(cfg: TrainConfig, model, tok, rank: int, world: int, device) -> Job:
        base_fp = base_fingerprint
        if model is None:  # a new run starts from the checkpoint; --resume passes the run's own
            model, tok = init_from_checkpoint(scfg.ckpt)
            base_fp = weights_fingerprint(model)  # of the weights the run starts from, before any step
        plan = None if scfg.plan() is None else scfg.plan().check_model(model.config)
        if plan is not None:  # a diag:fd eps the step's dtype cannot take (bf16 on CUDA): before the data is read,
            # not at the first step's solve
            check_fd_step(plan, step_dtype(device, model.wte.weight.dtype), torch.device(device).type)
        max_len = min(cfg.seq_len, model.config.sequence_len) + 1
        convs = rank0_first(lambda: chat.load_conversations(scfg.data, scfg.max_conversations), rank, world)
        examples = chat.render(convs, tok, max_len)
        if len(examples) < 2:
            raise ValueError(f"chat data {scfg.data!r} gives {len(examples)} usable conversations (with an "
                             f"assistant reply within {max_len} tokens); need at least 2")
        # conversations without a reply token within max_len are dropped (chat.render): said on the banner, as the
        # paper's loader keeps them (they add no loss there) and a user reading only the counts would not know
        dropped = len(convs) - len(examples)
        train, val = chat.split(examples, scfg.val_frac)
        pad = 0  # any id: padding sits after each row's tokens (causal: unseen) and its targets are -1
        reg = reg_config(cfg, model.config, rank == 0)
        autocast = autocast_context(device)
        # with the mask of each row's real positions: the regulariser averages over them and the trainer counts
        # them as the step's tokens, whatever the padding (the batch's own, or --compile's fixed length)
        batch = lambda micro, r, w: chat.batch_at(train, micro, cfg.batch_size, cfg.seed, pad, r, w,  # noqa: E731
                                                  with_valid=True)
        if cfg.compile:  # static shapes: one graph for every batch, not one per longest conversation
            batch = fixed_length(batch, max_len - 1, pad)
        return Job(model=model, tokenizer=tok,
                   batch=batch,
                   val_batches=chat.val_batches(val, cfg.batch_size * world, cfg.eval_batches, pad),  # global rows
                   loss=TrainStep(model, reg, plan),
                   validate=lambda m, vb: validate(m, vb, device, autocast, [], plan=plan, rows=cfg.batch_size),
                   describe=f"SFT of {scfg.ckpt} with the {plan or 'sequential'} forward on {len(train):,} train / "
                   f"{len(val):,} val conversations of {scfg.data}"
                   + (f" ({dropped:,} dropped: no assistant token within {max_len} tokens)" if dropped else "")
                   + (f" | reg {cfg.reg} lambda={reg.lam}{reg.rows_text(cfg.batch_size)}" if reg.active else ""),
                   name="snlp sft", state={"sft": {**{k: v for k, v in asdict(scfg).items() if k != "train"},
                                                   "data_digest": chat_digest(convs),
                                                   **({"base_fingerprint": base_fp} if base_fp else {})}})

    return make_job


def fixed_length(batch, T: int, pad: int):
    """`batch` with every micro-batch right-padded to T positions (inputs `pad`, targets -1, valid False). The CE
    over the real targets is unchanged (causal attention: the padding comes after every real token, and its targets
    are ignored), and so is the regulariser, whose mean runs over the valid positions only (`relative_error`)."""
    def padded(micro: int, rank: int, world: int):
        x, y, *valid = batch(micro, rank, world)
        n = T - x.shape[1]
        out = F.pad(x, (0, n), value=pad), F.pad(y, (0, n), value=-1)
        return (*out, F.pad(valid[0], (0, n), value=False)) if valid else out
    return padded


# the base's pretraining split, which an SFT checkpoint records so that `snlp eval SFT_CKPT` reads it as the base's
BASE_DATA = ("data", "text_field", "max_chars", "val_frac", "cache_dir", "vocab_size", "data_encoding")
RESUME_FIXED = ("data", "forward", "max_conversations", "val_frac")  # what a resumed SFT run keeps (chats and split,
#                                                                       the forward the loss is on); ckpt may move


def saved_sft(out) -> tuple[dict | None, dict | None]:
    """(the TrainConfig settings, the SFTConfig settings but `train`) saved with the SFT run in `out`; None each
    where `out` holds no run (or one that records none)."""
    if not (Path(out) / "model.safetensors").is_file():
        return None, None
    st = load_train_state(out)
    if not isinstance(st, dict):
        return None, None
    return (st["args"] if isinstance(st.get("args"), dict) else None,
            st["sft"] if isinstance(st.get("sft"), dict) else None)


def resumed_sft(scfg: SFTConfig, given) -> SFTConfig:
    """`scfg` for `snlp sft --resume`: every setting whose flag was not typed (`given`: field names) takes the saved
    run's value (config.resumed). The five LRs are never typed (the command line derives them from --lr-scale, which
    snlp.apps.sft checks against the saved run's), so the saved ones are kept."""
    if not scfg.train.resume or given is None:
        return scfg
    train, own = saved_sft(scfg.train.out)
    keep = {k: v for k, v in (own or {}).items() if k in RESUME_FIXED and k not in given}
    return replace(scfg, train=resumed(scfg.train, train, given), **keep)


def chat_digest(conversations: list) -> str:
    """A digest of conversations as snlp.io.chat.load_conversations gives them (content and order, not paths)."""
    return hashlib.sha256(json.dumps(conversations, sort_keys=True).encode()).hexdigest()


def same_chats(saved: dict, spec: str) -> bool:
    """Whether `spec` names the chats a saved SFT run trained on: the same files named from another folder, or,
    where the saved ones are gone (a moved project), the same conversations in the same order (their digest, as the
    loader reads them: checked where the run recorded it; an older record has nothing to check against)."""
    if chat.resolve_spec(saved["data"]) == chat.resolve_spec(spec):
        return True
    if not chat.missing_parts(saved["data"]):
        return False
    if "data_digest" not in saved:
        return True
    try:
        return chat_digest(chat.load_conversations(spec, saved.get("max_conversations", 0))) == saved["data_digest"]
    except ValueError:  # names nothing readable: not the same chats
        return False


def check_resume_sft(scfg: SFTConfig) -> str | None:
    """Refuse resuming the SFT run in scfg.train.out on other chats, another split or another forward, before any
    loading (the TrainConfig settings are checked by fit, see config.check_resume_settings), or from another base
    checkpoint than the one it started from: the run continues its own weights whatever CKPT names, so another base
    would be named on the banner and in `snlp sft-grid`'s table for a fine-tune of the first (the path may move:
    its weights fingerprint decides). Returns the run's base fingerprint (None: a new run, or an older record)."""
    if not scfg.train.resume:
        return None
    _, own = saved_sft(scfg.train.out)
    now = asdict(scfg)
    diff = [(k, own[k], now[k]) for k in RESUME_FIXED
            if own is not None and k in own and own[k] != now[k] and not (k == "data" and same_chats(own, now[k]))]
    if diff:
        raise ValueError(f"--resume: the SFT run in {scfg.train.out} was saved with "
                         + ", ".join(f"--{k.replace('_', '-')} {was!r} (given: {cur!r})" for k, was, cur in diff)
                         + "; a resumed run keeps its chats, split and forward: give the saved values or start a "
                           "new run in another --out")
    was = (own or {}).get("base_fingerprint")
    if was is not None:
        model, _ = load(scfg.ckpt, device="cpu")
        if not same_weights(was, weights_fingerprint(model)):
            raise ValueError(f"the SFT run in {scfg.train.out} fine-tunes {own.get('ckpt')!r}, whose weights are not "
                             f"{scfg.ckpt}'s: it continues its own weights whatever CKPT says; give the checkpoint it "
                             f"started from, or start a new run in another --out")
    return was


def forward_plan(forward: str, flag: str = "--forward") -> Plan:
    """The plan SFT computes its loss through, refused in one line where it cannot train: the preheat init predicts
    the suffix states from a calibration of fixed weights (`snlp calibrate`), which every SFT step makes stale
    (and the training loop passes none: the solve would refuse it only once the model and data are loaded)."""
    plan = Plan.parse(forward)
    if plan.init == "preheat":
        raise ValueError(f"{flag} {plan}: the preheat init predicts states from a calibration of fixed weights, and "
                         f"SFT changes the weights every step: use the h0 or fwd init")
    return plan


def sft(scfg: SFTConfig, hooks: TrainHooks | None = None) -> TrainResult:
    """Fine-tune `scfg.ckpt` on chats; the checkpoint (with tokenizer) lands in scfg.train.out. `hooks`: as
    for `fit`."""
    scfg.train.check()  # the flags' refusals before the checkpoint is read (fit checks again, for its callers)
    if scfg.train.resume:  # a pretraining (or adapt) run in --out is not continued as an SFT run
        check_resume_command(scfg.train.out, "snlp sft")
    if scfg.forward != SEQUENTIAL:
        plan = forward_plan(scfg.forward)  # a clear error before any loading
        if scfg.train.compile:
            check_compile(RegConfig(), plan)
    # True is an int: max_conversations=True read one conversation (TrainConfig.check's rule of the counts)
    if err := count_error("--max-conversations", scfg.max_conversations) or number_error("--val-frac", scfg.val_frac):
        raise ValueError(err)
    check_val_frac(scfg.val_frac)
    if scfg.max_conversations < 0:  # the loader stops once it holds `limit`: -1 read one conversation
        raise ValueError(f"--max-conversations must be >= 0 (0: all; got {scfg.max_conversations})")
    scfg = replace(scfg, data=chat.resolve_spec(scfg.data))  # recorded absolute: a resume from any folder reads them
    base_fp = check_resume_sft(scfg)
    train = with_base_data(scfg.train, scfg.ckpt)
    saved = saved_sft(train.out)[0] if train.resume else None
    if saved:  # the pretraining split the run recorded for eval, not the base's as read again (moved, re-saved)
        train = replace(train, **{k: saved[k] for k in BASE_DATA if k in saved})
    return fit(train, sft_job(scfg, base_fp), hooks)


def with_base_data(cfg: TrainConfig, ckpt) -> TrainConfig:
    """`cfg` with the base checkpoint's pretraining data settings (defaults where it has none): they
    are saved with the SFT checkpoint, so `snlp eval SFT_CKPT` measures PPL on the pretraining split."""
    base = (load_train_state(ckpt) or {}).get("args", {})
    default = TrainConfig(out="")
    return replace(cfg, **{k: base.get(k, getattr(default, k)) for k in BASE_DATA})
