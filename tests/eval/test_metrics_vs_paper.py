"""snlp eval's metrics against the paper's own evaluator (nanochat-snlp: snlp/eval_snlp.py's eval_ppl and
compute_top1_cossim, snlp/eval_snlp_ar.py's ar_generate_no_kv, snlp/inference_idn.py's load_val_data windows), run
from its source files on one model (the paper's GPT, its weights copied into ours) and the same tokens. The functions
are taken from the files by name and run beside ours, never copied. Skips, saying so, where no checkout of the
paper's code is beside the repository (tests/bench/test_vs_paper.py's rule)."""

from __future__ import annotations

import ast
import math
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.bench.test_vs_paper import PAPER, needs_paper


def paper_functions(relpath: str, names: set[str], **env) -> dict:
    """The top-level functions `names` of the paper's file `relpath`, compiled alone (its module imports the
    paper's own `snlp` package, which ours shadows), decorators dropped, with `env` as their globals."""
    tree = ast.parse((Path(PAPER) / relpath).read_text())
    body = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
    assert {n.name for n in body} == names, f"{relpath} no longer defines {names}"
    for n in body:
        n.decorator_list = []
    scope = {"torch": torch, "F": F, "math": math, **env}
    exec(compile(ast.Module(body=body, type_ignores=[]), str(Path(PAPER) / relpath), "exec"), scope)
    return scope


@pytest.fixture(scope="module")
def models():
    from snlp.bench.paper_peer import build_paper_model, load_paper_code, snlp_model_from_paper

    code = load_paper_code(PAPER, torch.float32)
    cfg = code.gpt.GPTConfig(sequence_len=64, vocab_size=256, n_layer=4, n_head=2, n_kv_head=2, n_embd=64,
                             window_pattern="L")
    paper = build_paper_model(code, cfg, torch.device("cpu"))
    with torch.no_grad():  # larger branches and logits, so plans and the sequential model disagree visibly
        for b in paper.transformer.h:
            b.attn.c_proj.weight.mul_(30.0)
            b.mlp.c_proj.weight.mul_(30.0)
        paper.lm_head.weight.mul_(30.0)
    return snlp_model_from_paper(paper, "cpu", torch.float32)


VAL = torch.randint(0, 256, (1200,), generator=torch.Generator().manual_seed(1))


@needs_paper
@pytest.mark.parametrize("plan", ["2xF1-h0-K1", "4xF1-h0-K1", "2xF2-h0-K1"])
def test_ppl_top1_and_logit_sim_are_the_paper_evaluators_on_the_same_windows(models, plan):
    """PPL (the paper: exp of the mean of per-window mean CEs; ours token-weighted: equal, every window holds seq_len
    targets), Top-1 (argmax vs the sequential argmax) and LogitSim (fp32 cosine over the vocabulary) of our
    teacher-forced pass equal the paper evaluator's on every window."""
    from snlp.eval.config import EvalConfig
    from snlp.eval.data import windows
    from snlp.eval.protocol import SEQ, teacher_forced
    from snlp.method.plan import Plan
    from snlp.method.solver import bind

    E = paper_functions("snlp/eval_snlp.py", {"eval_ppl", "compute_top1_cossim"})
    model = models
    wins = windows(VAL, 32, 320)  # (10, 33)
    q = teacher_forced(model, wins, [Plan.parse(plan, 4)], EvalConfig(seq_len=32, max_tokens=320, batch=4,
                                                                        progress=False))
    fn, batches = bind(model, Plan.parse(plan, 4)), [w[None] for w in wins]
    with torch.inference_mode():
        ppl, seq_ppl = E["eval_ppl"](fn, batches), E["eval_ppl"](model, batches)
        top1, cos = E["compute_top1_cossim"](model, fn, batches, 100)
    ours = q[plan]
    assert ours.ppl == pytest.approx(ppl, rel=1e-6) and q[SEQ].ppl == pytest.approx(seq_ppl, rel=1e-6)
    assert ours.top1 == pytest.approx(top1, abs=1e-9) and ours.logit_sim == pytest.approx(cos, abs=1e-6)
    assert ours.top1 < 0.9  # the plan disagrees with sequential: the comparison is not 1.0 == 1.0


