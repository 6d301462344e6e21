"""Export an snlp checkpoint of a Llama-family model (e.g. one made by `snlp convert`, possibly fine-tuned)
as a transformers directory: AutoModelForCausalLM.from_pretrained(DIR) gives the same logits (the checkpoint's
own tensors, norm weights included; a tied head stays tied). Given a drafter directory (`snlp adapt`),
it writes the base's prefix with the drafter's adapted suffix as one transformers model (its plan recorded in
config.json; transformers runs it sequentially, the drafter's SNLP solve is snlp's: snlp.io.drafter)."""

from __future__ import annotations

SUMMARY = "Export an snlp checkpoint or an adapted drafter as a transformers model."
DESCRIPTION = """\
CKPT: an snlp checkpoint of a Llama-family model (one made by `snlp convert`, possibly fine-tuned); OUT gets a
transformers directory whose AutoModelForCausalLM gives the same logits. CKPT may be a drafter directory (`snlp
adapt`): OUT is then the base's prefix with the drafter's adapted suffix, which transformers runs sequentially.

  snlp export runs/smol --out runs/smol-hf
  snlp export runs/smol-d8 --out runs/smol-d8-hf     # a drafter (--base: its base, if moved)
"""
GUIDE = "docs/hf.md"


def add_arguments(p) -> None:
    p.add_argument("ckpt", help="snlp checkpoint directory, or a drafter directory (snlp adapt --out)")
    p.add_argument("--base", default=None, help="a drafter's base (snlp checkpoint, .gguf or transformers directory); "
                   "default: the one it was adapted from, as recorded in the drafter")
    p.add_argument("--out", required=True, help="transformers directory to write: a new or empty folder")


def check_empty_out(out: str) -> None:
    """Refuse an --out that holds files (hidden ones aside: a git clone's .git), as export_hf does
    (snlp.io.hf.check_export_out), before the model loads."""
    from snlp.io.hf import check_export_out

    check_export_out(out, label="--out")


def run(args) -> int:
    # the library (and torch) loads here, not at the top: --help answers without it
    from snlp.apps.convert import check_new_out
    from snlp.io.checkpoint import checkpoint_dir, is_snlp_checkpoint, load, stored_dtype
    from snlp.io.nanochat import is_nanochat_dir
    from snlp.io.source import home_path
    from snlp.io.drafter import export_drafter_hf, is_drafter_dir, load_drafter, load_record
    from snlp.io.hf import export_hf
    from snlp.train.adapt import load_base

    check_new_out(args.out, "export")  # before the model loads: an --out over a checkpoint would lose it
    check_empty_out(args.out)
    if is_drafter_dir(args.ckpt):
        src = args.base or load_record(args.ckpt).get("config", {}).get("src")
        if not src:
            raise ValueError(f"drafter {args.ckpt} does not record its base: pass --base")
        base, tok = load_base(src, need_tokenizer=False)  # the export carries the base's tokenizer if it has one
        drafter = load_drafter(args.ckpt, base)  # refuses another base
        out = export_drafter_hf(drafter, args.out, tok)
        print(f"exported drafter {args.ckpt} ({drafter.plan} on {src}) -> {out} (transformers "
              f"{base.config.n_layer}-layer model: base prefix + adapted suffix)")
        return 0
    if args.base:
        raise ValueError("--base is for drafter directories; an snlp checkpoint is exported as it is")
    # in the dtype its weights were saved in (load alone gives float32: an fp64 checkpoint was written rounded); the
    # folder as load reads it (a file inside it, a leading ~)
    src = home_path(args.ckpt)
    own = None if is_nanochat_dir(src) else checkpoint_dir(src)
    model, tok = load(args.ckpt, dtype=stored_dtype(own) if own is not None and is_snlp_checkpoint(own) else None)
    out = export_hf(model, args.out, tok)
    print(f"exported {args.ckpt} -> {out} (transformers {model.config.n_layer}-layer model)")
    return 0
