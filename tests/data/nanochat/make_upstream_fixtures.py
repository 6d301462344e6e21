"""Write one tiny checkpoint per distinguishable version ("era") of upstream nanochat WITH THAT VERSION'S OWN CODE,
and the logits that code computes on it (reference.pt beside each): tests/io/test_nanochat.py checks that
snlp.load gives them (or refuses the checkpoint in one line where the files cannot say which version wrote it).

Run once, by hand, with a clone (a bare one will do) of github karpathy/nanochat that holds the commits below:

    python tests/data/nanochat/make_upstream_fixtures.py PATH/TO/nanochat[.git]

Each commit is exported (`git archive`) to a temporary directory and run in a child process whose sys.path starts
with that tree, with NANOCHAT_DTYPE=float32 (read from 2026-03-04 on) and no GPU: the fp32 CPU forward of that
version (its SDPA attention; the flash-attention-3 kernel is loaded on Hopper GPUs only). Its tokenizer module is
stubbed (no generation is needed). Each checkpoint is that version's `GPT` with every parameter drawn at random
(so lambdas, gates, smear and backout all matter), rounded to bf16 and stored in bf16 by that version's
`checkpoint_manager.save_checkpoint` (model_000000.pt + meta_000000.json whose model_config holds that version's
GPTConfig fields, as its base_train writes them); the references are computed from the same rounded values in fp32.

The commit of each era is its last one (snlp.io.nanochat documents the eras), except the lambdas-without-windows
era, whose last commit (2ff7d51) imports flash-attention-3 unconditionally and so cannot run on a CPU: its last
commit before that (201d705) has the same model code with PyTorch's SDPA attention.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

# directory name -> (commit, GPTConfig fields, token ids (batch, length)). sequence_len and the lengths are picked so
# that each era's windows are crossed: 128 with 160 tokens (the full-context eras attend past sequence_len, the
# windowed ones do not; "S" = 64 there), and for f068604 512 with 272 tokens ("S" = ceil(512 / 3 / 128) * 128 =
# 256 there, 128 under the later quarter rule). upstream-184d4c1's reference also holds `logits_L`: the same weights
# run by that code with window_pattern "L", which is how its loader runs a midtrained checkpoint (whose meta has no
# window_pattern), at the positions past sequence_len.
BASE = dict(vocab_size=100, n_layer=4, n_head=2, n_kv_head=1, n_embd=32)
ERAS = {
    "upstream-2c4473d": ("2c4473d", dict(BASE, sequence_len=128), (2, 160)),
    "upstream-201d705": ("201d705", dict(BASE, sequence_len=128), (2, 160)),
    "upstream-184d4c1": ("184d4c1", dict(BASE, sequence_len=128, window_pattern="SSL"), (2, 160)),
    "upstream-83dccc2": ("83dccc2", dict(BASE, sequence_len=128, window_pattern="SSL"), (2, 160)),
    "upstream-1076f97": ("1076f97", dict(BASE, sequence_len=128, window_pattern="SSL"), (2, 160)),
    "upstream-f068604": ("f068604", dict(BASE, sequence_len=512, window_pattern="SSL"), (1, 272)),
    "upstream-92d63d4": ("92d63d4", dict(BASE, sequence_len=512, window_pattern="SSL"), (2, 160)),
}

CHILD = r'''
import json, os, sys, types
import torch
tok = types.ModuleType("nanochat.tokenizer"); tok.get_tokenizer = None  # not needed to build / run the model
sys.modules["nanochat.tokenizer"] = tok
from nanochat.gpt import GPT, GPTConfig
from nanochat.checkpoint_manager import save_checkpoint

out, name, kw, shape = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
cfg = GPTConfig(**kw)
torch.manual_seed(sum(map(ord, name)))
model = GPT(cfg)
model.init_weights()
with torch.no_grad():
    s = (3 / cfg.n_embd) ** 0.5
    for pname, p in model.named_parameters():
        if pname.endswith("wte.weight") or pname.startswith("value_embeds"):
            p.copy_(torch.randn_like(p))
        elif pname == "resid_lambdas":
            p.copy_(1 + 0.1 * torch.randn_like(p))
        elif pname == "x0_lambdas":
            p.copy_(0.2 * torch.randn_like(p))
        elif pname == "smear_lambda":
            p.fill_(0.7)
        elif pname == "backout_lambda":
            p.fill_(0.35)
        elif pname == "lm_head.weight":
            p.copy_(0.3 * torch.randn_like(p))
        else:  # projections (c_proj included: zero at init would hide every block), gates
            p.uniform_(-s, s)
        p.copy_(p.to(torch.bfloat16).float())
assert all(p.dtype == torch.float32 for p in model.parameters())  # the CPU model: fp32 weights
model.eval()  # its buffers as that version keeps them (RoPE tables in bf16 before 2026-03-04)
idx = torch.randint(0, cfg.vocab_size, shape, generator=torch.Generator().manual_seed(1))
with torch.no_grad():
    logits = model(idx)
assert logits.dtype == torch.float32 and logits.shape == (*shape, cfg.vocab_size), (logits.dtype, logits.shape)
ref = {"idx": idx, "logits": logits}
if name == "upstream-184d4c1":  # as nanochat's loader runs this model from a meta without window_pattern
    # (scripts/mid_train.py wrote none until 2026-01-31): its "L" windows, the same weights
    model_L = GPT(GPTConfig(**{**kw, "window_pattern": "L"}))
    model_L.init_weights()
    model_L.load_state_dict(model.state_dict())
    with torch.no_grad():
        ref["logits_L"] = model_L.eval()(idx)[:, cfg.sequence_len:].clone()  # past sequence_len (file size)
state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
meta = {"step": 0, "model_config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}, "user_config": {},
        "device_batch_size": 1, "max_seq_len": cfg.sequence_len}
save_checkpoint(os.path.join(out, name), 0, state, None, meta)
torch.save(ref, os.path.join(out, name, "reference.pt"))
print(name, sorted(state), tuple(logits.shape), flush=True)
'''


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    import json

    repo = Path(sys.argv[1]).resolve()
    for name, (commit, kw, shape) in ERAS.items():
        with tempfile.TemporaryDirectory() as tree:
            archive = subprocess.run(["git", "-C", str(repo), "archive", commit], check=True, capture_output=True)
            subprocess.run(["tar", "-x", "-C", tree], input=archive.stdout, check=True)
            env = {**os.environ, "NANOCHAT_DTYPE": "float32", "PYTHONPATH": tree, "CUDA_VISIBLE_DEVICES": ""}
            rc = subprocess.call([sys.executable, "-c", CHILD, str(HERE), name, json.dumps(kw), json.dumps(shape)],
                                 env=env, cwd=tree)
            if rc:
                return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
