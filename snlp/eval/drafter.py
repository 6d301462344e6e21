"""Evaluate an adapted SNLP drafter against its base (`snlp eval BASE --drafter DIR`).

Rows: the base's post-hoc SNLP drafter (its own suffix layers: the paper's off-the-shelf setting) and the
adapted drafter, for each plan that fits the drafter. Every metric compares with the BASE run sequentially:
  PPL          of the drafter's SNLP logits on held-out windows (teacher-forced, the drafter's own K/V: pure
               SNLP decoding with the drafter, which is its approximation of the model, not the model)
  Top-1, LogitSim   the same logits vs the base's: argmax agreement and mean cosine (paper metrics)
  Top-1 SSD    argmax agreement under self-speculative conditions (snlp.method.ssd_solve: earlier positions'
               K/V exact, as the verifier leaves them), i.e. what a round's first draft sees
  alpha, tokens/round, tokens/s    self-speculative decoding at each block size B on `prompts`
               (snlp.decode.speculative.speculative_benchmark: interleaved with sequential decoding in this
               process, medians over the repeats), whose greedy output must equal the base's (`identical`).

Held-out data: a drafter records the data spec and split it was adapted on (its record's config); every metric
reads that split's held-out part (`drafter_split`, `held_out_tokens`), and chat prompts come from the held-out
conversations of the SAME split function adaptation trained with (snlp.io.chat.split_conversations,
`drafter_prompts`): --chat-prompts must name exactly the drafter's data or exactly one of its chat: parts (paths
compared resolved), each part split on its own as adaptation split it. A --from-model drafter's suffix was trained
by `snlp train` on the tuned checkpoint's data: eval holds out THAT split (recorded in the drafter), or, when the
tuned checkpoint recorded none, asks for explicit held-out data. Settings that contradict the record are
refused: they would measure on training data.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from numbers import Integral

import torch
import torch.nn.functional as F

import snlp.io.chat as chat
import snlp.io.data as D

from snlp.decode.session import check_decode_args, prompt_ids_list
from snlp.decode.speculative import speculative_benchmark
from snlp.eval.data import as_tokens, validation_tokens, windows
from snlp.eval.metrics import logit_sim, perplexity
from snlp.method.drafter import Drafter, make_drafter
from snlp.method.plan import Plan
from snlp.method.solver import solve
from snlp.method.ssd_solve import check_ssd_plan, exact_kv, ssd_solve
from snlp.model.gpt import GPT
from snlp.runtime.device import progress_bar
from snlp.runtime.checks import check_bools
from snlp.runtime.fmt import fmt_share, matches
from snlp.runtime.stats import tie_footnote, tie_mark


@dataclass
class DrafterEvalConfig:
    seq_len: int = 256
    max_tokens: int = 4096
    batch: int = 4
    blocks: tuple[int, ...] = (2, 4, 8)
    gen_tokens: int = 64
    repeats: int = 1
    warmup: int = 1
    progress: bool = False

    def __post_init__(self) -> None:
        """Refuse out-of-range settings before any work (`blocks=(0,)` ran the quality rows and failed, or not, in
        the SSD rows; a bare int for `blocks` failed there too). `blocks` may be empty: the block sizes serve only
        the SSD rows, which run only with prompts, so a quality-only evaluation needs none; evaluate_drafter refuses
        prompts without a block size, before any work."""
        check_bools(progress=self.progress)
        low = [f"{k}={getattr(self, k)!r}" for k in ("seq_len", "max_tokens", "batch", "gen_tokens", "repeats")
               if not isinstance(getattr(self, k), Integral) or getattr(self, k) < 1]
        if not isinstance(self.warmup, Integral) or self.warmup < 0:
            low.append(f"warmup={self.warmup!r}")
        blocks = self.blocks
        if not isinstance(blocks, (tuple, list)) or any(
                not isinstance(b, Integral) or isinstance(b, bool) or b < 1 for b in blocks):
            low.append(f"blocks={blocks!r}")
        if low:
            raise ValueError(f"drafter evaluation settings out of range: {', '.join(low)} (blocks: a tuple of draft "
                             f"block sizes >= 1, empty for no SSD rows; warmup >= 0; the others integers >= 1)")
        self.blocks = tuple(int(b) for b in blocks)


@dataclass
class DrafterRecord:
    """One row: `drafter` is "post-hoc" (the base's own suffix) or "adapted"; `ssd` one dict per block size
    (SSDRow fields: alpha, tokens_per_round, measured_speedup, ... and matches_sequential)."""

    plan: str
    drafter: str
    ppl: float
    ppl_base: float
    top1: float
    logit_sim: float
    top1_ssd: float | None
    tokens: int
    ssd: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class DrafterSplit:
    """The adaptation data of a drafter (its record's config): the spec, the held-out fraction and the text cap
    that `snlp adapt` split it with."""

    data: str
    val_frac: float
    max_chars: int = 0
    keep: tuple[str, ...] | None = None  # eval's --data: these parts of `data` only (their held-out part)
    tuned: dict | None = None  # a --from-model drafter: `snlp train`'s data settings of the tuned suffix


def records_split(record: dict | None) -> bool:
    """Whether a drafter's record names the split eval measures it on (its adaptation data, or a --from-model
    drafter's tuned split); without one `drafter_split` is None and eval reads the checkpoint's recorded split."""
    cfg = (record or {}).get("config") or {}
    return bool(cfg.get("from_model")) or ("data" in cfg and "val_frac" in cfg)


def drafter_split(record: dict, data: str | None = None, val_frac: float | None = None, max_chars: int | None = None,
                  text_field: str | None = None, cache_dir: str | None = None) -> DrafterSplit | None:
    """The split a drafter was adapted with (None when its record holds none: an older or hand-made drafter).
    `val_frac`, `max_chars` (eval's flags; None = not given) must agree with it and `data` must name parts of
    its data spec (their held-out part is then read, `keep`), else a ValueError: any other split can put the
    drafter's training data into what eval holds out. `text_field` and `cache_dir` do not apply (adaptation
    reads the "text" field and tokenizes afresh) and are refused."""
    cfg = (record or {}).get("config") or {}
    if cfg.get("from_model"):
        return tuned_drafter_split(record, data, val_frac, max_chars, text_field, cache_dir)
    if not records_split(record):
        return None
    rec = DrafterSplit(data=cfg["data"], val_frac=float(cfg["val_frac"]), max_chars=int(cfg.get("max_chars") or 0))
    if data is not None:
        have = D.parts(chat.resolve_spec(rec.data))
        alien = [p for p in D.parts(data) if chat.resolve_part(p) not in have]
        if alien:
            raise ValueError(f"--data {data!r} contradicts the drafter's adaptation split: {', '.join(alien)} is not "
                             f"part of its data {rec.data!r}; eval measures a drafter on the held-out part of its own "
                             f"data, so name parts of it or leave --data out")
        rec.keep = tuple(chat.resolve_part(p) for p in D.parts(data))
        rec.data = chat.resolve_spec(rec.data)  # keep's form (an older record's relative paths: from this cwd)
    for flag, given, want in (("--val-frac", val_frac, rec.val_frac), ("--max-chars", max_chars, rec.max_chars)):
        if given is not None and given != want:
            raise ValueError(f"{flag} {given!r} contradicts the drafter's adaptation split ({flag} {want!r}): eval "
                             f"measures a drafter on its own held-out data, so leave {flag} out")
    if text_field not in (None, "text") or cache_dir is not None:
        raise ValueError("--text-field / --cache-dir do not apply with --drafter: the drafter's held-out split is "
                         "read as its adaptation read it (the 'text' field, tokenized afresh)")
    return rec


def tuned_drafter_split(record: dict, data, val_frac, max_chars, text_field, cache_dir) -> DrafterSplit | None:
    """The held-out split of a --from-model drafter: its suffix was trained by `snlp train` on the tuned
    checkpoint's data, not on the adapt command's --data. The tuned checkpoint's recorded split (eval flags may
    only repeat it), else None when held-out data is given explicitly (--data: the caller's word), else a
    ValueError asking for it."""
    tuned = (record or {}).get("tuned") or {}
    src = tuned.get("src") or record["config"]["from_model"]
    split = tuned.get("split")
    if split is None:
        if data is not None:
            return None
        raise ValueError(f"this drafter packages the suffix of --from-model {src}, trained by `snlp train` on data "
                         f"the drafter does not record: pass held-out data explicitly (--data, --val-frac) that "
                         f"{src}'s training did not see")
    given = {"data": data, "val_frac": val_frac, "max_chars": max_chars, "text_field": text_field,
             "cache_dir": cache_dir}
    bad = [k for k, v in given.items() if v is not None and k != "cache_dir"
           and (chat.resolve_spec(v) if k == "data" else v) != split[k]]
    if bad:
        raise ValueError(f"{', '.join('--' + k.replace('_', '-') for k in bad)} contradict(s) the split {src} was "
                         f"trained on ({', '.join(f'{k}={split[k]!r}' for k in bad)}): this --from-model drafter is "
                         f"measured on that training run's held-out part, so leave them out")
    tuned_split = {**split, "cache_dir": cache_dir if cache_dir is not None else split.get("cache_dir")}
    return DrafterSplit(data=split["data"], val_frac=float(split["val_frac"]),
                        max_chars=int(split.get("max_chars") or 0), tuned=tuned_split)


def held_out_tokens(split: DrafterSplit, tok) -> torch.Tensor:
    """The held-out token stream of a drafter's adaptation split (its `val` stream, snlp.io.chat.token_streams;
    a --from-model drafter's: the tuned checkpoint's validation split as `snlp train` made it)."""
    if split.tuned is not None:
        return validation_tokens(tok, **split.tuned)
    return torch.from_numpy(chat.token_streams(split.data, tok, split.max_chars, split.val_frac, train=False,
                                               keep=split.keep)[1])


def held_out_prompts(spec: str, tok, val_frac: float, n: int) -> list[list[int]]:
    """Token ids of the first `n` held-out conversations' openings (through the first user turn, with the
    generation prompt) of the chat set `spec` (chat:PATH or PATH), split by snlp.io.chat.split_conversations at
    `val_frac`: the conversations `snlp adapt` held out of training at that fraction."""
    _, val = chat.split_conversations(chat.load_conversations(chat.chat_part(spec)), tok, val_frac)
    return [tok.render_chat(chat.prompt_messages(e.messages), add_generation_prompt=True)[0] for e in val[:n]]


def drafter_prompts(split: DrafterSplit | None, spec: str, tok, val_frac: float, n: int) -> list[list[int]]:
    """The --chat-prompts SPEC prompts of a drafter eval, refusing any SPEC whose split could differ from the one
    adaptation trained with: SPEC must be exactly the drafter's recorded data (its chat: parts' held-out
    conversations, each part split on its own, in order) or exactly one of its chat: parts (paths compared
    resolved; a bare PATH means chat:PATH). A folder, glob or comma list grouping the same files otherwise is
    split otherwise, and its "held-out" part holds training conversations. A --from-model drafter (`tuned`):
    SPEC must not be part of the tuned checkpoint's training data. No recorded split (older drafter): as given."""
    if split is None:
        return held_out_prompts(spec, tok, val_frac, n)
    given = [chat.resolve_part(p if p.startswith("chat:") else "chat:" + p) for p in D.parts(spec)]
    if split.tuned is not None:
        trained = D.parts(split.data)
        if any(chat.chat_part(g) in trained for g in given):
            raise ValueError(f"--chat-prompts {spec!r} is part of the data {split.data!r} the --from-model drafter's "
                             f"suffix was trained on: name a chat set its training did not read")
        return held_out_prompts(spec, tok, val_frac, n)
    have = D.parts(chat.resolve_spec(split.data))
    parts = [p for p in have if p.startswith("chat:")]
    if D.parts(chat.resolve_spec(spec)) == have and parts:
        pick = parts  # the whole adaptation spec: every chat part's held-out conversations
    elif len(given) == 1 and given[0] in parts:
        pick = given
    else:
        raise ValueError(f"--chat-prompts {spec!r} is neither the drafter's adaptation data nor exactly one of its "
                         f"chat parts ({', '.join(parts) or 'none'}): another grouping of the files is split otherwise "
                         f"and holds training conversations; name one of those parts")
    out = []
    for p in pick:
        out += held_out_prompts(p, tok, val_frac, n - len(out))
    return out[:n]


