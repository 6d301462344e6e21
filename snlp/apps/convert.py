"""Convert a Hugging Face causal LM (Llama, Qwen2, Mistral, Qwen3: a local directory, a .gguf file or a hub
id) or a nanochat / nanochat-snlp checkpoint directory (model_NNNNNN.pt + meta_NNNNNN.json) into an snlp checkpoint
that `snlp eval`, `generate`, `bench --ckpt` and `train --init-from` take."""

from __future__ import annotations

SUMMARY = "Convert a Hugging Face, GGUF or nanochat model into an snlp checkpoint."
DESCRIPTION = """\
SRC: a transformers directory or hub id (Llama, Qwen2, Mistral and Qwen3 families), a .gguf file, or a nanochat /
nanochat-snlp checkpoint directory. OUT is a checkpoint that `snlp eval`, `generate`, `bench --ckpt`, `adapt` and
`train --init-from` take.

  snlp convert SmolLM2-135M-Instruct.Q4_1.gguf --out runs/smol
  snlp convert ~/.cache/nanochat/base_checkpoints/d32 --out runs/d32    # its last step (--step N)
"""
GUIDE = "docs/hf.md"


# the library (and torch) loads in run(), not here: --help answers without it
SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM")  # snlp.io.hf's


def add_arguments(p) -> None:
    p.add_argument("src", help=f"transformers directory (config.json + safetensors), .gguf file or hub id "
                               f"(architectures: {', '.join(SUPPORTED)}), or a nanochat / nanochat-snlp checkpoint "
                               f"directory (model_NNNNNN.pt + meta_NNNNNN.json; its last step, or --step)")
    p.add_argument("--step", type=int, default=None, help="nanochat checkpoints: the step to convert (default: the last)")
    p.add_argument("--nanochat-override", action="append", default=[], metavar="FIELD=VALUE",
                   help="nanochat checkpoints: set a GPTConfig field (repeatable; VALUE as JSON, e.g. softcap=20 "
                        "rope_bf16=false): picks the nanochat version where its files cannot say which wrote them "
                        "(the refusal lists the fields of each), or replaces a version's constant")
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16", "float16"],
                   help="weight dtype of the checkpoint (float64 keeps an fp64 source unrounded)")


def parse_overrides(items: list[str]) -> dict:
    """{FIELD: VALUE} of --nanochat-override FIELD=VALUE items, VALUE read as JSON (a bare word stays a string)."""
    import json

    out = {}
    for item in items:
        field, eq, value = item.partition("=")
        if not eq or not field:
            raise ValueError(f"--nanochat-override takes FIELD=VALUE (e.g. softcap=20), got {item!r}")
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        if field in out and out[field] != parsed:  # one of the two would be dropped without a word
            raise ValueError(f"--nanochat-override gives {field} twice ({json.dumps(out[field])} and "
                             f"{json.dumps(parsed)}): give it once")
        out[field] = parsed
    return out


def check_new_out(out: str, what: str = "conversion") -> None:
    """Refuse an --out that already holds a model: the conversion (or export) would replace its weights and config
    and drop a trained run's optimizer and train state (save_checkpoint keeps only files it does not own; an export's
    save_pretrained writes a transformers config.json over an snlp one, after which the folder loads as neither).
    A drafter, a nanochat checkpoint folder or a speedrun are refused too: the model would be written beside them."""
    from pathlib import Path

    from snlp.io.checkpoint import DRAFTER_META, OWN_FILES, holds_speedrun
    from snlp.io.nanochat import is_nanochat_dir

    d = Path(out)
    # any file by a name the save writes: a tokenizer.json alone (a tokenizer's folder) was replaced too
    taken = [f for f in OWN_FILES if (d / f).exists()]
    if taken:
        raise ValueError(f"--out {out} already holds a checkpoint or model ({', '.join(taken)}); the {what} would "
                         f"replace it: choose another --out")
    if (d / DRAFTER_META).exists():
        raise ValueError(f"--out {out} holds a drafter (snlp adapt); choose another --out")
    if d.is_dir() and is_nanochat_dir(d):
        raise ValueError(f"--out {out} holds a nanochat checkpoint; choose another --out")
    if holds_speedrun(out):
        raise ValueError(f"--out {out} holds a speedrun (stages/); choose another --out")


def run(args) -> int:
    import torch

    from snlp.io.checkpoint import save_checkpoint
    from snlp.io.hf import from_hf
    from snlp.io.nanochat import is_nanochat_dir, load_nanochat, nanochat_step, steps

    overrides = parse_overrides(args.nanochat_override)
    check_new_out(args.out)
    if is_nanochat_dir(args.src):  # its tokenizer (a tiktoken pickle in nanochat's base dir) is not converted
        model = load_nanochat(args.src, step=args.step, dtype=getattr(torch, args.dtype), overrides=overrides)
        path = save_checkpoint(args.out, model)
        cfg = model.config
        folder, step = nanochat_step(args.src, args.step)
        have = steps(folder)  # a training run's folder holds every saved step: say which one this is
        which = f"step {step}" + (f" (of steps {', '.join(map(str, have))})" if len(have) > 1 else "")
        print(f"converted nanochat checkpoint {args.src}, {which}: {cfg.n_layer} layers, width {cfg.n_embd}, "
              f"{cfg.n_head}/{cfg.n_kv_head} heads, vocab {cfg.vocab_size}, {model.num_params() / 1e6:.1f}M "
              f"parameters -> {path} (no tokenizer: nanochat's is not converted; pass token ids)")
        return 0
    if args.step is not None or overrides:
        raise ValueError("--step and --nanochat-override apply to a nanochat checkpoint directory; this source is "
                         "not one")
    model, tok = from_hf(args.src, dtype=args.dtype)
    if tok is None:
        raise ValueError(f"{args.src} has no tokenizer; snlp checkpoints need one (save the tokenizer next to the "
                         f"model, or use snlp.io.hf.from_hf(..., tokenizer=...) from Python)")
    path = save_checkpoint(args.out, model, tok)
    cfg = model.config
    print(f"converted {args.src}: {cfg.n_layer} layers, width {cfg.n_embd}, {cfg.n_head}/{cfg.n_kv_head} heads, "
          f"vocab {cfg.vocab_size}, {model.num_params() / 1e6:.1f}M parameters -> {path}")
    return 0
