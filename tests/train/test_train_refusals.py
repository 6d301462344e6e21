"""`snlp train` refuses what no run can honour in one line before any work: what the flags ask of the model (its
shape, the regulariser against it, the frozen prefix) before the tokenizer trains and the corpus is tokenised, and a
--time-reg of a run that trains without a regulariser."""

from pathlib import Path

import numpy as np
import pytest
import torch

from snlp.apps.cli import main

SHAKESPEARE = Path(__file__).resolve().parents[1] / "data/tinyshakespeare-head.txt"
TINY = ["--depth", "3", "--width", "32", "--head-dim", "16", "--vocab-size", "300", "--seq-len", "16",
        "--batch-size", "2", "--eval-every", "100", "--eval-batches", "1", "--no-progress", "--device", "cpu",
        "--steps", "2"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    (d / "c.txt").write_text(SHAKESPEARE.read_text()[:30_000])
    return d / "c.txt"


@pytest.mark.parametrize("flags, said", [
    (["--kv-heads", "3", "--width", "64", "--head-dim", "32"], "n_head=2 must be a multiple of n_kv_head=3"),
    (["--head-dim", "24"], "width=32 must be a multiple of head_dim=24"),
    (["--reg", "hcn"], "--reg hcn needs an mHC model"),
    (["--freeze-prefix", "5"], "--freeze-prefix S=5 must lie in [0, 2]"),
    (["--depth", "1", "--reg", "idn"], "--reg idn: no regulariser suffix fits a 1-layer model"),
    (["--reg-n", "0"], "--reg-n needs suffix lengths >= 1"),
    (["--vocab-size", "100"], "--vocab-size must be >= 261"),
])
def test_what_the_flags_ask_of_the_model_is_refused_before_the_data_is_read(flags, said, corpus, tmp_path, capsys):
    """These were refused only once the BPE had trained and the corpus was tokenised (minutes on the default stdlib
    corpus), the model's shape, the regulariser against it and --freeze-prefix being checked where the model was
    built; --depth 1 --reg idn even ran step 0's validation and wrote the banner and a log.jsonl into --out before
    'no regulariser suffix fits a 1-layer model'. Now one line before the token cache or --out is touched."""
    out, cache = tmp_path / "run", tmp_path / "cache"
    capsys.readouterr()
    assert main(["train", "--out", str(out), "--data", str(corpus), "--cache-dir", str(cache), *TINY, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and said in err, err
    assert not cache.exists() and not out.exists()


def test_time_reg_needs_a_regulariser_the_run_trains_with(corpus, tmp_path, capsys):
    """--reg idn --reg-lambda 0 trains without the regulariser, yet --time-reg timed one (the eager step ran an IDN
    solve for the timing's lambda) and printed its overhead ("regulariser: 22.5 vs 9.6 ms ... 2.35x") for a term the
    run never had; the compiled step, which runs the regulariser only when its RegConfig is active, timed none. Now
    refused before any work, as --reg-rows is; and an inactive RegConfig runs no regulariser in the eager step either,
    whatever lambda it is called with, as the compiled step."""
    from conftest import make_model
    from snlp.train.job import TrainStep
    from snlp.train.regularizer import RegConfig

    out = tmp_path / "run"
    capsys.readouterr()
    assert main(["train", "--out", str(out), "--data", str(corpus), "--cache-dir", str(tmp_path / "cache"), *TINY,
                 "--reg", "idn", "--reg-lambda", "0", "--time-reg", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--time-reg" in err and "--reg-lambda > 0" in err, err
    assert not out.exists()

    model = make_model(dtype=torch.float32, n_layer=3, n_embd=32, n_head=2, vocab_size=64, sequence_len=8)
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    for reg in (RegConfig(), RegConfig(surrogate="idn", lam=0.0, suffixes=(2,))):
        loss, ce, rg = TrainStep(model, reg)(x, x, 0.5)
        assert float(rg) == 0.0 and torch.equal(loss.detach(), ce)


def test_a_weights_only_checkpoint_in_out_is_named_with_a_way_out(corpus, tmp_path, capsys):
    """--out holding a checkpoint without train_state.pt (a `snlp convert` output, a saved model): a new run was told
    "pass --resume to continue it", and that --resume to "start a new run instead", each pointing at the other. Both
    now say that nothing there can be continued and how to start from its weights (--init-from) in another --out;
    nothing in the folder changes."""
    from conftest import make_model
    from snlp.io.checkpoint import save_checkpoint

    ck = tmp_path / "ck"
    save_checkpoint(ck, make_model(n_layer=2, vocab_size=300, sequence_len=16).float(), None)
    before = {p.name: p.read_bytes() for p in ck.iterdir()}
    for extra in ([], ["--resume"]):
        capsys.readouterr()
        assert main(["train", "--out", str(ck), "--data", str(corpus), "--cache-dir", str(tmp_path / "cache"), *TINY,
                     *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "weights-only checkpoint" in err and f"--init-from {ck}" in err, err
        assert "pass --resume" not in err and "start a new run instead" not in err
    assert {p.name: p.read_bytes() for p in ck.iterdir()} == before


@pytest.mark.parametrize("flag", ["--embedding-lr", "--matrix-lr"])
def test_a_learning_rate_float32_cannot_hold_is_refused_before_any_work(flag, corpus, tmp_path, capsys):
    """A finite LR past float32's largest number (1e39) passed the LR check, loaded the data, validated step 0 and
    ended in a traceback at the first optimizer step ("RuntimeError: value cannot be converted to type float without
    overflow", AdamW and Muon alike), leaving --out with a log and no checkpoint. One line before any work now."""
    out = tmp_path / "run"
    capsys.readouterr()
    assert main(["train", "--out", str(out), "--data", str(corpus), "--cache-dir", str(tmp_path / "cache"), *TINY,
                 flag, "1e39"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{flag} 1e+39 is past float32's largest number" in err, err
    assert not out.exists() and not (tmp_path / "cache").exists()


@pytest.mark.parametrize("flags", [["--hc-lr", "0.1"], ["--hc-static"], ["--hc-static", "--hc-lr", "0.1"]])
def test_mhc_flags_without_mhc_streams_are_refused_not_ignored(flags, corpus, tmp_path, capsys):
    """--hc-lr and --hc-static set the mHC streams' H coefficients; without --hc-streams the model has none, and the
    run trained the plain model and said nothing. Refused in one line before any work; with --hc-streams both run."""
    out, cache = tmp_path / "run", tmp_path / "cache"
    capsys.readouterr()
    assert main(["train", "--out", str(out), "--data", str(corpus), "--cache-dir", str(cache), *TINY, *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--hc-streams" in err and flags[0] in err, err
    assert not cache.exists() and not out.exists()
    assert main(["train", "--out", str(out), "--data", str(corpus), "--cache-dir", str(cache), *TINY, *flags,
                 "--hc-streams", "2"]) == 0
    assert (out / "model.safetensors").is_file()


def test_hc_lr_for_a_plain_init_from_checkpoint_is_refused_not_ignored(tmp_path, capsys):
    """--hc-lr sets the mHC streams' H coefficients; a model from --init-from has its checkpoint's streams, and the
    check let every --init-from run through, so a plain checkpoint's run trained without any H group and said
    nothing. Refused in one line before any work from its config; an mHC checkpoint's --hc-lr runs."""
    from conftest import make_model, text_checkpoint

    from snlp.io.checkpoint import load, save_checkpoint

    plain, corpus, _ = text_checkpoint(tmp_path)
    tok = load(plain)[1]
    mhc = save_checkpoint(tmp_path / "mhc", make_model(seed=3, dtype=torch.float32, vocab_size=tok.vocab_size,
                                                       n_layer=4, n_embd=32, sequence_len=128, hc_streams=2),
                          tokenizer=tok)
    tune = ["train", "--data", str(corpus), "--cache-dir", str(tmp_path / "cache"), "--seq-len", "16",
            "--batch-size", "2", "--steps", "1", "--eval-batches", "1", "--no-progress", "--device", "cpu",
            "--hc-lr", "0.1"]
    capsys.readouterr()
    # the checkpoint by its directory or by a file inside it, both of which --init-from loads (checkpoint_dir)
    for src in (plain, Path(plain) / "model.safetensors", Path(plain) / "config.json"):
        assert main([*tune, "--init-from", str(src), "--out", str(tmp_path / "ft")]) == 2, src
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "--hc-lr" in err and "has none" in err, (src, err)
    assert not (tmp_path / "ft").exists() and not (tmp_path / "cache").exists()
    assert main([*tune, "--init-from", str(mhc), "--out", str(tmp_path / "ft2")]) == 0
    assert load(tmp_path / "ft2")[0].config.hc_streams == 2


def test_init_from_windows_past_the_checkpoints_context_are_refused(corpus, tmp_path, capsys):
    """`snlp train --init-from CKPT --seq-len T` with T above CKPT's sequence_len trained windows of T positions,
    while the fine-tuned model kept CKPT's context (its KV cache holds sequence_len positions): positions it never
    decodes at, as `snlp adapt` refuses. Refused in one line before the data is read or --out written; the context
    itself still trains."""
    from snlp.io.checkpoint import load

    cache = tmp_path / "cache"
    assert main(["train", "--out", str(tmp_path / "base"), "--data", str(corpus), "--cache-dir", str(cache), *TINY]) == 0
    ctx = load(tmp_path / "base")[0].config.sequence_len
    assert ctx == 16
    tune = ["train", "--init-from", str(tmp_path / "base"), "--data", str(corpus), "--cache-dir", str(cache),
            "--batch-size", "2", "--steps", "1", "--eval-batches", "1", "--no-progress", "--device", "cpu"]
    capsys.readouterr()
    assert main([*tune, "--out", str(tmp_path / "ft"), "--seq-len", str(ctx + 1)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"exceeds the context of {tmp_path / 'base'} ({ctx} positions)" in err, err
    assert not (tmp_path / "ft").exists()
    assert main([*tune, "--out", str(tmp_path / "ft"), "--seq-len", str(ctx)]) == 0
    assert load(tmp_path / "ft")[0].config.sequence_len == ctx


def test_a_text_field_for_data_without_fields_is_refused_not_ignored(corpus, tmp_path, capsys):
    """--text-field picks the text of .jsonl / .parquet rows and hf: datasets; with plain text files only it was
    ignored and the run said nothing. Refused in one line before any work; with a .jsonl part beside the text it
    reads that field."""
    import json

    out, cache = tmp_path / "run", tmp_path / "cache"
    capsys.readouterr()
    assert main(["train", "--out", str(out), "--data", str(corpus), "--cache-dir", str(cache), *TINY,
                 "--text-field", "body"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--text-field" in err and "has none" in err, err
    assert not cache.exists() and not out.exists()
    rows = tmp_path / "rows.jsonl"
    text = corpus.read_text()
    rows.write_text("\n".join(json.dumps({"body": text[i:i + 3000]}) for i in range(0, 15_000, 3000)))
    assert main(["train", "--out", str(out), "--data", f"{corpus},{rows}", "--cache-dir", str(cache), *TINY,
                 "--text-field", "body"]) == 0


def test_a_resume_refusal_names_settings_in_the_flags_terms():
    """A resumed run typed with --freeze-prefix (no S) that was saved without it was refused as "--freeze-prefix None
    (given: -1)": the field's internal values, which no flag takes. It now says what was typed."""
    from dataclasses import asdict

    from snlp.train.config import TrainConfig, check_resume_settings

    saved = asdict(TrainConfig(out="x"))
    with pytest.raises(ValueError) as e:
        check_resume_settings(TrainConfig(out="x", resume=True, freeze_prefix=-1), saved, "x", reads_data=False)
    said = str(e.value)
    assert "--freeze-prefix (not given) (given: (without S: depth - max(--reg-n)))" in said, said
    assert "None" not in said and "-1" not in said
    with pytest.raises(ValueError, match=r"--freeze-prefix 2 \(given: \(not given\)\)"):
        check_resume_settings(TrainConfig(out="x", resume=True), {**saved, "freeze_prefix": 2}, "x", reads_data=False)


@pytest.mark.parametrize("field, value, said", [
    ("steps", True, "--steps must be an integer (got True)"),
    ("batch_size", True, "--batch-size must be an integer (got True)"),
    ("seq_len", True, "--seq-len must be an integer (got True)"),
    ("grad_accum", 2.0, "--grad-accum must be an integer (got 2.0)"),
    ("seed", False, "--seed must be an integer (got False)"),
    ("depth", np.int64(4), "--depth must be an integer (got np.int64(4), a numpy.int64: pass int(...))"),
    ("steps", "3", "--steps must be an integer (got '3')"),
    ("head_dim", 0, "--head-dim must be >= 1 (got 0)"),
    ("embedding_lr", True, "--embedding-lr takes a number, not True"),
    ("reg_rows", True, "--reg-rows takes a number, not True"),
    ("weight_decay", float("nan"), "--weight-decay must be a finite number >= 0 (got nan)"),
    ("val_frac", 1.5, "--val-frac must lie in (0, 0.5]"),
    ("val_frac", float("nan"), "--val-frac must lie in (0, 0.5]"),
    ("val_frac", 0.0, "--val-frac must lie in (0, 0.5]"),
    ("compile", "no", "compile must be True or False"),
])
def test_train_config_refuses_a_bool_or_wrong_type_as_a_count_in_one_line(field, value, said, corpus, tmp_path):
    """True is an int: TrainConfig(steps=True) trained one step and batch_size=True one row, a float count passed
    `< 1`, and a --val-frac outside (0, 0.5] was refused by the split only after every document was read. `fit` refuses
    each in one line before any work (the rule of AdaptConfig's and Plan's counts); the valid config runs."""
    from snlp.train.config import TrainConfig
    from snlp.train.trainer import fit

    cache = tmp_path / "cache"
    tiny = dict(depth=2, width=32, head_dim=16, vocab_size=300, seq_len=16, batch_size=2, steps=1, eval_batches=1)
    cfg = TrainConfig(out=str(tmp_path / "run"), data=str(corpus), cache_dir=str(cache), no_progress=True,
                      device="cpu", **{**tiny, field: value})
    with pytest.raises(ValueError) as e:
        fit(cfg)
    assert said in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert not cache.exists() and not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", ["nanochat-L", "nanochat-mhc"])
def test_hc_lr_with_a_nanochat_init_from_is_refused_before_any_work(name, corpus, tmp_path, capsys):
    """check_hc_flags reads the streams of an snlp checkpoint only; a nanochat folder (model_NNNNNN.pt + meta) is
    left to the loader. No run starts from one: fine-tuning needs the model's tokenizer, which nanochat's folders do
    not hold, so `--init-from` of one is refused in one line before the data is read or --out made, --hc-lr or not.
    Should nanochat folders ever load with a tokenizer, --hc-lr needs the check of their streams (meta's use_mhc)."""
    src = Path(__file__).resolve().parents[1] / "data" / "nanochat" / name
    out, cache = tmp_path / "ft", tmp_path / "cache"
    capsys.readouterr()
    for extra in ([], ["--hc-lr", "0.1"]):
        assert main(["train", "--init-from", str(src), "--data", str(corpus), "--cache-dir", str(cache), "--out",
                     str(out), "--seq-len", "16", "--batch-size", "2", "--steps", "1", "--no-progress", "--device",
                     "cpu", *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "has no tokenizer.json" in err, err
        assert not out.exists() and not cache.exists()


def test_a_numpy_val_frac_trains_as_its_python_float(corpus, tmp_path):
    """TrainConfig reads val_frac as a number where numpy's reals are numbers (NUMBERS, number_error), but the shared
    (0, 0.5] check took only Python int / float: val_frac=np.float32(0.05) was refused before any work with "must lie
    in (0, 0.5], got 0.05000000074505806". It trains, on the documents float 0.05 holds out (the validation loss of
    a run with the Python float, the same seed: the reference)."""
    from snlp.train.config import TrainConfig
    from snlp.train.trainer import fit

    tiny = dict(depth=2, width=32, head_dim=16, vocab_size=300, seq_len=16, batch_size=2, steps=1, eval_batches=1,
                no_progress=True, device="cpu", data=str(corpus), cache_dir=str(tmp_path / "cache"))
    got = fit(TrainConfig(out=str(tmp_path / "np"), val_frac=np.float32(0.05), **tiny))
    want = fit(TrainConfig(out=str(tmp_path / "py"), val_frac=0.05, **tiny))
    assert got.val_loss == want.val_loss and (tmp_path / "np" / "config.json").is_file()
