"""Random nanochat-snlp checkpoints written by the paper's own code, read by snlp, compared with that code in fp64.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python scripts/nanochat_vs_paper.py PATH/TO/nanochat-snlp [FIRST [LAST]]

For each seed in FIRST..LAST-1 (default 0..40) it draws a config of the paper's GPTConfig (depth 2-6, head dims
4-16, GQA, vocabularies padded or not, window patterns with sequence_len 16-512 so that "S" = 128 may be wider than
"L", value embeddings, x0 lambdas, mHC with 1-4 streams and its Sinkhorn settings, MTP heads), builds the paper's
GPT with every parameter drawn at random, writes it with the paper's checkpoint_manager.save_checkpoint in fp32,
bf16, or as its GPU runs store it (bf16 embeddings, fp32 rest), and checks, against the paper's code run in fp64
(nanochat's COMPUTE_DTYPE set to float64 before its model module is imported; its logits leave through .float()):

  fwd      snlp.load(DIR, dtype=float64)'s logits vs the paper's GPT.forward;
  kv       a prefill then one token per call through snlp's KVCache vs the paper's engine KVCache path;
  K>=C     M = 1 plans with K = C vs the paper's forward;
  idn/hcn  M = 1 plans with K < C vs forward_idn_batched / forward_hcn_batched: where every window covers the input
           the plain plan, where a suffix window bites the `causal` plan (the paper's suffix attends fully causally);
  gen      greedy tokens of sequential_generate, snlp_generate (K = C), speculative_generate vs the paper's
           GPT.generate (its full-prefix argmax loop);
  convert  `snlp convert DIR --out OUT` then snlp.load(OUT)'s logits vs the paper's forward;
  train    the training step's CE (snlp.train.job.TrainStep, no regulariser) and its gradients vs the paper's
           forward(idx, targets) without its MTP heads' terms (snlp drops those heads).

The paper's code is imported beside snlp: its package `nanochat` by name, its `snlp/*.py` files by path (its package
`snlp` would shadow ours). Prints one line per seed (`ok` or `BAD` with the max abs differences) and exits 1 on any
BAD. A seed whose checkpoint snlp refuses prints `refused` with the one-line reason (none of the drawn configs is
one snlp documents as refused: mHC comes with no_x0_resid, as the paper's trainer sets it). Results:
docs/records/2026-11-29-nanochat-vs-paper.md.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import os
import random
import sys
import tempfile
import types

import torch

import snlp
from snlp.apps.cli import main as cli_main
from snlp.model.cache import KVCache
from snlp.train.job import TrainStep
from snlp.train.regularizer import RegConfig

TOL = 2e-5  # the paper's logits leave its fp64 forward through .float(): fp32 round-off of values up to 15


def import_paper(root: str) -> types.SimpleNamespace:
    """The paper's modules, computing in fp64. rustbpe / tiktoken (its tokenizer's packages) are stubbed if absent."""
    os.environ["NANOCHAT_DTYPE"] = "float32"
    for name in ("rustbpe", "tiktoken"):
        if importlib.util.find_spec(name) is None:
            sys.modules[name] = types.ModuleType(name)
    sys.path.insert(0, root)
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # its device banner
            import nanochat.common as common
            common.COMPUTE_DTYPE = torch.float64  # read by nanochat.gpt / jacobi_forward / inference_* at import
            import nanochat.engine as engine
            import nanochat.gpt as gpt
            from nanochat.checkpoint_manager import save_checkpoint
            idn = _by_path(root, "snlp/inference_idn.py", "_paper_inference_idn")
            hcn = _by_path(root, "snlp/inference_hcn.py", "_paper_inference_hcn")
    finally:
        sys.path.remove(root)
    logging.getLogger("nanochat.checkpoint_manager").setLevel(logging.WARNING)  # a line per file it saves
    return types.SimpleNamespace(gpt=gpt, engine=engine, save=save_checkpoint, idn=idn, hcn=hcn)


def _by_path(root: str, rel: str, name: str) -> types.ModuleType:
    """A module of the paper's `snlp` folder, by path: its package name would shadow ours."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(root, rel))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def draw_config(rng: random.Random) -> dict:
    hd = rng.choice([4, 6, 8, 12, 16])
    n_head = rng.choice([h for h in (1, 2, 3, 4, 6) if h * hd >= 24])  # the smear gate reads 24 channels
    mhc = rng.random() < 0.35
    return dict(sequence_len=rng.choice([16, 32, 64, 128, 256, 512]), vocab_size=rng.choice([50, 64, 97, 128, 130]),
                n_layer=rng.randint(2, 6), n_head=n_head,
                n_kv_head=rng.choice([k for k in range(1, n_head + 1) if n_head % k == 0]), n_embd=n_head * hd,
                window_pattern=rng.choice(["L", "SSSL", "SL", "S", "SSL", "LS", "sl"]),
                no_x0_resid=mhc or rng.random() < 0.4, no_ve=rng.random() < 0.3, use_mhc=mhc,
                mhc_num_streams=rng.choice([1, 2, 3, 4]), mhc_sinkhorn_iters=rng.choice([1, 3, 10, 20]),
                mhc_sinkhorn_tau=rng.choice([0.05, 0.1, 0.5, 1.0]), num_mtp_steps=rng.choice([0, 0, 1, 2]))


