"""Pretraining from scratch (or from `--init-from` weights): the model of a TrainConfig, the tokenizer and
token cache of its data, and the `Job` that `fit` trains by default."""

from __future__ import annotations

import os
from pathlib import Path

import snlp.io.data as D
from snlp.io.checkpoint import load
from snlp.io.tokenizer import MIN_VOCAB, SPECIAL_TOKENS, Tokenizer
from snlp.model.gpt import GPT, GPTConfig
from snlp.train.config import TrainConfig, check_data_present, check_out_outside_data
from snlp.train.distributed import rank0_first
from snlp.train.job import Job, TrainStep, gap_suffixes, reg_config
from snlp.train.precision import autocast_context
from snlp.train.regularizer import parse_suffixes, resolve_suffixes
from snlp.train.validate import validate

TOKENIZER_CHARS = 20_000_000  # BPE is trained on at most this many characters of the train split


def build_config(cfg: TrainConfig, vocab_size: int) -> GPTConfig:
    """The GPTConfig of a new model: the run's depth dial and shape settings, the tokenizer's vocabulary."""
    return GPTConfig.from_depth(cfg.depth, aspect_ratio=cfg.aspect_ratio, head_dim=cfg.head_dim, width=cfg.width,
                                n_kv_head=cfg.kv_heads, vocab_size=vocab_size, sequence_len=cfg.seq_len,
                                window_pattern=cfg.window_pattern, x0_residual=False if cfg.no_x0 else None,
                                value_embeds=not cfg.no_ve, hc_streams=cfg.hc_streams, hc_dynamic=not cfg.hc_static)


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


def frozen_layers(cfg: TrainConfig, n_layer: int) -> int | None:
    """The S of cfg.freeze_prefix for an n_layer model (None: nothing frozen; -1: S = L - max(N), the regulariser's
    SNLP suffix); a ValueError unless 0 <= S < L."""
    if cfg.freeze_prefix is None:
        return None
    S = cfg.freeze_prefix
    if S == -1:
        S = n_layer - max(resolve_suffixes(n_layer, parse_suffixes(cfg.reg_n), warn=False))
    if not 0 <= S < n_layer:
        raise ValueError(f"--freeze-prefix S={S} must lie in [0, {n_layer - 1}] (the model has {n_layer} layers)")
    return S


def apply_freeze(model: GPT, cfg: TrainConfig) -> None:
    """cfg.freeze_prefix on `model` (`frozen_layers`). A resumed run gets the same TrainConfig, so the same freeze."""
    S = frozen_layers(cfg, model.config.n_layer)
    if S is not None:
        freeze_prefix(model, S)


def check_model_flags(cfg: TrainConfig, model_cfg: GPTConfig | None, tok: Tokenizer | None = None) -> None:
    """Refuse, in one line, what the flags ask of the model before any data is read (a BPE trains and the corpus is
    tokenised first: minutes on the default stdlib corpus, after which a --kv-heads that does not divide the heads, a
    --reg hcn without mHC, a --reg-n of no suffix or a --freeze-prefix past the depth was refused all the same):
    the model's shape (`model_cfg`: a checkpoint's, or None for the flags' own, at the vocabulary of `tok` or else
    of --vocab-size), the regulariser against it and the frozen prefix."""
    if model_cfg is None:
        if tok is None and cfg.vocab_size < MIN_VOCAB:  # the BPE's floor (Tokenizer.train), before its documents load
            raise ValueError(f"--vocab-size must be >= {MIN_VOCAB} (256 bytes + {len(SPECIAL_TOKENS)} specials), got "
                             f"{cfg.vocab_size}")
        model_cfg = build_config(cfg, tok.vocab_size if tok is not None else cfg.vocab_size)
    reg_config(cfg, model_cfg, master=False)  # the run's own call warns of a clipped N once
    frozen_layers(cfg, model_cfg.n_layer)


def init_from_checkpoint(path) -> tuple[GPT, Tokenizer]:
    """Model (on CPU, train mode) and tokenizer of a checkpoint to start a new run from (fine-tuning:
    `snlp sft`, `snlp train --init-from`). Only the weights are taken: optimiser state, step and
    schedule start afresh."""
    model, tok = load(path, device="cpu", need_tokenizer="fine-tuning needs the model's tokenizer")  # before the weights
    model.train()
    return model, tok


