"""Write the tiny nanochat(-snlp) checkpoints of tests/io/test_nanochat.py WITH THE PAPER'S OWN CODE, and the
logits that code computes on them (reference.pt beside each checkpoint): its forward, its IDN (nanochat-L) and
HCN (nanochat-mhc) solves, and on inputs its windows cut, its solves (full causal suffix) and its KV-cached path
(nanochat-mix, nanochat-mhc3).

Run once, by hand, with a checkout of the paper's repository (github phymhan/nanochat-snlp, commit 330ce33):

    NANOCHAT_DTYPE=float32 python tests/data/nanochat/make_fixtures.py PATH/TO/nanochat-snlp [NAME ...]

(NAMEs: only those checkpoints.)

It runs in a child process whose sys.path starts with that checkout (its top-level package `snlp` shadows ours
there, never here); its tokenizer packages are stubbed (no generation is needed). Each checkpoint is written by the
paper's `nanochat.checkpoint_manager.save_checkpoint` (`model_000000.pt` + `meta_000000.json`) from the paper's
`GPT` with every parameter drawn at random (so smear, backout, lambdas, gates and mHC maps all matter), rounded to
bf16 and stored in bf16 (small files; the references are computed from the same rounded values in fp32), except
the STORED ones: nanochat-mix keeps only its embeddings in bf16 (as the paper's GPU runs save them), nanochat-mhc3
nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

CHILD = r'''
import importlib.util, json, os, sys, types
import torch
sys.modules["rustbpe"] = types.ModuleType("rustbpe")  # tokenizer packages: not needed to build / run the model
sys.modules["tiktoken"] = types.ModuleType("tiktoken")
try:  # the paper's KV cache (its engine's KVCache) records the decode references
    import nanochat.engine as engine
except ImportError:
    engine = types.ModuleType("nanochat.engine"); engine.KVCache = None
    sys.modules["nanochat.engine"] = engine
from nanochat.gpt import GPT, GPTConfig
from nanochat.checkpoint_manager import save_checkpoint
spec = importlib.util.spec_from_file_location("paper_inference_idn", os.path.join(sys.argv[1], "snlp", "inference_idn.py"))
idn = importlib.util.module_from_spec(spec); spec.loader.exec_module(idn)
spec = importlib.util.spec_from_file_location("paper_inference_hcn", os.path.join(sys.argv[1], "snlp", "inference_hcn.py"))
hcn = importlib.util.module_from_spec(spec); spec.loader.exec_module(hcn)

out = sys.argv[2]
SPECS = {
    # sliding windows (short = 128 at sequence_len 512), value embeddings, x0 lambdas, smear, backout, GQA, MTP head
    "nanochat-sw": dict(sequence_len=512, vocab_size=100, n_layer=6, n_head=2, n_kv_head=1, n_embd=32,
                        window_pattern="SSL", num_mtp_steps=1),
    # full windows: the paper's IDN solve computes the same function, so its plan logits are references too
    "nanochat-L": dict(sequence_len=512, vocab_size=100, n_layer=6, n_head=2, n_kv_head=2, n_embd=32,
                       window_pattern="L"),
    # mHC (static, softmax H_pre / H_post, log-space Sinkhorn with temperature); the paper trains it without x0
    "nanochat-mhc": dict(sequence_len=512, vocab_size=100, n_layer=4, n_head=2, n_kv_head=1, n_embd=32,
                         window_pattern="L", use_mhc=True, mhc_num_streams=4, no_x0_resid=True),
    # the paper's no_x0_resid + no_ve model as its scripts/chat_sft.py saves it: a model_config of the size fields
    # and window_pattern only; the lambdas keep init_weights' values (no_x0_resid keeps them out of the optimizer)
    "nanochat-sft": dict(sequence_len=256, vocab_size=100, n_layer=4, n_head=2, n_kv_head=1, n_embd=32,
                         window_pattern="L", no_x0_resid=True, no_ve=True),
    # the same with value embeddings on (no_x0_resid only), 2 layers
    "nanochat-sft-ve": dict(sequence_len=256, vocab_size=100, n_layer=2, n_head=2, n_kv_head=1, n_embd=32,
                            window_pattern="L", no_x0_resid=True),
    # sequence_len 64: "S" = ceil(64 / 4 / 128) * 128 = 128 is WIDER than "L" = 64, and 140 tokens cross both; an
    # unpadded vocabulary (64), head_dim 6 with 4 query / 2 KV heads, 5 layers (backout at layer 2), two MTP heads;
    # stored as the paper's GPU runs store it: embeddings in bf16 (init_weights casts them to the compute dtype),
    # every other tensor fp32, unrounded
    "nanochat-mix": dict(sequence_len=64, vocab_size=64, n_layer=5, n_head=4, n_kv_head=2, n_embd=24,
                         window_pattern="SSL", num_mtp_steps=2),
    # mHC with 3 streams, 3 Sinkhorn iterations at tau 0.5, no value embeddings; windows "SL" at sequence_len 32
    # (S = 128, L = 32) crossed by 140 tokens; fp32, unrounded
    "nanochat-mhc3": dict(sequence_len=32, vocab_size=50, n_layer=5, n_head=2, n_kv_head=1, n_embd=24,
                          window_pattern="SL", use_mhc=True, mhc_num_streams=3, mhc_sinkhorn_iters=3,
                          mhc_sinkhorn_tau=0.5, no_x0_resid=True, no_ve=True),
}
# checkpoints stored otherwise than all-bf16: name -> the tensors kept in bf16 (the rest fp32, values unrounded)
STORED = {"nanochat-mix": ("transformer.wte.", "value_embeds."), "nanochat-mhc3": ()}
CHAT_SFT = {"nanochat-sft", "nanochat-sft-ve"}
SFT_KEYS = ("sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd", "window_pattern")
only = set(sys.argv[3:])
for name, kw in SPECS.items():
    if only and name not in only:
        continue
    torch.manual_seed(sum(map(ord, name)))
    cfg = GPTConfig(**kw)
    model = GPT(cfg)
    model.init_weights()
    with torch.no_grad():
        s = (3 / cfg.n_embd) ** 0.5
        for pname, p in model.named_parameters():
            if pname.endswith(("wte.weight",)) or pname.startswith("value_embeds"):
                p.copy_(torch.randn_like(p))
            elif pname in ("resid_lambdas", "x0_lambdas") and name in CHAT_SFT:
                pass
            elif pname == "resid_lambdas":
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif pname == "x0_lambdas":
                p.copy_(0.2 * torch.randn_like(p))
            elif pname == "smear_lambda":
                p.fill_(0.7)
            elif pname == "backout_lambda":
                p.fill_(0.35)
            elif "H_res_logits" in pname:
                p.copy_(0.1 * torch.randn_like(p) - 0.4 + 0.5 * torch.eye(p.shape[0]))
            elif "H_pre_logits" in pname or "H_post_logits" in pname:
                p.copy_(0.5 * torch.randn_like(p))
            elif pname == "lm_head.weight":
                p.copy_(0.3 * torch.randn_like(p))
            else:  # projections (c_proj included: zero at init would hide every block), gates, MTP
                p.uniform_(-s, s)
            if name not in STORED or pname.startswith(STORED[name]):
                p.copy_(p.to(torch.bfloat16).float())
    model.eval()
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, cfg.vocab_size, (2, 40 if name in CHAT_SFT else 140 if name in STORED else 160),
                        generator=g)
    ref = {"idx": idx}
    with torch.no_grad():
        ref["logits"] = model(idx)
        if name == "nanochat-L":  # the paper's per-layer IDN solve (M = 1, h0 init), backout reading the iterate
            for S, K in ((2, 1), (2, 2), (0, 2), (4, 1)):
                par = list(range(S, cfg.n_layer))
                pw = idn.PrecomputedWeights(model, par)
                ref[f"idn_S{S}_K{K}"] = idn.forward_idn_batched(model, idx, S, pw, K=K)
        if name == "nanochat-mhc":  # its per-layer HCN solve (A = H_res,mlp H_res,attn), backout reading the iterate
            for S, K in ((1, 1), (0, 2)):
                pw = hcn.MHCPrecomputedWeights(model, list(range(S, cfg.n_layer)))
                ref[f"hcn_S{S}_K{K}"] = hcn.forward_hcn_batched(model, idx, S, pw, K=K)
        if name in STORED:
            # the paper's solves, whose batched suffix attends fully causally (is_causal=True, the windows dropped):
            # references for snlp's -causal plans; the last 40 positions, where the windows bite (cloned: a view
            # would save the whole tensor)
            for S, K in ((2, 1), (0, 3)) if name == "nanochat-mix" else ((1, 2), (0, 1)):
                par = list(range(S, cfg.n_layer))
                if cfg.use_mhc:
                    pw = hcn.MHCPrecomputedWeights(model, par)
                    ref[f"hcn_S{S}_K{K}"] = hcn.forward_hcn_batched(model, idx, S, pw, K=K)[:, -40:].clone()
                else:
                    pw = idn.PrecomputedWeights(model, par)
                    ref[f"idn_S{S}_K{K}"] = idn.forward_idn_batched(model, idx, S, pw, K=K)[:, -40:].clone()
            # the paper's KV-cached decode (its engine's KVCache, SDPA with the window masks): the prefill of the first
            # 100 tokens (its last position's logits), then the 40 others one at a time
            kv = engine.KVCache(2, cfg.n_kv_head, idx.shape[1], cfg.n_embd // cfg.n_head, cfg.n_layer, "cpu",
                                torch.float32)
            steps = [model(idx[:, :100], kv_cache=kv)[:, -1:]]
            steps += [model(idx[:, t:t + 1], kv_cache=kv) for t in range(100, idx.shape[1])]
            ref["kv_P100"] = torch.cat(steps, 1)
    if name in STORED:
        state = {k: v.to(torch.bfloat16) if k.startswith(STORED[name]) else v.float()
                 for k, v in model.state_dict().items()}
    else:
        state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    keys = SFT_KEYS if name in CHAT_SFT else cfg.__dataclass_fields__
    meta = {"step": 0, "model_config": {k: getattr(cfg, k) for k in keys},
            "user_config": {}, "device_batch_size": 1, "max_seq_len": cfg.sequence_len}
    save_checkpoint(os.path.join(out, name), 0, state, None, meta)
    torch.save(ref, os.path.join(out, name, "reference.pt"))
    print(name, {k: tuple(v.shape) for k, v in ref.items()})
'''


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    paper = Path(sys.argv[1]).resolve()
    env = {**os.environ, "NANOCHAT_DTYPE": "float32", "PYTHONPATH": str(paper)}
    return subprocess.call([sys.executable, "-c", CHILD, str(paper), str(HERE), *sys.argv[2:]], env=env,
                           cwd=str(paper))


if __name__ == "__main__":
    sys.exit(main())