def build(P, kw: dict, seed: int, store: str):
    """The paper's GPT with random parameters, the state it saves (`store`), and the model in fp64 holding it."""
    torch.manual_seed(seed)
    with contextlib.redirect_stdout(io.StringIO()):  # its vocabulary padding note
        m = P.gpt.GPT(P.gpt.GPTConfig(**kw))
    m.init_weights()
    s = (3 / kw["n_embd"]) ** 0.5
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("wte.weight") or n.startswith("value_embeds"):
                p.copy_(torch.randn_like(p))
            elif n == "resid_lambdas":
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif n == "x0_lambdas":
                p.copy_(0.2 * torch.randn_like(p))
            elif n in ("smear_lambda", "backout_lambda"):
                p.copy_(0.3 + 0.4 * torch.rand_like(p))
            elif "H_res_logits" in n:
                p.copy_(0.3 * torch.randn_like(p) - 0.4 + 0.5 * torch.eye(p.shape[0]))
            elif "H_pre_logits" in n or "H_post_logits" in n:
                p.copy_(0.5 * torch.randn_like(p))
            elif n == "lm_head.weight":
                p.copy_(0.3 * torch.randn_like(p))
            else:
                p.uniform_(-s, s)
    emb = ("transformer.wte.", "value_embeds.")
    state = {k: v.to(torch.bfloat16) if store == "bf16" or (store == "mixed" and k.startswith(emb)) else v.float()
             for k, v in m.state_dict().items()}
    m = m.double()
    m.load_state_dict({k: v.double() for k, v in state.items()})
    return m.eval(), state


def err(a, b) -> float:
    return (a.double() - b.double()).abs().max().item()


