"""Convert a Hugging Face causal LM (Llama, Qwen2, Mistral, Qwen3: a local directory, a .gguf file or a hub
id) into an snlp checkpoint that `snlp eval`, `generate`, `bench --ckpt` and `train --init-from` take."""

from __future__ import annotations

# the library (and torch) loads in run(), not here: --help answers without it
SUPPORTED = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM")  # snlp.io.hf's


def add_arguments(p) -> None:
    p.add_argument("src", help=f"transformers directory (config.json + safetensors), .gguf file or hub id; "
                               f"architectures: {', '.join(SUPPORTED)}")
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="weight dtype of the checkpoint")


def run(args) -> int:
    from snlp.io.checkpoint import save_checkpoint
    from snlp.io.hf import from_hf

    model, tok = from_hf(args.src, dtype=args.dtype)
    if tok is None:
        raise ValueError(f"{args.src} has no tokenizer; snlp checkpoints need one (save the tokenizer next to the "
                         f"model, or use snlp.io.hf.from_hf(..., tokenizer=...) from Python)")
    path = save_checkpoint(args.out, model, tok)
    cfg = model.config
    print(f"converted {args.src}: {cfg.n_layer} layers, width {cfg.n_embd}, {cfg.n_head}/{cfg.n_kv_head} heads, "
          f"vocab {cfg.vocab_size}, {model.num_params() / 1e6:.1f}M parameters -> {path}")
    return 0