@torch.inference_mode()
def quality(base: GPT, drafter: Drafter, wins: torch.Tensor, batch: int, progress: bool = False) -> dict:
    """PPL of the drafter's SNLP logits and of the base, Top-1 / LogitSim vs the base, and Top-1 under SSD
    conditions (None for plans ssd_solve does not cover) over the windows wins (W, T + 1)."""
    plan, dev = drafter.plan, base.wte.weight.device
    S = plan.prefix_len(base.config.n_layer)
    try:
        check_ssd_plan(plan)
        ssd = True
    except ValueError:
        ssd = False
    acc = dict(nll=0.0, nll_base=0.0, top1=0.0, sim=0.0, top1_ssd=0.0, n=0)
    batches = wins.split(batch)
    with progress_bar(len(batches), f"quality {plan}", progress) as bar:
        for b in batches:
            x, y = b[:, :-1].to(dev), b[:, 1:].to(dev)
            ctx = base.embed(x)
            trace = [ctx.x0]
            ref = base.head(base.run_layers(ctx.x0, ctx, 0, base.config.n_layer, trace))  # (B, T, V)
            lg = drafter.model.head(solve(drafter.model, x, plan, prefix=trace[S], check_finite=False,
                                          hb=base.prefix_backout(trace, S)).hidden)
            n = y.numel()
            acc["nll"] += F.cross_entropy(lg.flatten(0, 1), y.flatten(), reduction="sum").item()
            acc["nll_base"] += F.cross_entropy(ref.flatten(0, 1), y.flatten(), reduction="sum").item()
            acc["top1"] += (lg.argmax(-1) == ref.argmax(-1)).double().sum().item()
            acc["sim"] += logit_sim(lg, ref) * n
            if ssd:
                hs = ssd_solve(drafter.model, x, plan, trace[S], exact_kv(base, trace, plan, ctx))
                acc["top1_ssd"] += (drafter.model.head(hs).argmax(-1) == ref.argmax(-1)).double().sum().item()
            acc["n"] += n
            bar.update()
    n = acc["n"]
    return dict(ppl=perplexity(acc["nll"], n), ppl_base=perplexity(acc["nll_base"], n), top1=acc["top1"] / n,
                logit_sim=acc["sim"] / n, top1_ssd=acc["top1_ssd"] / n if ssd else None, tokens=n)