@needs_paper
@pytest.mark.parametrize("plan", ["4xF1-h0-K1", "2xF2-h0-K1", "4xF1-h0-K2", "4xF1-h0-K3"])
def test_ar_tokens_are_the_paper_evaluators_recomputed_greedy_tokens(models, plan):
    """AR Match's generations (sequential and plan) are the tokens of the paper's ar_generate_no_kv (the whole
    prefix re-run through the method's forward at every step), so AR Match counts the same matches; K = 2, 3 < C
    too, where KV-cached SNLP decoding computes another function."""
    from snlp.eval.config import EvalConfig
    from snlp.eval.data import sample_prompts
    from snlp.eval.metrics import ar_match
    from snlp.eval.protocol import SEQ, generations
    from snlp.method.plan import Plan
    from snlp.method.solver import bind

    A = paper_functions("snlp/eval_snlp_ar.py", {"ar_generate_no_kv", "_call_forward"}, device=torch.device("cpu"))
    model, p = models, Plan.parse(plan, 4)
    prompts = sample_prompts(VAL, 3, 16, 0)
    gens, _ = generations(model, prompts, [p], EvalConfig(prompts=3, gen_tokens=12, progress=False))
    fn = bind(model, p)
    paper_plan = [A["ar_generate_no_kv"](fn, x, 12) for x in prompts]
    paper_seq = [A["ar_generate_no_kv"](model, x, 12) for x in prompts]
    assert gens[plan] == paper_plan and gens[SEQ] == paper_seq
    # the paper's count: matches over the first `cutoff` tokens of each sample / (samples * cutoff)
    paper_rate = sum(a == b for g, r in zip(paper_plan, paper_seq) for a, b in zip(g, r)) / (3 * 12)
    assert ar_match(gens[plan], gens[SEQ]) == paper_rate


@needs_paper
def test_max_tokens_is_a_cap_here_and_the_papers_loop_overshoots_it(monkeypatch):
    """Both take seq_len + 1 tokens at a stride of seq_len; the paper's load_val_data adds windows while fewer than
    max_tokens are taken (a ceiling), ours takes as many as fit under max_tokens (a cap), the difference
    docs/usage.md names (--max-tokens 1000000 --seq-len 2048: 489 windows there, 488 here)."""
    from snlp.eval.data import windows

    class Tok:
        def get_bos_token_id(self):
            return 0

        def encode(self, text, prepend=None):
            return VAL.tolist()

    table = types.SimpleNamespace(column=lambda name: types.SimpleNamespace(to_pylist=lambda: ["one document"]))
    parquet = types.ModuleType("pyarrow.parquet")
    parquet.read_table = lambda *a, **k: table
    monkeypatch.setitem(sys.modules, "pyarrow", types.ModuleType("pyarrow"))
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", parquet)
    tokenizer = types.ModuleType("nanochat.tokenizer")
    tokenizer.get_tokenizer = Tok
    monkeypatch.setitem(sys.modules, "nanochat.tokenizer", tokenizer)
    monkeypatch.setenv("NANOCHAT_BASE_DIR", "/nonexistent")
    import os

    L = paper_functions("snlp/inference_idn.py", {"load_val_data"}, os=os)
    for max_tokens, seq_len in [(300, 32), (320, 32), (1000, 64)]:
        theirs = L["load_val_data"](torch.device("cpu"), max_tokens=max_tokens, seq_len=seq_len)
        ours = windows(VAL, seq_len, max_tokens)
        assert all(torch.equal(t[0], o) for t, o in zip(theirs, ours))  # the same windows, in order
        assert len(theirs) == math.ceil(max_tokens / seq_len) and ours.shape[0] == max_tokens // seq_len