def check(P, seed: int, root: str) -> tuple[str, dict]:
    rng = random.Random(seed)
    kw, store = draw_config(rng), rng.choice(["fp32", "bf16", "mixed"])
    m, state = build(P, kw, 1000 + seed, store)
    d = os.path.join(root, f"c{seed}")
    P.save(d, 0, state, None, {"step": 0, "model_config": kw, "user_config": {}})
    head = f"#{seed} {store} {kw}"
    try:
        model, _ = snlp.load(d, dtype=torch.float64)
    except ValueError as e:
        return f"refused {head}: {str(e)[:200]}", {}
    L, V = kw["n_layer"], kw["vocab_size"]
    ws = [w for w, _ in m.window_sizes]
    T = min(rng.choice([6, 20, 40, 80, 140]), 10 * kw["sequence_len"])  # the paper's RoPE table: 10 x sequence_len
    idx = torch.randint(0, V, (rng.choice([1, 2]), T), generator=torch.Generator().manual_seed(seed))
    B, res = idx.shape[0], {}
    with torch.no_grad():
        ref = m(idx)
        res["fwd"] = err(model(idx), ref)
        Pf = max(2, T // 2)
        kv = P.engine.KVCache(B, kw["n_kv_head"], T, kw["n_embd"] // kw["n_head"], L, "cpu", torch.float64)
        c = KVCache.for_model(model, batch=B, max_len=T)
        pk = [m(idx[:, :Pf], kv_cache=kv)[:, -1:]] + [m(idx[:, t:t + 1], kv_cache=kv) for t in range(Pf, T)]
        sk = [model(idx[:, :Pf], cache=c)[:, -1:]] + [model(idx[:, t:t + 1], cache=c) for t in range(Pf, T)]
        res["kv"] = err(torch.cat(sk, 1), torch.cat(pk, 1))
        sur = "-hcn" if kw["use_mhc"] else ""
        for n in sorted({1, L, rng.randint(1, L)}):
            res[f"K>=C n{n}"] = err(snlp.parallel_forward(model, idx, f"{n}xF1-h0-K{n}{sur}"), ref)
            S, K = L - n, rng.randint(1, n)
            causal = "" if all(w < 0 or w >= T - 1 for w in ws[S:]) else "-causal"
            if kw["use_mhc"]:
                pr = P.hcn.forward_hcn_batched(m, idx, S, P.hcn.MHCPrecomputedWeights(m, list(range(S, L))), K=K)
            else:
                pr = P.idn.forward_idn_batched(m, idx, S, P.idn.PrecomputedWeights(m, list(range(S, L))), K=K)
            plan = f"{n}xF1-h0-K{K}{sur}{causal}"
            res[plan] = err(snlp.parallel_forward(model, idx, plan), pr)
        prompt = idx[0, :max(2, min(T, 10))].tolist()
        want = list(m.generate(prompt, 8, temperature=0))
        got = {"seq": snlp.sequential_generate(model, prompt, max_new_tokens=8).tokens,
               "snlp": snlp.snlp_generate(model, prompt, f"{L}xF1-h0-K{L}{sur}", max_new_tokens=8).tokens,
               "spec": snlp.speculative_generate(model, prompt, f"{L}xF1-h0-K1{sur}", max_new_tokens=8).tokens}
        res.update({f"gen {k}": float(list(v) != want) for k, v in got.items()})
    out = os.path.join(root, f"o{seed}")
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli_main(["convert", d, "--out", out]) == 0
    with torch.no_grad():
        res["convert"] = err(snlp.load(out, dtype=torch.float64)[0](idx), ref)
    if T > 1:
        y = torch.randint(0, V, idx.shape, generator=torch.Generator().manual_seed(seed + 1))
        y[0, :1] = -1
        m.train()
        if kw["num_mtp_steps"]:  # the paper's loss without its MTP heads' terms: snlp drops those heads
            m.config.num_mtp_steps = 0
            del m.mtp_projs
        m(idx, y).backward()
        model.train()
        loss, _, _ = TrainStep(model, RegConfig(None))(idx, y, 0.0)
        loss.backward()
        pg = dict(m.named_parameters())
        sg = dict(model.named_parameters())
        res["train ce"] = abs(m(idx, y).item() - loss.item())
        res["train grad"] = max(
            [err(sg["wte.weight"].grad, pg["transformer.wte.weight"].grad[:V]),
             err(sg["lm_head.weight"].grad, pg["lm_head.weight"].grad[:V])]
            + [err(sg[f"blocks.{l}.{n}.weight"].grad, pg[f"transformer.h.{l}.{n}.weight"].grad)
               for l in range(L) for n in ("attn.c_q", "attn.c_k", "attn.c_v", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
            + [err(sg[n].grad, pg[n].grad) for n in ("resid_lambdas", "x0_lambdas", "smear_gate.weight",
                                                      "smear_lambda", "backout_lambda") if n in sg])
    bad = {k: v for k, v in res.items() if not v <= TOL}
    return f"{'BAD' if bad else 'ok '} {head} T={T} B={B} windows={ws}", res


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    first = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    last = int(sys.argv[3]) if len(sys.argv) > 3 else first + 40
    torch.set_num_threads(1)
    P = import_paper(os.path.abspath(sys.argv[1]))
    bad = 0
    with tempfile.TemporaryDirectory(prefix="nanochat-vs-paper-") as root:
        for seed in range(first, last):
            line, res = check(P, seed, root)
            bad += line.startswith("BAD")
            print(line, " ".join(f"{k}={v:.1e}" for k, v in res.items()), flush=True)
    print(f"{last - first} seeds, {bad} BAD")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