def evaluate_drafter(base: GPT, drafter: Drafter, val_tokens, prompts: list[list[int]], plans: list[Plan] | None = None,
                     cfg: DrafterEvalConfig = DrafterEvalConfig(), eos_id: int | None = None) -> list[DrafterRecord]:
    """Post-hoc and adapted rows for each plan (default: the drafter's own) that fits the drafter (same
    suffix layout; K, init and surrogate may differ). `prompts`: token ids for the SSD rows (none: no SSD rows)."""
    if prompts and not cfg.blocks:  # the SSD rows would fail after every quality row had run
        raise ValueError(f"drafter evaluation: {len(prompts)} prompt{'s' * (len(prompts) != 1)} for the SSD rows but no draft "
                         f"block size (DrafterEvalConfig.blocks is empty): give block sizes, or no prompts for quality "
                         f"rows only")
    # the SSD rows' prompts and decode settings too: they run after every plan's quality rows
    prompts = [prompt_ids_list(base, p) for p in prompts or []]
    for b in cfg.blocks if prompts else ():
        check_decode_args(cfg.gen_tokens, 0.0, b)
    drafter.check(base)
    plans = [drafter.check_plan(p) for p in plans or [drafter.plan]]
    pre = [str(p) for p in plans if p.init == "preheat"]
    if pre:  # refused before any work: the drafter rows take no calibration (the CLI cannot pass one)
        raise ValueError(f"plan {', '.join(pre)} starts from the preheat init, which drafter eval does not take (no "
                         f"calibration is passed to it): use the -h0 or -fwd init of the plan")
    wins = windows(as_tokens(val_tokens), cfg.seq_len, cfg.max_tokens)
    rows = []
    for plan in plans:
        adapted = Drafter(model=drafter.model, plan=plan, base_fingerprint=drafter.base_fingerprint)
        posthoc = make_drafter(base, plan, fingerprint=drafter.base_fingerprint)
        for name, d in (("post-hoc", posthoc), ("adapted", adapted)):
            q = quality(base, d, wins, cfg.batch, cfg.progress)
            ssd = []
            if prompts:
                srows, _ = speculative_benchmark(base, prompts, plan, cfg.blocks, cfg.gen_tokens, cfg.repeats,
                                                 cfg.warmup, eos_id=eos_id, progress=cfg.progress, drafter=d)
                ssd = [r.to_dict() for r in srows]
            rows.append(DrafterRecord(plan=str(plan), drafter=name, ssd=ssd, **q))
    return rows


