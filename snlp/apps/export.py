"""Export an snlp checkpoint of a Llama-family model (e.g. one made by `snlp convert`, possibly fine-tuned)
as a transformers directory: AutoModelForCausalLM.from_pretrained(DIR) gives the same logits (RMSNorm
weights folded into the projections, unit norm weights, untied lm_head)."""

from __future__ import annotations

from snlp.io.checkpoint import load
from snlp.io.hf import export_hf


def add_arguments(p) -> None:
    p.add_argument("ckpt", help="snlp checkpoint directory")
    p.add_argument("--out", required=True, help="transformers directory to write")


def run(args) -> int:
    model, tok = load(args.ckpt)
    out = export_hf(model, args.out, tok)
    print(f"exported {args.ckpt} -> {out} (transformers {model.config.n_layer}-layer model)")
    return 0
