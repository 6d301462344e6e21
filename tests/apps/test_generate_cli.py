"""`snlp generate` on a real checkpoint (save_checkpoint + a tokenizer trained on a small text) in
every mode, and `snlp bench --decode`."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_model

from snlp.io.checkpoint import save_checkpoint
from snlp.apps.cli import main
from snlp.io.tokenizer import MIN_VOCAB, Tokenizer

TEXT = ("First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. "
        "First Citizen: You are all resolved rather to die than to famish? All: Resolved. resolved. ") * 20


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    tok = Tokenizer.train([TEXT], vocab_size=MIN_VOCAB + 40)
    model = make_model(seed=3, dtype=torch.float32, vocab_size=tok.vocab_size, n_layer=4, n_head=2, n_kv_head=1,
                       n_embd=32, sequence_len=128, scale=0.15)
    return save_checkpoint(tmp_path_factory.mktemp("ck") / "tiny", model, tokenizer=tok)


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny ops: threads only add contention


def _gen(ckpt, tmp_path, *extra):
    out = tmp_path / "g.json"
    rc = main(["generate", str(ckpt), "--prompt", "First Citizen:", "--max-new-tokens", "24", "--json", str(out),
               *extra])
    assert rc == 0
    return json.loads(out.read_text())


def test_generate_all_modes_on_a_checkpoint(ckpt, tmp_path, capsys):
    seq = _gen(ckpt, tmp_path, "--mode", "sequential")
    assert len(seq["tokens"]) == 24 and isinstance(seq["text"], str)
    assert seq["tokens_per_s"] == pytest.approx(24 / seq["decode_s"]) and seq["steps"] == 24  # one step per token
    out = capsys.readouterr().out
    assert out.startswith("First Citizen:") and seq["text"] in out and "tok/s" in out.splitlines()[-2]

    spec = _gen(ckpt, tmp_path, "--mode", "speculative", "--plan", "2xF2-h0-K1", "--block", "3")
    assert spec["tokens"] == seq["tokens"] and spec["text"] == seq["text"] and spec["matches_sequential"]
    assert 0 <= spec["acceptance_rate"] <= 1 and 1 <= spec["tokens_per_round"] <= 4
    rep = spec["report"]  # medians of --repeats (default 3) timed runs of both sides after a warm-up
    assert rep["repeats"] == 3 and rep["block"] == 3 and "ideal_speedup" not in rep
    assert rep["alpha"] == pytest.approx(spec["acceptance_rate"])  # greedy: every run drafts the same
    assert rep["ideal_ssd_speedup"] == pytest.approx(
        (1 - rep["alpha"] ** 4) / (1 - rep["alpha"]) / (3 / rep["drafter_speedup_s"] + 1))
    assert spec["sequential_tokens_per_s"] == pytest.approx(1e3 / rep["sequential_ms_per_token"])
    assert spec["speculative_tokens_per_s"] == pytest.approx(1e3 / rep["speculative_ms_per_token"])
    captured = capsys.readouterr()
    line = captured.out.splitlines()[-2]  # the last: "wrote g.json"
    # the timing after the streamed text is announced, not minutes of silence after the answer
    assert "timing speculative against sequential decoding, 1 warm-up and 3 timed runs of each" in captured.err
    assert "alpha=" in line
    # the one streamed run's rate is labelled as such, and both sides' warm medians stand beside the ratio (a line
    # read "28.1 tok/s ... speedup measured 1.30x ... sequential 321.2 tok/s")
    assert "tok/s in this one run" in line and f"speculative {spec['speculative_tokens_per_s']:.1f} tok/s" in line
    assert f"sequential {spec['sequential_tokens_per_s']:.1f} tok/s" in line
    # 3 paired runs can never pass the two-sided sign test (6 of 6 at the fewest): the ratio is called a tie, with
    # how many runs were faster, never printed bare as a speedup
    wins = sum(r > 1 for r in rep["round_speedups"])
    assert spec["speedup_verdict"] == "tie" and f"a tie with sequential: faster in {wins} of 3 paired runs" in line
    assert "; --repeats 6 or more can resolve it)" in line  # the default cannot: the line names the flag that can
    lo, hi = min(rep["round_speedups"]), max(rep["round_speedups"])  # the paired ratios' range holds both rates' ratio
    assert spec["speedup_range"] == [lo, hi] and f"which ran {lo:.2f}-{hi:.2f}x: " in line
    # (to rounding: where one run is both sides' median and the range's end, the two are equal in exact arithmetic)
    assert lo * (1 - 1e-12) <= spec["speculative_tokens_per_s"] / spec["sequential_tokens_per_s"] <= hi * (1 + 1e-12)

    snlp = _gen(ckpt, tmp_path, "--mode", "snlp", "--plan", "4xF1-h0-K4")  # K >= C: exact for M = 1
    assert snlp["tokens"] == seq["tokens"]
    jac = _gen(ckpt, tmp_path, "--mode", "jacobi", "--plan", "2xF1-h0-K1", "--block", "4")
    assert jac["tokens"] == seq["tokens"] and jac["tokens_per_round"] >= 1

    sampled = _gen(ckpt, tmp_path, "--mode", "speculative", "--plan", "2xF2-h0-K1", "--temperature", "0.8",
                   "--seed", "1", "--no-baseline", "--quiet")
    again = _gen(ckpt, tmp_path, "--mode", "speculative", "--plan", "2xF2-h0-K1", "--temperature", "0.8",
                 "--seed", "1", "--no-baseline", "--quiet")
    assert sampled["tokens"] == again["tokens"] and len(sampled["tokens"]) == 24


def test_generate_shared_weights_and_adaptive_drafting_flags(ckpt, tmp_path, capsys):
    """--share-weights and --min-confidence keep speculative decoding exact; other modes refuse
    them rather than ignore them."""
    seq = _gen(ckpt, tmp_path, "--mode", "sequential", "--quiet")
    spec = _gen(ckpt, tmp_path, "--mode", "speculative", "--plan", "2xF1-h0-K1", "--block", "4", "--share-weights",
                "--min-confidence", "0.6", "--repeats", "1", "--quiet")
    assert spec["tokens"] == seq["tokens"] and spec["matches_sequential"]
    assert spec["drafted"] <= 4 * spec["rounds"]
    assert main(["generate", str(ckpt), "--mode", "snlp", "--plan", "2xF1-h0-K1", "--share-weights"]) == 2
    assert "--mode speculative" in capsys.readouterr().err
    assert main(["generate", str(ckpt), "--mode", "speculative", "--plan", "2xF2-h0-K1", "--share-weights"]) == 2
    assert "M = 1" in capsys.readouterr().err
    assert main(["generate", str(ckpt), "--distributed", "--mode", "speculative", "--plan", "2xF1-h0-K1",
                 "--min-confidence", "0.5"]) == 2  # refused before any process group starts
    assert "single-process drafter options" in capsys.readouterr().err


def test_generate_bad_arguments(ckpt, capsys):
    assert main(["generate", str(ckpt), "--mode", "nope"]) == 2
    assert "unknown mode 'nope'" in capsys.readouterr().err
    assert main(["generate", str(ckpt), "--mode", "speculative", "--plan", "2xF1-h0-K1", "--block", "0"]) == 2
    assert "block size" in capsys.readouterr().err
    assert main(["generate", str(ckpt), "--mode", "snlp", "--plan", "9xF1-h0-K1"]) == 2
    assert "needs a suffix" in capsys.readouterr().err
    assert main(["generate", str(ckpt) + "-missing"]) == 2
    assert main(["generate", str(ckpt), "--mode", "speculative", "--plan", "2xF1-h0-K1", "--repeats", "0"]) == 2
    assert "--repeats must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("mode", [["--mode", "sequential"], ["--mode", "speculative", "--plan", "2xF1-h0-K1"],
                                  ["--mode", "jacobi"], ["--mode", "sequential", "--temperature", "0.8"]])
def test_a_model_whose_own_forward_turns_nan_exits_2_naming_it(ckpt, monkeypatch, capsys, mode):
    """Weights made NaN after loading (the load checks them): `snlp generate` exited 0 printing tokens read off NaN
    logits (token 0 over and over). Now every mode stops with one line naming the model's own forward, not a plan."""
    import snlp.io.checkpoint as C

    real = C.load

    def broken(*a, **kw):
        model, tok = real(*a, **kw)
        with torch.no_grad():
            model.blocks[1].mlp.c_proj.weight[0, 0] = float("nan")
        return model, tok

    monkeypatch.setattr(C, "load", broken)
    assert main(["generate", str(ckpt), "--prompt", "First Citizen:", "--max-new-tokens", "8", *mode]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("snlp generate: error: the model's own forward (not an SNLP plan) gives NaN/inf logits "
                          "for generated token 1") and "\n" not in err, err


def test_bench_decode(tmp_path, capsys):
    out = tmp_path / "d.json"
    rc = main(["bench", "--decode", "--depth", "4", "--width", "32", "--head-dim", "16", "--vocab-size", "97",
               "--plans", "2xF1-h0-K1,1xF2-h0-K1", "--blocks", "2,3", "--new-tokens", "8", "--prompt-len", "4",
               "--warmup", "0", "--runs", "1", "--json", str(out)])
    assert rc == 0
    recs = json.loads(out.read_text())
    assert [(r["mode"], r["plan"], r["block"]) for r in recs] == [
        ("sequential", "sequential", None), ("snlp", "2xF1-h0-K1", None), ("snlp", "1xF2-h0-K1", None),
        ("speculative", "2xF1-h0-K1", 2), ("speculative", "2xF1-h0-K1", 3),
        ("speculative", "1xF2-h0-K1", 2), ("speculative", "1xF2-h0-K1", 3)]
    seq = recs[0]
    for r in recs:
        assert r["tokens_per_s"] == pytest.approx(1e3 / r["ms_per_token"])
        assert r["speedup"] == pytest.approx(seq["ms_per_token"] / r["ms_per_token"])
        if r["mode"] == "speculative":
            assert r["matches_sequential"] and "ideal_speedup" not in r
            assert r["drafter_speedup_s"] == pytest.approx(r["sequential_ms_per_step"] / r["drafter_ms_per_step"])
            a, b, s = r["alpha"], r["block"], r["drafter_speedup_s"]
            ideal = (b + 1 if a == 1 else (1 - a ** (b + 1)) / (1 - a)) / (b / s + 1)
            assert r["ideal_ssd_speedup"] == pytest.approx(ideal)
    assert "speculative" in capsys.readouterr().out
    assert main(["bench", "--decode", "--depth", "4", "--width", "32", "--head-dim", "16", "--blocks", "0"]) == 2


def test_the_summary_cannot_read_as_a_contradiction(ckpt, tmp_path, monkeypatch, capsys):
    """Under load each side's median rate and the median of the paired per-run ratios can disagree in sign: a run
    printed "speculative 3.5 tok/s, sequential 3.3 tok/s, speedup measured 0.74x". The rounds here are that run's
    (fabricated: the timing replaced): the line names each rate its own side's median and prints the paired ratios'
    range, which holds both the median ratio and the ratio of the two rates (a median is monotone and scales)."""
    import snlp.decode.speculative as speculative
    from snlp.decode.speculative import SSDRow

    def fabricated(model, prompts, plan, blocks, *a, **kw):
        row = SSDRow(plan=str(plan), block=blocks[0], alpha=0.5, tokens_per_round=1.5, drafter_speedup_s=1.2,
                     sequential_ms_per_step=1.0, drafter_ms_per_step=0.8, sequential_ms_per_token=1e3 / 3.3,
                     speculative_ms_per_token=1e3 / 3.5, measured_speedup=0.74, ideal_ssd_speedup=1.1, repeats=3,
                     prompts=1, gen_tokens=24, round_speedups=[0.6, 0.74, 1.3])
        return [row], [[]]

    monkeypatch.setattr(speculative, "speculative_benchmark", fabricated)
    spec = _gen(ckpt, tmp_path, "--mode", "speculative", "--plan", "2xF2-h0-K1", "--block", "3")
    line = capsys.readouterr().out.splitlines()[-2]
    assert ("speculative 3.5 tok/s, sequential 3.3 tok/s (each side's own median), speedup measured 0.74x (the median "
            "of the paired per-run ratios, which ran 0.60-1.30x: a tie with sequential: faster in 1 of 3 paired runs"
            in line)
    assert spec["speedup_range"] == [0.6, 1.3] and spec["speedup_verdict"] == "tie"
    assert 0.6 <= spec["speculative_tokens_per_s"] / spec["sequential_tokens_per_s"] <= 1.3


@pytest.mark.slow
def test_generate_compile_flag(ckpt, tmp_path, capsys):
    """`snlp generate --compile`: compiled static-shape steps (snlp.steps) give the eager greedy tokens; the
    compile time is reported apart (JSON compile_s, the stats line) and Jacobi mode refuses the flag."""
    seq = _gen(ckpt, tmp_path, "--mode", "sequential", "--quiet")
    comp = _gen(ckpt, tmp_path, "--mode", "sequential", "--quiet", "--compile")
    assert comp["tokens"] == seq["tokens"]
    assert comp["compile_s"] > 0 and seq["compile_s"] == 0.0
    assert "compiled in" in capsys.readouterr().out
    assert main(["generate", str(ckpt), "--mode", "jacobi", "--plan", "2xF1-h0-K1", "--compile"]) == 2
    assert "--compile supports" in capsys.readouterr().err


def test_generate_prompts_file_in_batches(ckpt, tmp_path, capsys):
    """--prompts-file (JSONL or one prompt per line) with --batch-size: one result per prompt, in order, each equal to
    that prompt's own --prompt run; speculative rows equal batched sequential ones; unsupported combinations refused."""
    texts = ["First Citizen:", "All: Speak", "You are all resolved rather to die", "Resolved."]
    jl, txt = tmp_path / "p.jsonl", tmp_path / "p.txt"
    jl.write_text("".join(json.dumps({"prompt": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    txt.write_text("\n".join(texts) + "\n\n")
    singles = [_gen_prompt(ckpt, tmp_path, t) for t in texts]
    out = tmp_path / "b.json"
    for f, extra in ((jl, ["--mode", "sequential", "--batch-size", "3"]),
                     (txt, ["--mode", "speculative", "--plan", "2xF1-h0-K1", "--block", "3", "--batch-size", "4",
                            "--adaptive-block"]),
                     (txt, ["--mode", "snlp", "--plan", "4xF1-h0-K4", "--batch-size", "2"])):
        assert main(["generate", str(ckpt), "--prompts-file", str(f), "--max-new-tokens", "24", "--json", str(out),
                     *extra]) == 0
        rec = json.loads(out.read_text())
        assert [r["prompt"] for r in rec["results"]] == texts
        assert [r["tokens"] for r in rec["results"]] == singles
        assert rec["tokens"] == 24 * 4 and rec["tokens_per_s"] > 0
    assert rec["mode"] == "snlp" and rec["batch_size"] == 2
    printed = capsys.readouterr().out
    assert f"[3] {texts[3]}" in printed and "prompts in batches of" in printed
    assert main(["generate", str(ckpt), "--prompts-file", str(txt), "--mode", "speculative", "--plan", "2xF1-h0-K1",
                 "--batch-size", "4", "--max-new-tokens", "8", "--json", str(out), "--quiet"]) == 0
    spec = json.loads(out.read_text())
    assert spec["matches_sequential"] and spec["measured_speedup"] > 0
    # sampled, filtered: each side draws its own tokens, so "identical" is not a claim the run can make
    capsys.readouterr()
    assert main(["generate", str(ckpt), "--prompts-file", str(txt), "--mode", "speculative", "--plan", "2xF1-h0-K1",
                 "--batch-size", "4", "--max-new-tokens", "8", "--json", str(out), "--quiet", "--temperature", "0.9",
                 "--top-k", "5", "--top-p", "0.9", "--seed", "3"]) == 0
    spec = json.loads(out.read_text())
    assert spec["matches_sequential"] is None and "identical: n/a (sampled" in capsys.readouterr().out
    for bad, msg in ((["--mode", "jacobi", "--plan", "2xF1-h0-K1"], "one prompt at a time"),
                     (["--prompt", "x"], "not both"), (["--batch-size", "0"], "--batch-size"),
                     (["--distributed", "--mode", "sequential"], "single-process options")):
        assert main(["generate", str(ckpt), "--prompts-file", str(txt), *bad]) == 2
        assert msg in capsys.readouterr().err
    assert main(["generate", str(ckpt), "--batch-size", "2"]) == 2
    assert "give --prompts-file" in capsys.readouterr().err
    (tmp_path / "bad.jsonl").write_text('{"text": "no prompt field"}\n')
    assert main(["generate", str(ckpt), "--prompts-file", str(tmp_path / "bad.jsonl")]) == 2
    assert '"prompt" string' in capsys.readouterr().err


def _gen_prompt(ckpt, tmp_path, text):
    out = tmp_path / "one.json"
    assert main(["generate", str(ckpt), "--prompt", text, "--max-new-tokens", "24", "--json", str(out), "--quiet"]) == 0
    return json.loads(out.read_text())["tokens"]


def test_bench_decode_batches_and_drafter_flags(tmp_path, capsys):
    """--batch-sizes: batched sequential vs batched SSD per size (+ shared weights, confidence stop, adaptive block as
    variants), every row identical to its sequential output; the flags shape the single-prompt rows too."""
    out = tmp_path / "b.json"
    base = ["bench", "--decode", "--depth", "4", "--width", "32", "--head-dim", "16", "--vocab-size", "97",
            "--new-tokens", "6", "--prompt-len", "5", "--warmup", "0", "--runs", "1", "--json", str(out)]
    assert main([*base, "--plans", "2xF1-h0-K1,1xF2-h0-K1", "--blocks", "3", "--batch-sizes", "1,3",
                 "--share-weights", "--min-confidence", "0.5", "--adaptive-block"]) == 0
    recs = json.loads(out.read_text())
    keys = [(r["batch"], r["mode"], r["plan"], r["variant"]) for r in recs]
    assert keys[:6] == [(1, "sequential", "sequential", ""), (1, "speculative", "2xF1-h0-K1", ""),
                        (1, "speculative", "2xF1-h0-K1", "conf:0.5"), (1, "speculative", "2xF1-h0-K1", "adaptive"),
                        (1, "speculative", "2xF1-h0-K1", "+shared"), (1, "speculative", "2xF1-h0-K1", "conf:0.5+shared")]
    assert (3, "speculative", "1xF2-h0-K1", "adaptive") in keys and (3, "speculative", "1xF2-h0-K1", "+shared") not in keys
    assert all(r["matches_sequential"] and r["tokens_per_s"] > 0 for r in recs)
    assert all(len(r["prompt_lens"]) == r["batch"] for r in recs)
    assert "vs batched seq" in capsys.readouterr().out
    assert main([*base, "--plans", "2xF1-h0-K1", "--blocks", "2", "--share-weights", "--min-confidence", "0.4"]) == 0
    assert all(r["matches_sequential"] for r in json.loads(out.read_text()))
    assert main([*base, "--plans", "1xF2-h0-K1", "--share-weights"]) == 2
    assert "M = 1" in capsys.readouterr().err
    assert main(["bench", "--depth", "4", "--width", "32", "--head-dim", "16", "--batch-sizes", "2"]) == 2
    assert "use them with --decode" in capsys.readouterr().err
    assert main([*base, "--plans", "2xF1-h0-K1", "--batch-sizes", "0"]) == 2


def test_an_empty_prompt_is_said_before_generating_from_bos(ckpt, tmp_path, capsys):
    """`snlp generate CKPT` without --prompt decodes from BOS alone, a legal unconditional sample; it printed 128
    tokens without a word about the prompt. It now says so on stderr, in one line, after the checkpoint is found. A
    blank prompt is not empty (its whitespace tokens follow BOS), and a missing checkpoint is the one error."""
    assert main(["generate", str(ckpt), "--max-new-tokens", "4", "--quiet"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["snlp generate: the prompt is empty: generating from the tokenizer's BOS alone (give --prompt TEXT "
                   "to continue a text)"]
    for prompt in ("First", "   "):
        assert main(["generate", str(ckpt), "--prompt", prompt, "--max-new-tokens", "4", "--quiet"]) == 0
        assert "prompt is empty" not in capsys.readouterr().err
    assert main(["generate", str(tmp_path / "none"), "--max-new-tokens", "4"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"snlp generate: error: checkpoint {tmp_path / 'none'} "
                                                            f"does not exist"]


def test_compile_says_before_the_first_token_that_it_compiles(ckpt, monkeypatch, capsys):
    """`snlp generate --compile` on a CPU printed the prompt and then nothing for 4 minutes (inductor's C++ build of
    a 4-layer model's steps) before the first token: a line on stderr says what the wait is, before decoding
    starts (decoding is stubbed here: the line, not the compile, is under test)."""
    import snlp.apps.generate as generate

    def stop(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(generate, "decode", stop)
    with pytest.raises(KeyboardInterrupt):
        generate.run(generate_args(ckpt, "--compile", "--max-new-tokens", "2"))
    assert "--compile builds the compiled steps before the first token" in capsys.readouterr().err


def generate_args(ckpt, *argv):
    import argparse

    import snlp.apps.generate as generate

    p = argparse.ArgumentParser()
    generate.add_arguments(p)
    return p.parse_args([str(ckpt), *argv])


@pytest.mark.parametrize("extra,says", [
    (["--mode", "snlp", "--plan", "2xF1-h0-K1-diag", "--batch-size", "2"],
     "batched decoding supports the idn, none and hcn surrogates (--batch-size 1 decodes the prompts one at a time)"),
    (["--mode", "speculative", "--plan", "2xF1-h0-K1-newton", "--batch-size", "3", "--no-baseline"],
     "the newton surrogate's probes read the KV cache at one start position"),
    (["--mode", "snlp", "--plan", "4xF1-h0-K1-tol:-1"], "tol must be a positive number, got '-1'"),
    (["--mode", "snlp", "--plan", "4xF1-h0-K1", "--eos-id", "-1"], "--eos-id must be a token id >= 0 (got -1)"),
    # two answers to where the run stops: refused, never one of them silently kept
    (["--eos-id", "none,2"], "--eos-id none,2 says both none and ids: give none (decode the whole budget) or the ids"),
    (["--eos-id", "2", "--eos-id", "none"], "--eos-id was given 2 times (2, none): give it once"),
    (["--eos-id", "two"], "--eos-id takes token ids (ID or ID,ID,...) or none, got 'two'"),
    # --prompts-file times one batched run of each side: --repeats was accepted and ignored
    (["--mode", "speculative", "--plan", "2xF1-h0-K1", "--batch-size", "2", "--repeats", "5"],
     "--repeats sets the timed rounds of speculative mode's comparison with sequential decoding; --prompts-file times "
     "one batched run of each side, no rounds"),
    # both were refused by speculative_generate, after the load and after the prompt was echoed to stdout
    (["--mode", "speculative", "--plan", "2xF1-h0-K1", "--min-confidence", "2", "--no-baseline"],
     "--min-confidence must lie in [0, 1], a probability (got 2.0)"),
    (["--mode", "speculative", "--plan", "1xF2-h0-K1", "--share-weights", "--no-baseline"],
     "it needs one layer per chunk (M = 1, CxF1 plans), and 1xF2-h0-K1 fuses 2 layers per chunk"),
    # refused only once the drafter was bound or the decoder ran, after the checkpoint loaded and the prompt was echoed
    (["--mode", "speculative", "--plan", "2xF1-h0-K1", "--min-confidence", "1.5", "--no-baseline"],
     "--min-confidence must lie in [0, 1], a probability (got 1.5)"),
    (["--mode", "snlp", "--plan", "4xF1-h0-K1-diag", "--compile"], "the diag surrogate does not compile into one"),
    (["--mode", "speculative", "--plan", "4xF1-h0-K2-tol:0.1", "--compile", "--no-baseline"], "drop -tol"),
    (["--mode", "speculative", "--plan", "2xF2-h0-K1", "--share-weights"],
     "--share-weights shares each suffix layer's weights between drafter and verifier: it needs one layer per chunk"),
])
def test_generate_refuses_bad_input_before_the_model_loads(ckpt, tmp_path, monkeypatch, capsys, extra, says):
    """A plan batched decoding cannot run with --batch-size > 1, a malformed plan and a negative --eos-id were refused
    after the checkpoint loaded (and the batch plan after its plan was bound): now one line before it loads."""
    import snlp.io.checkpoint as C

    def load(*a, **k):
        raise AssertionError("the checkpoint loaded before the input was checked")
    monkeypatch.setattr(C, "load", load)
    prompts = tmp_path / "p.txt"
    prompts.write_text("First Citizen:\nAll: Speak\nResolved.\n")
    source = ["--prompts-file", str(prompts)] if "--batch-size" in extra else ["--prompt", "First"]
    assert main(["generate", str(ckpt), *source, "--max-new-tokens", "4", "--quiet", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("snlp generate: error: ") and says in err and "\n" not in err, err


@pytest.mark.parametrize("mode", ["snlp", "speculative"])
def test_prompts_file_one_at_a_time_takes_any_plan(ckpt, tmp_path, capsys, mode):
    """--batch-size 1 decodes the prompts one at a time, so a DiagN plan (which cannot batch) runs: `snlp generate
    --prompts-file F --batch-size 1 --mode snlp --plan ...-diag` was refused, its message saying to decode the prompts
    one at a time. Each prompt's tokens equal its own --prompt run."""
    texts = ["First Citizen:", "All: Speak", "Resolved."]
    (tmp_path / "p.txt").write_text("\n".join(texts) + "\n")
    plan = "2xF1-h0-K1-diag"
    out = tmp_path / "b.json"
    extra = ["--no-baseline"] if mode == "speculative" else []
    assert main(["generate", str(ckpt), "--prompts-file", str(tmp_path / "p.txt"), "--mode", mode, "--plan", plan,
                 "--max-new-tokens", "6", "--json", str(out), "--quiet", *extra]) == 0
    rec = json.loads(out.read_text())
    one = tmp_path / "one.json"
    for t, r in zip(texts, rec["results"]):
        assert main(["generate", str(ckpt), "--prompt", t, "--mode", mode, "--plan", plan, "--max-new-tokens", "6",
                     "--json", str(one), "--quiet", *extra]) == 0
        assert r["tokens"] == json.loads(one.read_text())["tokens"], t
    assert rec["tokens"] == 18 and rec["decode_s"] > 0


def test_a_padding_id_the_model_emits_is_marked_not_lost(tmp_path, capsys):
    """A model vocabulary padded past its tokenizer's (Qwen-style configs, padded nanochat tables) can emit a padding
    id: `snlp generate` prints and saves the text with the id marked (the tokens kept whole) instead of failing after
    the generation, and instead of dropping the id as `tokenizers` would."""
    tok = Tokenizer.train([TEXT], vocab_size=MIN_VOCAB + 40)
    model = make_model(seed=3, dtype=torch.float32, vocab_size=tok.vocab_size + 8, n_layer=2, n_head=2, n_kv_head=1,
                       n_embd=32, sequence_len=64, scale=0.15)
    with torch.no_grad():  # the head's padding row dominates: greedy decoding emits it
        model.lm_head.weight[tok.vocab_size + 3] = 50 * model.lm_head.weight[:tok.vocab_size].abs().max()
    ck = save_checkpoint(tmp_path / "padded", model, tokenizer=tok)
    out = tmp_path / "g.json"
    assert main(["generate", str(ck), "--prompt", "First", "--max-new-tokens", "3", "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    pad = tok.vocab_size + 3
    assert pad in rec["tokens"] and f"<|no token {pad}|>" in rec["text"]
    assert f"<|no token {pad}|>" in capsys.readouterr().out


def test_a_chat_answer_is_streamed_without_its_end_of_turn_token(capsys):
    """`snlp generate --chat` on SmolLM2 ended its streamed answer with a literal "<|im_end|>": the stop token, which
    the summary line already names (stop: eos); the prompt's template markers were never printed either."""
    from snlp.apps.generate import streamer

    class Tok:  # decodes each id to a marker of its own, so what the stream prints shows which ids it printed
        def decode(self, ids, mark_missing=False):
            return "".join(f"<{i}>" for i in ids)

    on = streamer(Tok(), hide=[9, 8])
    on([1, 2])
    on([3, 9])
    assert capsys.readouterr().out == "<1><2><3>"
    on = streamer(Tok())  # nothing hidden: every id is printed
    on([1, 9])
    assert capsys.readouterr().out == "<1><9>"



def test_speculative_generation_of_one_token_says_alpha_was_not_measured(ckpt, tmp_path, capsys):
    """--max-new-tokens 1: the prefill gives the token and no round drafts; the line printed "alpha=nan", "s=nan",
    "ideal SSD nanx" and the JSON a NaN (not JSON). Now each says it was not measured, and the JSON holds null."""
    for extra in ((), ("--no-baseline",)):
        out = tmp_path / "g.json"
        assert main(["generate", str(ckpt), "--prompt", "First Citizen:", "--max-new-tokens", "1", "--json", str(out),
                     "--mode", "speculative", "--plan", "2xF2-h0-K1", "--block", "3", *extra]) == 0
        line = capsys.readouterr().out.splitlines()[-2]
        rec = json.loads(out.read_text(), parse_constant=not_json)  # NaN / Infinity anywhere: not JSON
        assert len(rec["tokens"]) == 1 and rec["acceptance_rate"] is None and "nan" not in line, line
        assert "alpha not measured (nothing was drafted: the prefill gives the first token" in line
        if not extra:
            assert "s not measured (no drafter steps)" in line and "vs ideal SSD not measured (no drafts)" in line
            # the report object said NaN for them while the top-level fields said null
            rep = rec["report"]
            assert rep["alpha"] is None and rep["drafter_speedup_s"] is None and rep["ideal_ssd_speedup"] is None, rep


def test_speculative_generation_of_one_token_writes_no_nan_in_the_baselines_report(ckpt, tmp_path):
    """The baseline's report (speculative_benchmark's SSDRow) of a one-token run held NaN alpha, s, drafter ms and
    ideal: --json wrote bare NaN, which is not JSON (a strict parser refuses it). They are None, null in the JSON."""
    out = tmp_path / "g.json"
    assert main(["generate", str(ckpt), "--prompt", "First Citizen:", "--max-new-tokens", "1", "--json", str(out),
                 "--mode", "speculative", "--plan", "2xF2-h0-K1", "--block", "3", "--quiet", "--repeats", "1"]) == 0

    def refuse(c):
        raise ValueError(f"{c} in the JSON")
    rep = json.loads(out.read_text(), parse_constant=refuse)["report"]
    assert [rep[k] for k in ("alpha", "drafter_speedup_s", "drafter_ms_per_step", "ideal_ssd_speedup")] == [None] * 4
    assert rep["tokens_per_round"] == 1.0 and rep["measured_speedup"] > 0


def test_drafter_table_of_a_row_that_drafted_nothing_says_a_dash():
    """snlp.eval.drafter.markdown formatted alpha with :.3f: an SSD row of one new token (alpha None, nothing
    drafted) crashed the table with a TypeError."""
    from snlp.eval.drafter import DrafterRecord, markdown

    row = DrafterRecord(plan="2xF2-h0-K1", drafter="post-hoc", ppl=2.0, ppl_base=1.9, top1=0.9, logit_sim=0.99,
                        top1_ssd=None, tokens=10, ssd=[dict(block=3, alpha=None, tokens_per_round=1.0,
                                                            measured_speedup=0.8, matches_sequential=True)])
    assert "| 3 | – | 1.00 | 0.80x |" in markdown([row])


def not_json(constant):
    raise AssertionError(f"{constant} in a JSON file: strict parsers (jq, JavaScript, Go) refuse it")


def test_chat_on_snlps_own_tokenizer_asks_in_the_sft_format_and_stops_at_the_end_of_turn(tmp_path, capsys):
    """`snlp generate --chat` on a checkpoint with snlp's own BPE (what `snlp sft` trains) was refused ("this tokenizer
    has no chat template ... drop --chat"), and without --chat the reply never stopped at <|assistant_end|>. Now the
    prompt is the SFT format (render_chat + <|assistant_start|>) and the reply stops where nanochat's engine ends it.
    Reference: a naive greedy loop over the full forward stopping at <|assistant_end|> or <|bos|>; the head row of
    <|assistant_end|> is twice the row of the third greedy token's, so the reply ends there."""
    tok = Tokenizer.train([TEXT], vocab_size=MIN_VOCAB + 40)
    model = make_model(seed=3, dtype=torch.float32, vocab_size=tok.vocab_size, n_layer=2, n_head=2, n_kv_head=1,
                       n_embd=32, sequence_len=128, scale=0.15)
    end, bos = tok.token_id("<|assistant_end|>"), tok.bos_id
    prompt = tok.render_chat([{"role": "user", "content": "Speak"}], add_generation_prompt=True)[0]

    def naive(n):
        out = []
        with torch.no_grad():
            for _ in range(n):
                out.append(int(model(torch.tensor([prompt + out]))[0, -1].argmax()))
                if out[-1] in (end, bos):
                    break
        return out

    third = naive(3)[2]
    with torch.no_grad():
        model.lm_head.weight[end] = 2 * model.lm_head.weight[third]
    want = naive(20)
    assert want[-1] == end and len(want) < 20
    ckpt = save_checkpoint(tmp_path / "sft", model, tokenizer=tok)
    out = tmp_path / "g.json"
    assert main(["generate", str(ckpt), "--chat", "--prompt", "Speak", "--max-new-tokens", "20",
                 "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["tokens"] == want and got["stop"] == "eos"
    assert "<|assistant_end|>" not in capsys.readouterr().out  # the stop is not printed


def test_a_plain_prompt_on_snlps_own_tokenizer_decodes_the_whole_budget_unless_told(tmp_path):
    """snlp's own BPE has no end-of-text token: its <|bos|> starts every training document, plain text cut into ~4 KB
    pieces among them, so a base model's <|bos|> need not end its text. A plain prompt therefore stops nowhere by
    default (the record says so and why), even where the model's greedy token is <|bos|>; --eos-id with its id
    stops there, as nanochat's engine does. Reference: a naive greedy loop over the full forward; the head row of
    <|bos|> is twice the row of an early greedy token's, so <|bos|> is a greedy token before the budget ends."""
    tok = Tokenizer.train([TEXT], vocab_size=MIN_VOCAB + 40)
    model = make_model(seed=3, dtype=torch.float32, vocab_size=tok.vocab_size, n_layer=2, n_head=2, n_kv_head=1,
                       n_embd=32, sequence_len=128, scale=0.15)
    prompt, bos = tok.prompt_ids("First Citizen:"), tok.bos_id

    def naive(n):
        out = []
        with torch.no_grad():
            for _ in range(n):
                out.append(int(model(torch.tensor([prompt + out]))[0, -1].argmax()))
        return out

    free, row = naive(12), model.lm_head.weight[bos].clone()
    for k in range(1, 10):  # the first greedy token whose logit doubling makes <|bos|> the argmax there (> 0)
        with torch.no_grad():
            model.lm_head.weight[bos] = 2 * model.lm_head.weight[free[k]]
        want = naive(12)
        if bos in want[:-1]:
            break
        with torch.no_grad():
            model.lm_head.weight[bos] = row
    cut = want.index(bos) + 1
    assert cut < 12
    ck = save_checkpoint(tmp_path / "base", model, tokenizer=tok)
    for flag, tokens, stops, source in (([], want, [], "own_tokenizer"), (["--eos-id", str(bos)], want[:cut], [bos],
                                                                           "flag")):
        out = tmp_path / "g.json"
        assert main(["generate", str(ck), "--prompt", "First Citizen:", "--max-new-tokens", "12", "--quiet",
                     "--json", str(out), *flag]) == 0
        got = json.loads(out.read_text())
        assert got["tokens"] == tokens and (got["stop_ids"], got["stop_ids_source"]) == (stops, source)


@pytest.mark.parametrize("extra,says", [
    (["--mode", "sequential", "--eos-id", "99999"], "eos_id 99999 holds ids outside the model's vocabulary"),
    (["--mode", "speculative", "--plan", "2xF1-h0-K1-hcn", "--no-baseline"],
     "the hcn surrogate needs an mHC model"),
])
def test_a_refusal_that_needs_the_model_prints_no_prompt_before_it(ckpt, capsys, extra, says):
    """The prompt was echoed to stdout before the decoder checked its inputs against the loaded model, so a refusal
    read 'First Citizen:snlp generate: error: ...' on a terminal: the echo now comes with the first tokens."""
    assert main(["generate", str(ckpt), "--prompt", "First Citizen:", "--max-new-tokens", "4", *extra]) == 2
    cap = capsys.readouterr()
    err = cap.err.strip()
    assert cap.out == "", cap.out
    assert err.startswith("snlp generate: error: ") and says in err and "\n" not in err, err


def test_the_prompt_is_still_echoed_before_the_continuation(ckpt, capsys):
    assert main(["generate", str(ckpt), "--prompt", "First Citizen:", "--max-new-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("First Citizen:") and out.splitlines()[1].startswith("[sequential] 4 tokens"), out
def test_share_weights_on_an_mhc_model_is_refused_before_the_prompt_is_echoed(tmp_path, capsys):
    """--share-weights on an mHC checkpoint was refused once the drafter was bound, after the prompt had been echoed
    as the start of the output; now in one line before it (the part of the refusal the plan alone cannot tell)."""
    from conftest import mhc_model

    tok = Tokenizer.train([TEXT], vocab_size=MIN_VOCAB + 40)
    model = mhc_model(seed=3, dtype=torch.float32, vocab_size=tok.vocab_size, n_layer=2, n_embd=32,
                      x0_residual=False)
    ck = save_checkpoint(tmp_path / "m", model, tokenizer=tok)
    assert main(["generate", str(ck), "--prompt", "First Citizen:", "--max-new-tokens", "2", "--mode", "speculative",
                 "--plan", "2xF1-h0-K1", "--share-weights", "--no-baseline"]) == 2
    out, err = capsys.readouterr()
    assert "First Citizen" not in out and "mHC" in err and err.count("\n") == 1, (out, err)


@pytest.mark.parametrize("extra,says", [
    (["--eos-id", "100000"], "outside the model's vocabulary"),
    (["--mode", "snlp", "--plan", "4xF1-h0-K1-hcn"], "the hcn surrogate needs an mHC model"),
    (["--mode", "jacobi", "--plan", "4xF1-h0-K1-hcn"], "the hcn surrogate needs an mHC model"),
])
def test_what_the_model_refuses_is_refused_before_the_prompt_is_echoed(ckpt, capsys, extra, says):
    """--eos-id past the model's vocabulary and a plan the model's config cannot run (hcn without mHC) were refused
    by the decoder, after the prompt had been echoed as the start of the output; now in one line before it."""
    assert main(["generate", str(ckpt), "--prompt", "First Citizen:", "--max-new-tokens", "2", *extra]) == 2
    out, err = capsys.readouterr()
    assert "First Citizen" not in out and says in err and err.count("\n") == 1, (out, err)


def test_decoding_past_the_trained_context_is_said(ckpt, tmp_path, capsys):
    """`--max-new-tokens` past the model's sequence_len (128 here) decoded on without a word (RoPE extrapolation,
    not the trained regime); a stderr line now says so, single prompt and --prompts-file alike, and stays quiet
    inside the context."""
    assert main(["generate", str(ckpt), "--prompt", "First Citizen:", "--max-new-tokens", "8"]) == 0
    assert "trained context" not in capsys.readouterr().err
    assert main(["generate", str(ckpt), "--prompt", "First Citizen:", "--max-new-tokens", "130"]) == 0
    err = capsys.readouterr().err
    assert "+ --max-new-tokens 130 may reach past the model's trained context (128 tokens)" in err
    f = tmp_path / "p.txt"
    f.write_text("First Citizen:\nSecond:\n")
    assert main(["generate", str(ckpt), "--prompts-file", str(f), "--max-new-tokens", "127", "--quiet"]) == 0
    assert "trained context (128 tokens)" in capsys.readouterr().err


def test_ctrl_c_in_the_timing_keeps_the_generation(ckpt, tmp_path, monkeypatch, capsys):
    """Ctrl-C in speculative mode's timed comparison (after the generation, minutes on a converted model) lost the
    generation: no summary line, no --json, 'snlp generate: interrupted'. Now both are kept and the line says so."""
    import snlp.decode.speculative as speculative

    seq = _gen(ckpt, tmp_path, "--mode", "sequential")

    def cut(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(speculative, "speculative_benchmark", cut)
    for extra in ([], ["--prompts-file", str(tmp_path / "p.txt"), "--batch-size", "2"]):
        (tmp_path / "p.txt").write_text("First Citizen:\nAll: Speak\n")
        if extra:  # the batched comparison decodes sequentially after the batch: cut it there
            import snlp.apps.generate as generate

            real = generate.decode_batches
            monkeypatch.setattr(generate, "decode_batches", lambda *a, mode=None, **kw: cut() if mode else
                                real(*a, **kw))
        out = tmp_path / "cut.json"
        argv = ["generate", str(ckpt), "--max-new-tokens", "24", "--json", str(out), "--mode", "speculative",
                "--plan", "2xF2-h0-K1", "--block", "3", *(extra or ["--prompt", "First Citizen:"])]
        capsys.readouterr()
        assert main(argv) == 130
        cap = capsys.readouterr()
        rec = json.loads(out.read_text())
        assert rec["timing"] == "interrupted"
        got = [r["tokens"] for r in rec["results"]][0] if extra else rec["tokens"]
        assert got == seq["tokens"]  # the generation, exact, kept
        assert "the timing against sequential decoding was interrupted" in cap.out.splitlines()[-2]
        assert f"written to {out}" in cap.err.strip().splitlines()[-1]


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_sigterm_or_sighup_in_the_timing_keeps_the_generation_as_ctrl_c_does(ckpt, tmp_path, monkeypatch, capsys,
                                                                             sig):
    """SIGTERM (kill, docker stop) or SIGHUP (a closed terminal) in speculative mode's timed comparison killed
    `snlp generate` by the signal's default action: the finished generation lost, --json unwritten. Now each ends as
    Ctrl-C does there: the generation kept, --json written with "timing": "interrupted", exit 128 + the signal."""
    import os
    import signal

    import snlp.decode.speculative as speculative

    signum = getattr(signal, sig)
    before = signal.getsignal(signum)
    if before is signal.SIG_IGN:  # a suite started under nohup: an ignored SIGHUP stays ignored by design
        signal.signal(signum, signal.SIG_DFL)
    seq = _gen(ckpt, tmp_path, "--mode", "sequential")

    def cut(*a, **kw):  # a real signal to this process, where the timing runs
        os.kill(os.getpid(), signum)
        raise AssertionError("the signal did not stop the timing")

    monkeypatch.setattr(speculative, "speculative_benchmark", cut)
    out = tmp_path / "cut.json"
    capsys.readouterr()
    assert main(["generate", str(ckpt), "--max-new-tokens", "24", "--json", str(out), "--mode", "speculative",
                 "--plan", "2xF2-h0-K1", "--block", "3", "--prompt", "First Citizen:"]) == 128 + signum
    cap = capsys.readouterr()
    rec = json.loads(out.read_text())
    assert rec["timing"] == "interrupted" and rec["tokens"] == seq["tokens"]
    assert cap.err.strip().splitlines()[-1].startswith(f"snlp generate: interrupted by {sig}; the generation")
    assert signal.getsignal(signum) is signal.SIG_DFL  # the command's handler is gone again
    signal.signal(signum, before)


def one_rank_env(monkeypatch) -> None:
    """torchrun's environment for a one-rank process group of this process, set by hand on a free port."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                 "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(k, v)


def test_ctrl_c_in_the_distributed_timing_keeps_the_generation(ckpt, tmp_path, monkeypatch, capsys):
    """`snlp generate --distributed --mode speculative`: Ctrl-C in the timed rounds (after the generation) lost it:
    no summary line, no --json. Now rank 0 keeps it as the single-process command does ("timing": "interrupted")."""
    import snlp.runtime.timing as timing

    one_rank_env(monkeypatch)
    seq = _gen(ckpt, tmp_path, "--mode", "sequential", "--quiet")

    def cut(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(timing, "round_order", cut)
    out = tmp_path / "dist.json"
    capsys.readouterr()
    assert main(["generate", str(ckpt), "--distributed", "--mode", "speculative", "--plan", "2xF1-h0-K1", "--block",
                 "3", "--max-new-tokens", "24", "--prompt", "First Citizen:", "--json", str(out), "--quiet"]) == 130
    cap = capsys.readouterr()
    rec = json.loads(out.read_text())
    assert rec["timing"] == "interrupted" and rec["tokens"] == seq["tokens"] and rec["world_size"] == 1
    assert "measured_speedup" not in rec
    assert any("the timing against sequential decoding was interrupted" in line for line in cap.out.splitlines())
    assert f"written to {out}" in cap.err.strip().splitlines()[-1]


@pytest.mark.parametrize("mode", ["snlp", "speculative"])
def test_a_drafters_run_names_the_drafter_in_its_summary_and_json(ckpt, tmp_path, capsys, mode):
    """With --drafter the summary line and --json named only the plan (`[snlp 2xF1-h0-K1]`, "plan": "2xF1-h0-K1"),
    as a run of the model's own post-hoc plan writes them: in snlp mode the tokens are the drafter's approximation,
    not the plan's, and nothing in the record said so. Both now name the drafter (None without one), for one prompt
    and for a prompts file."""
    from snlp.io.checkpoint import load
    from snlp.io.drafter import save_drafter
    from snlp.method.drafter import make_drafter

    model, _ = load(ckpt)
    drafter = make_drafter(model, "2xF1-h0-K1")
    with torch.no_grad():  # an adapted drafter: its suffix is no longer the base's
        for p in drafter.suffix_state().values():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=p.dtype))
    d = save_drafter(tmp_path / "d", drafter)
    extra = ["--mode", mode] + (["--no-baseline"] if mode == "speculative" else [])
    own = _gen(ckpt, tmp_path, *extra, "--plan", "2xF1-h0-K1")
    line = capsys.readouterr().out.strip().splitlines()[-2]
    assert own["drafter"] is None and "drafter" not in line, line
    got = _gen(ckpt, tmp_path, *extra, "--drafter", str(d))
    line = capsys.readouterr().out.strip().splitlines()[-2]
    assert got["drafter"] == str(d) and got["plan"] == "2xF1-h0-K1", got
    assert line.startswith(f"[{mode} 2xF1-h0-K1, drafter {d}]"), line
    if mode == "snlp":  # the drafter's approximation: other tokens than the model's post-hoc plan
        assert got["tokens"] != own["tokens"]
    (tmp_path / "p.txt").write_text("First Citizen:\nAll:\n")
    out = tmp_path / "b.json"
    assert main(["generate", str(ckpt), "--prompts-file", str(tmp_path / "p.txt"), "--max-new-tokens", "6",
                 "--json", str(out), *extra, "--drafter", str(d)]) == 0
    rec = json.loads(out.read_text())
    assert rec["drafter"] == str(d) and f", drafter {d}]" in capsys.readouterr().out


@pytest.mark.parametrize("extra, says", [
    (["--eos-id", "99999"], "eos_id 99999 holds ids outside the model's vocabulary"),
    (["--mode", "snlp", "--plan", "2xF1-preheat-K1"], "has no calibration: run `snlp calibrate"),
])
def test_an_empty_prompt_refused_after_the_load_gets_its_refusal_alone(ckpt, capsys, extra, says):
    """The empty-prompt note ("generating from the tokenizer's BOS alone") came right after the load, before the
    refusals that need the model (an --eos-id past its vocabulary, a -preheat- plan without its calibration): the
    terminal announced a generation and then refused it. Only the refusal now; the note still comes where the run
    decodes (test_an_empty_prompt_is_said_before_generating_from_bos)."""
    assert main(["generate", str(ckpt), "--max-new-tokens", "2", *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0], err


def test_a_distributed_generation_records_the_drafter_key_as_a_single_process_one(ckpt, tmp_path, monkeypatch):
    """docs/usage.md: generate's --json holds `drafter` (the --drafter folder, null without one). The single-process
    record wrote it; the --distributed record (which refuses --drafter) had no such key, so a reader of both forms
    met a KeyError on one. Reference: the keys of the single-process record of the same generation."""
    one_rank_env(monkeypatch)
    one = _gen(ckpt, tmp_path, "--mode", "snlp", "--plan", "2xF1-h0-K1", "--quiet")
    out = tmp_path / "dist.json"
    assert main(["generate", str(ckpt), "--distributed", "--mode", "snlp", "--plan", "2xF1-h0-K1",
                 "--max-new-tokens", "24", "--prompt", "First Citizen:", "--json", str(out), "--quiet"]) == 0
    rec = json.loads(out.read_text())
    assert rec["tokens"] == one["tokens"] and rec["plan"] == one["plan"]
    assert "drafter" in rec and rec["drafter"] is None and one["drafter"] is None