def markdown(rows: list[DrafterRecord]) -> str:
    """The rows as a markdown table: one line per (row, block size)."""
    out = ["| plan | drafter | PPL (base) | Top-1 | LogitSim | Top-1 SSD | B | alpha | tokens/round | tok/s vs seq "
           "| identical |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t1s = fmt_share(r.top1_ssd, sep=" ")  # never rounded onto 100 % from inside (one position in 2,000 differs)
        head = (f"| {r.plan} | {r.drafter} | {r.ppl:.4g} ({r.ppl_base:.4g}) | {fmt_share(r.top1, sep=' ')} | "
                f"{r.logit_sim:.3f} | {t1s} ")
        if not r.ssd:
            out.append(head + "| - | - | - | - | - |")
        for s in r.ssd:
            alpha = "–" if s["alpha"] is None else f"{s['alpha']:.3f}"  # None: nothing drafted (one new token)
            out.append(head + f"| {s['block']} | {alpha} | {s['tokens_per_round']:.2f} | "
                       f"{s['measured_speedup']:.2f}x{tie_mark(s.get('round_speedups'))} | "
                       f"{matches(s['matches_sequential'])} |")
    # the speedup is the median of the paired per-round ratios (SSDRow): a ratio its rounds do not resolve from
    # 1.00x by the sign test is marked where it is printed, as every other speed table marks it
    tied = [s for r in rows for s in r.ssd if tie_mark(s.get("round_speedups"))]
    if tied:
        out += ["", tie_footnote(max(len(s["round_speedups"]) for s in tied), "tok/s vs seq",
                                 "sequential over this drafter's ms per token of the same round, every prompt decoded "
                                 "by both", of_medians=False)]
    return "\n".join(out)
