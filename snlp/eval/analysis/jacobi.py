"""JD x SNLP coupling (App. "Coupling SNLP with Jacobi Decoding"): naive composition (a fresh SNLP
solve per JD iteration) and h0-JD (deeper chunk states warm-started from the previous JD iteration),
K = 1, 2, lookahead window W, unverified: token match vs sequential greedy, accepted tokens per JD
iteration, JD iterations per round, forwards per token."""

from __future__ import annotations

from dataclasses import dataclass

from snlp.decode.generate import sequential_generate
from snlp.decode.jacobi import jacobi_generate
from snlp.eval.analysis.common import AnalysisConfig, section_bar
from snlp.eval.data import as_tokens, sample_prompts
from snlp.eval.metrics import ar_match
from snlp.method.plan import Plan
from snlp.model.gpt import GPT


@dataclass
class JacobiRow:
    config: str  # naive K=1 | naive K=2 | h0-JD K=1 | h0-JD K=2
    plan: str
    match: float  # positional token match vs sequential greedy
    accept_per_iter: float  # tokens kept per JD iteration
    jd_iters_per_round: float
    forwards_per_token: float
    tokens: int
    jd_iters: int
    forwards: int
    rounds: int


@dataclass
class JacobiResult:
    window: int
    prompts: int
    gen_tokens: int
    rows: list[JacobiRow]

def jacobi_coupling(model: GPT, val_tokens, cfg: AnalysisConfig = AnalysisConfig()) -> JacobiResult:
    """Unverified JD over SNLP (naive / h0-JD, K = 1, 2) vs sequential greedy decoding."""
    L = model.config.n_layer
    prompts = sample_prompts(as_tokens(val_tokens), cfg.jacobi_prompts, cfg.jacobi_prompt_len, cfg.seed)
    ref = [sequential_generate(model, p, max_new_tokens=cfg.jacobi_tokens).tokens for p in prompts]
    heads = list(cfg.jacobi_plans or [h for h in ("8xF1", "12xF1", "4xF3") if Plan.parse(h).n_suffix <= L] or
                 [f"{L}xF1"])
    for h in heads:
        Plan.parse(h, L)  # a clear error for a chunking that does not fit
    rows = []
    configs = [("naive", 1), ("naive", 2), ("h0-JD", 1), ("h0-JD", 2)]
    with section_bar(len(heads) * len(configs) * len(prompts), "jacobi", cfg) as bar:
        for head in heads:
            for kind, K in configs:
                plan = Plan.parse(head).with_(iters=K)
                outs, it, fw, rounds = [], 0, 0, 0
                for p in prompts:
                    r = jacobi_generate(model, p, plan, block=cfg.jacobi_window, max_new_tokens=cfg.jacobi_tokens,
                                        verify=False, warm_start=kind == "h0-JD")
                    outs.append(r.tokens)
                    it, fw, rounds = it + r.jacobi_iters, fw + r.forwards, rounds + r.rounds
                    bar.update()
                n_tok = sum(len(o) for o in outs)
                rows.append(JacobiRow(config=f"{kind} K={K}", plan=str(plan), match=ar_match(outs, ref),
                                      accept_per_iter=n_tok / max(it, 1), jd_iters_per_round=it / max(rounds, 1),
                                      forwards_per_token=fw / max(n_tok, 1), tokens=n_tok, jd_iters=it, forwards=fw,
                                      rounds=rounds))
    return JacobiResult(window=cfg.jacobi_window, prompts=len(prompts), gen_tokens=cfg.jacobi_tokens, rows=rows)