def prepare_data(cfg, tok: Tokenizer | None, rank: int, world: int) -> tuple[Tokenizer, D.TokenData]:
    """Tokenizer (trained unless given) and cached token arrays. Rank 0 builds, others wait.
    `cfg` is a TrainConfig (or anything with its data attributes)."""
    cache = Path(cfg.cache_dir) if cfg.cache_dir else D.cache_dir()
    encoding = getattr(cfg, "data_encoding", "utf-8")
    key = D.split_key(cfg.data, cfg.text_field, cfg.max_chars, cfg.val_frac, encoding)
    tok_path = cache / f"{key}-bpe{cfg.vocab_size}.tokenizer.json"

    def build():
        nonlocal tok
        docs = None
        if tok is None and not tok_path.is_file():
            docs = list(D.documents(cfg.data, cfg.text_field, cfg.max_chars, encoding))
            train, _ = D.split_documents(docs, cfg.val_frac)
            tok = Tokenizer.train(_capped(train, TOKENIZER_CHARS), cfg.vocab_size)
            cache.mkdir(parents=True, exist_ok=True)
            tmp = tok_path.with_name(tok_path.name + f".tmp-{os.getpid()}")
            tok.tok.save(str(tmp))
            os.replace(tmp, tok_path)
        tok = tok or Tokenizer.load(tok_path)
        ptrain, pval = D.token_paths(key, tok, cache)
        if not (ptrain.is_file() and pval.is_file()):
            docs = docs if docs is not None else list(D.documents(cfg.data, cfg.text_field, cfg.max_chars, encoding))
            train, val = D.split_documents(docs, cfg.val_frac)
        else:
            train = val = []
        return tok, D.load_tokens(train, val, tok, key, cache)

    return rank0_first(build, rank, world)


def _capped(docs, chars):
    n = 0
    for d in docs:
        yield d
        n += len(d)
        if n >= chars:
            return


def pretrain_job(cfg: TrainConfig, model: GPT | None, tok: Tokenizer | None, rank: int, world: int,
                 device) -> Job:
    """Next-token pretraining on `cfg.data` (random windows of the token cache), with the regulariser.
    `model`/`tok` are given when resuming; otherwise the tokenizer is trained and the model initialised."""
    if model is None and cfg.init_from:  # fine-tuning: the checkpoint's weights and tokenizer
        model, tok = init_from_checkpoint(cfg.init_from)
        if cfg.seq_len > model.config.sequence_len:  # (a resumed run's windows were checked when it started)
            # windows past the checkpoint's context train positions it never decodes at (its KV cache holds
            # sequence_len, which the saved model keeps), as `snlp adapt` refuses them; a new model's context is
            # --seq-len itself (build_config)
            raise ValueError(f"--seq-len {cfg.seq_len} exceeds the context of {cfg.init_from} "
                             f"({model.config.sequence_len} positions), which the fine-tuned model keeps: give "
                             f"--seq-len {model.config.sequence_len} or less")
    check_out_outside_data(cfg.out, cfg.data)
    if cfg.resume:  # a moved project: say so, for library callers and the speedrun too
        check_data_present(cfg)
    check_model_flags(cfg, model.config if model is not None else None, tok)
    tok, tokens = prepare_data(cfg, tok, rank, world)
    if model is None:
        model = GPT(build_config(cfg, tok.vocab_size))
        model.init_weights(seed=cfg.seed)
    reg = reg_config(cfg, model.config, rank == 0)
    suffixes = gap_suffixes(cfg, model.config, reg, rank == 0)
    autocast = autocast_context(device)
    return Job(model=model, tokenizer=tok,
               batch=lambda micro, r, w: D.batch_at(tokens.train, micro, cfg.seq_len, cfg.batch_size, cfg.seed, r, w),
               # the global batch's rows (every rank validates them all, as one process of that batch does): per-process
               # rows would log another number than that process for the same weights
               val_batches=D.val_batches(tokens.val, cfg.seq_len, cfg.batch_size * world, cfg.eval_batches),
               loss=TrainStep(model, reg),
               validate=lambda m, vb: validate(m, vb, device, autocast, suffixes, reg, rows=cfg.batch_size),
               describe=f"{len(tokens.train):,} train / {len(tokens.val):,} val tokens | reg {cfg.reg}"
               + (f" lambda={reg.lam} N={suffixes} stride={reg.stride}{reg.rows_text(cfg.batch_size)}"
                  if reg.active else ""),
               data_digest=D.tokens_digest(tokens))
