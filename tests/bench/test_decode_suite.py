"""`snlp bench --suite decode` (snlp.bench.decode_suite) on the CPU at smoke size: every exact method's tokens equal
an outside reference (a full-prefix argmax loop over the model; transformers' own greedy generate where it is
installed), the rows transformers cannot run are skipped with their reason, the prediction's arithmetic is the
hand count, and options the suite cannot honour are refused. No wall-clock thresholds."""

from __future__ import annotations

import importlib
import json
import math
import re
import statistics
import sys
from pathlib import Path

import pytest
import torch
from conftest import argmax_loop

import snlp
from snlp.apps.cli import main
from snlp.bench.decode_suite import DecodeSuiteConfig, markdown, random_llama, run_decode_suite
from snlp.bench.ssd_prediction import paper_shape_prediction
from snlp.decode.speculative import ideal_ssd_speedup
from snlp.io.checkpoint import save_checkpoint
from snlp.model.gpt import GPT, GPTConfig

try:
    importlib.import_module("transformers")
    HAVE_HF = True
except ImportError:
    HAVE_HF = False


def test_quick_cli_runs_every_method_and_exact_ones_equal_sequential(tmp_path, capsys):
    out = tmp_path / "decode.json"
    assert main(["bench", "--suite", "decode", "--quick", "--device", "cpu", "--json", str(out),
                 "--out", str(tmp_path / "dir")]) == 0
    table = capsys.readouterr().out
    assert "| snlp speculative |" in table and "(CPU numbers)" in table
    md = (tmp_path / "dir" / "decode.md").read_text().strip()
    assert md.startswith("# decode suite") and md in table  # the printed table is the file's
    res = json.loads(out.read_text())
    assert json.loads((tmp_path / "dir" / "decode.json").read_text())["rows"] == res["rows"]
    rows = res["rows"]
    assert sorted({r["batch"] for r in rows}) == [1, 4]
    model = random_llama(quick=True, seed=0)  # what --quick decodes: the same seeded weights
    n = res["meta"]["new_tokens"]
    assert res["reference"] == [argmax_loop(model, p, n) for p in res["prompts"]]
    methods = {r["method"] for r in rows}
    assert {"snlp sequential", "snlp snlp", "snlp speculative"} <= methods
    for r in rows:
        if r["skipped"]:
            assert r["tokens_per_s"] is None and r["exact"] is None  # nothing ran: no claim (the table's "-")
            continue
        assert r["tokens_per_s_min"] <= r["tokens_per_s"] <= r["tokens_per_s_max"]
        assert len(r["seconds"]) == res["config"]["rounds"]
        assert r["tokens_per_s"] == pytest.approx(sorted(r["batch"] * n / s for s in r["seconds"])[1])  # median of 3
        if r["exact"]:  # fp32 on one CPU: exact methods give the reference's tokens
            assert r["matches_sequential"], r
    snlp_rows = [r for r in rows if r["library"] == "snlp"]
    assert all(not r["skipped"] for r in snlp_rows) and {r["treatment"] for r in snlp_rows} == {"eager"}
    spec = [r for r in snlp_rows if r["method"] == "snlp speculative"]
    assert spec and all(0.0 <= r["alpha"] <= 1.0 for r in spec)
    hf = [r for r in rows if r["library"] == "transformers"]
    if not HAVE_HF:
        assert hf and all("not installed" in r["skipped"] for r in hf)
        return
    b1 = {r["method"]: r for r in hf if r["batch"] == 1}
    assert set(b1) == {"hf greedy", "hf greedy (static)", "hf early-exit", "hf prompt-lookup"}
    assert all(r["skipped"] is None and r["matches_sequential"] for r in b1.values())  # transformers' tokens = ours
    b4 = {r["method"]: r for r in hf if r["batch"] == 4}
    assert b4["hf greedy"]["matches_sequential"] and b4["hf greedy (static)"]["matches_sequential"]
    assert "batch size 1 only" in b4["hf early-exit"]["skipped"] and "batch size 1" in b4["hf prompt-lookup"]["skipped"]


def test_transformers_missing_skips_its_rows_with_the_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    res = run_decode_suite(DecodeSuiteConfig(quick=True, device="cpu", batch_sizes=(1,), new_tokens=4, rounds=1,
                                             warmup=0))
    hf = [r for r in res.rows if r.library == "transformers"]
    assert hf and all(r.skipped == "transformers is not installed" and r.tokens_per_s is None for r in hf)
    assert res.meta.hf_note == "transformers is not installed"
    assert all(r.tokens_per_s for r in res.rows if r.library == "snlp")


@pytest.mark.skipif(not HAVE_HF, reason="transformers is not installed")
def test_a_model_transformers_cannot_hold_is_decoded_by_snlp_and_its_hf_rows_say_why(tmp_path):
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=97, n_layer=4, n_head=2, n_embd=32, sequence_len=128))  # nanochat-style
    model.init_weights(seed=0)
    save_checkpoint(tmp_path / "ck", model)
    res = run_decode_suite(DecodeSuiteConfig(ckpt=str(tmp_path / "ck"), quick=True, device="cpu", batch_sizes=(1,),
                                             new_tokens=4, rounds=1, warmup=0, plans=("2xF1-h0-K2",)))
    hf = [r for r in res.rows if r.library == "transformers"]
    assert all("transformers cannot hold this model" in r.skipped and "x0_residual" in r.skipped for r in hf)
    snlp_rows = {r.method: r for r in res.rows if r.library == "snlp"}
    assert snlp_rows["snlp speculative"].matches_sequential
    assert snlp_rows["snlp snlp"].exact and snlp_rows["snlp snlp"].matches_sequential  # K = C, M = 1: exact
    assert res.reference == [argmax_loop(model.eval(), p, 4) for p in res.prompts]


def test_a_nanochat_checkpoint_folder_is_decoded_as_snlp_load_reads_it(tmp_path, capsys):
    """--ckpt a nanochat / nanochat-snlp folder (model_NNNNNN.pt + meta_NNNNNN.json), which plain `snlp bench --ckpt`
    takes, was sent to transformers' loader and refused as "a transformers model directory" without config.json. It is
    read by snlp.load: its exact rows equal the full-prefix argmax loop of that model (the paper's checkpoint with
    windows, smear, backout and value embeddings; a K = C, M = 1 plan is exact), and transformers' rows say why they
    cannot run it."""
    ckpt = Path(__file__).resolve().parents[1] / "data" / "nanochat" / "nanochat-sw"
    res = run_decode_suite(DecodeSuiteConfig(ckpt=str(ckpt), quick=True, device="cpu", batch_sizes=(1,), new_tokens=4,
                                             rounds=1, warmup=0, plans=("6xF1-h0-K6",)))
    model, _ = snlp.load(ckpt)
    assert res.reference == [argmax_loop(model, p, 4) for p in res.prompts]
    rows = {r.method: r for r in res.rows if r.library == "snlp"}
    assert rows["snlp snlp"].exact and rows["snlp snlp"].matches_sequential
    assert rows["snlp speculative"].matches_sequential
    assert all("transformers cannot hold this model" in r.skipped for r in res.rows if r.library == "transformers")
    assert main(["bench", "--suite", "decode", "--ckpt", str(ckpt), "--quick", "--suite-new-tokens", "2",
                 "--batch-sizes", "1", "--out", str(tmp_path / "ds")]) == 0
    assert "nanochat checkpoint" in capsys.readouterr().out


def test_prediction_is_the_hand_count_of_its_measured_step_times():
    rows = paper_shape_prediction("0.5B", alphas=(0.0, 0.5, 1.0), plans=("24xF1-h0-K2",), blocks=(2, 4), quick=True,
                                  device="cpu", rounds=2, warmup=0)
    assert len(rows) == 6 and all(r.label.startswith("PREDICTION") for r in rows)
    for r in rows:
        assert r.s == pytest.approx(r.sequential_ms / r.drafter_ms)
        per_round = {0.0: 1.0, 0.5: (1 - 0.5 ** (r.block + 1)) / 0.5, 1.0: r.block + 1.0}[r.alpha]
        assert r.predicted_speedup == pytest.approx(per_round * r.sequential_ms /
                                                    (r.block * r.drafter_ms + r.verify_ms))
        assert r.predicted_paper_formula == pytest.approx(ideal_ssd_speedup(r.alpha, r.block, r.s))
        assert r.predicted_paper_formula == pytest.approx(per_round / (r.block / r.s + 1))
        assert math.isfinite(r.verify_ms) and r.verify_ms > 0


def test_prediction_cli_labels_its_numbers_as_predicted(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["bench", "--suite", "decode", "--quick", "--device", "cpu", "--shapes", "0.5B", "--alpha", "0.7",
                 "--suite-plans", "24xF1-h0-K2", "--suite-runs", "2", "--json", str(out), "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "PREDICTED" in text and "(predicted)" in text
    assert (tmp_path / "prediction.md").read_text().strip() in text
    rows = json.loads(out.read_text())["rows"]
    assert [r["alpha"] for r in rows] == [0.7] and rows[0]["label"].startswith("PREDICTION")


@pytest.mark.parametrize("argv, says", [
    (["--no-ablations"], "does not take --no-ablations"),
    (["--treatments", "compiled", "--compile"], "give the treatments once"),
    (["--treatments", "eager,jit"], "treatments must be eager and/or compiled"),
    (["--plans", "2xF1-h0-K1"], "--suite-plans"),
    (["--alpha", "0.5"], "use it with --shapes"),
    (["--shapes", "0.5B", "--ckpt", "x"], "drop --ckpt"),
    (["--shapes", "0.5B", "--alpha", "1.5"], "alpha must lie in [0, 1]"),
    (["--shapes", "0.5B", "--batch-sizes", "1,4"], "does not take --batch-sizes"),
    (["--batch-sizes", "1,9"], "batch sizes must lie in 1..8"),
    (["--early-exit", "6"], "must be below the model's 6 layers"),
    (["--suite-plans", "9xF1-h0-K1"], "L = 6"),
    (["--suite-methods", "speculative,jacobi"], "methods are snlp and/or speculative"),
    (["--suite-methods", ","], "got none"),
    (["--suite-methods", "snlp", "--drafter", "no-such-dir"], "add speculative to the methods"),
    (["--suite-methods", "snlp", "--blocks", "2,3"], "--blocks sizes the speculative rows' drafts"),
    (["--no-transformers", "--early-exit", "2"], "--early-exit sets transformers' assisted rows"),
    (["--no-transformers", "--prompt-lookup", "2", "--early-exit", "1"], "--early-exit and --prompt-lookup set "),
    (["--shapes", "0.5B", "--suite-methods", "snlp"], "does not take --suite-methods"),
    (["--batch-sizes", "1,4", "--suite-prompts", "6"], "a multiple of every batch size (1,4), got 6"),
    (["--suite-prompts", "9"], "prompts per call must lie in 1..8"),
    (["--shapes", "0.5B", "--suite-prompts", "4"], "does not take --suite-prompts"),
    # the forward / decode benchmarks' flags: the suite reads none of them (its own: --suite-runs, ...)
    (["--runs", "7"], "--runs is not read by `snlp bench --suite decode`"),
    (["--warmup", "9"], "--warmup is not read by `snlp bench --suite decode`"),
    (["--new-tokens", "3"], "--new-tokens is not read by `snlp bench --suite decode`"),
    (["--depth", "4"], "--depth is not read by `snlp bench --suite decode`"),
    (["--shapes", "0.5B", "--runs", "7"], "--runs is not read by `snlp bench --suite decode`"),
    (["--repetition-penalty", "0"], "--repetition-penalty must be a finite number > 0"),
    (["--shapes", "0.5B", "--repetition-penalty", "1.2"], "does not take --repetition-penalty"),
])
def test_refusals_come_before_any_work(argv, says, capsys):
    assert main(["bench", "--suite", "decode", "--quick", "--device", "cpu", *argv]) == 2
    assert says in capsys.readouterr().err


def test_paper_suite_refuses_the_decode_suites_flags(capsys):
    assert main(["bench", "--suite", "paper", "--quick", "--alpha", "0.5"]) == 2
    assert "belong to --suite decode" in capsys.readouterr().err
    assert main(["bench", "--suite", "paper", "--quick", "--suite-methods", "snlp"]) == 2
    assert "--suite-methods is not read by `snlp bench --suite paper`" in capsys.readouterr().err


@pytest.mark.parametrize("methods, kinds", [
    (("snlp",), {"snlp sequential", "snlp snlp"}),
    (("speculative",), {"snlp sequential", "snlp speculative"}),
    (("speculative", "snlp"), {"snlp sequential", "snlp snlp", "snlp speculative"}),
])
def test_methods_pick_the_snlp_rows_and_sequential_always_runs(methods, kinds):
    res = run_decode_suite(DecodeSuiteConfig(quick=True, device="cpu", batch_sizes=(1, 2), new_tokens=4, rounds=1,
                                             warmup=0, transformers=False, methods=methods, blocks=(2, 3)))
    ours = [r for r in res.rows if r.library == "snlp"]
    assert {r.method for r in ours} == kinds and res.config.methods == methods
    assert len(ours) == 2 * (1 + ("snlp" in methods) + 2 * ("speculative" in methods))
    assert all(r.matches_sequential for r in ours if r.exact)


@pytest.mark.skipif(not HAVE_HF, reason="transformers is not installed")
def test_a_call_decodes_several_prompts_a_batch_at_a_time_and_each_equals_the_argmax_loop():
    res = run_decode_suite(DecodeSuiteConfig(quick=True, device="cpu", dtype="float64", batch_sizes=(1, 2),
                                             prompts=4, new_tokens=5, rounds=1, warmup=0, blocks=(2,)))
    model = random_llama(quick=True, seed=0).double().eval()
    assert len(res.prompts) == 4 and res.reference == [argmax_loop(model, p, 5) for p in res.prompts]
    ran = [r for r in res.rows if r.tokens_per_s is not None]
    assert {r.method for r in ran} >= {"snlp sequential", "snlp speculative", "hf greedy", "hf greedy (static)",
                                       "hf early-exit", "hf prompt-lookup"}
    assert all(r.prompts == 4 for r in res.rows) and all(r.matches_sequential for r in ran if r.exact)
    for r in ran:  # tok/s counts every prompt of the call: 4 x 5 tokens per timed call
        assert r.tokens_per_s == pytest.approx(4 * 5 / r.seconds[0])


@pytest.mark.parametrize("p", [0.5, 1.3])
def test_a_repetition_penalty_runs_on_every_row_snlp_and_transformers_alike(p):
    """repetition_penalty (`--repetition-penalty`): the suite decoded without any, so a comparison with a model
    whose generate() applies one compared other decodings. Now the reference is the penalised argmax loop, every exact
    snlp row equals it, and transformers' rows (generate(repetition_penalty=p): greedy, static cache, early exit,
    prompt lookup) give the same tokens; the header says which penalty ran."""
    res = run_decode_suite(DecodeSuiteConfig(quick=True, device="cpu", dtype="float64", batch_sizes=(1, 2), new_tokens=8,
                                             rounds=1, warmup=0, blocks=(2,), repetition_penalty=p))
    model = random_llama(quick=True, seed=0).double().eval()
    assert res.reference == [argmax_loop(model, q, 8, penalty=p) for q in res.prompts]
    assert res.reference != [argmax_loop(model, q, 8) for q in res.prompts]  # the penalty acts on these prompts
    assert (res.meta.repetition_penalty, res.meta.repetition_penalty_from) == (p, "given")
    ran = [r for r in res.rows if r.tokens_per_s is not None]
    assert all(r.matches_sequential for r in ran if r.exact), [r for r in ran if r.exact and not r.matches_sequential]
    if HAVE_HF:
        hf = {(r.method, r.batch) for r in ran if r.library == "transformers"}
        assert {("hf greedy", 1), ("hf greedy (static)", 2), ("hf early-exit", 1), ("hf prompt-lookup", 1)} <= hf
    assert f"repetition penalty {p:g} on every row, snlp's and transformers'" in markdown(res)


def test_a_prompts_file_is_decoded_instead_of_the_suites_texts(tmp_path):
    """Token-id prompts from a file, cut to the prompt length: the reference is the argmax loop on exactly those."""
    gen = torch.Generator().manual_seed(7)
    given = [torch.randint(0, 256, (k,), generator=gen).tolist() for k in (6, 9, 5, 7)]
    path = tmp_path / "prompts.json"
    path.write_text(json.dumps(given))
    res = run_decode_suite(DecodeSuiteConfig(quick=True, device="cpu", dtype="float64", batch_sizes=(1, 2),
                                             prompts=4, prompts_file=str(path), prompt_len=5, new_tokens=4, rounds=1,
                                             warmup=0, transformers=False, blocks=(2,)))
    assert res.prompts == [g[:5] for g in given] and res.meta.prompts == f"file {path}"
    model = random_llama(quick=True, seed=0).double().eval()
    assert res.reference == [argmax_loop(model, p, 4) for p in res.prompts]
    assert all(r.matches_sequential for r in res.rows if r.library == "snlp" and r.exact)


def test_text_prompts_from_a_file_are_tokenized_by_the_checkpoints_tokenizer(tmp_path):
    from snlp.io.tokenizer import MIN_VOCAB, Tokenizer

    text = "First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. " * 20
    tok = Tokenizer.train([text], vocab_size=MIN_VOCAB + 40)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=tok.vocab_size, n_layer=4, n_head=2, n_embd=32, sequence_len=128))
    model.init_weights(seed=0)
    save_checkpoint(tmp_path / "ck", model, tokenizer=tok)
    texts = ["Before we proceed any further, hear me speak.", "All: Speak, speak. First Citizen: hear me"]
    (tmp_path / "p.json").write_text(json.dumps(texts))
    res = run_decode_suite(DecodeSuiteConfig(ckpt=str(tmp_path / "ck"), prompts_file=str(tmp_path / "p.json"),
                                             quick=True, device="cpu", batch_sizes=(2,), prompt_len=6, new_tokens=3,
                                             rounds=1, warmup=0, transformers=False))
    assert res.prompts == [tok.encode(t)[:6] for t in texts]


@pytest.mark.parametrize("content, argv, says", [
    (None, [], "the prompts file {path} does not exist"),
    ("[1, 2", [], "is not JSON"),
    ('{"prompts": [[1, 2]]}', [], "must hold a non-empty JSON list of prompts"),
    ("[[1, 2, -3]]", [], "must hold a non-empty JSON list of prompts"),
    ("[[1, 2, 3]]", ["--batch-sizes", "1,2"], "batch sizes must lie in 1..1 (the prompts file's)"),
    ("[[1, 2, 3], [4, 5, 6]]", ["--batch-sizes", "1", "--suite-prompts", "4"], "must lie in 1..2 (the prompts file's)"),
    ("[[1, 2, 3, 4, 5, 6, 7, 8, 9]]", ["--batch-sizes", "1"], "has 9 tokens, fewer than the prompt length 16"),
    ("[[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 999]]", ["--batch-sizes", "1", "--prompt-len", "16"],
     "has token id 999, outside the model's vocabulary of 256"),
    ('["a text prompt"]', ["--batch-sizes", "1"], "is text and this model has no tokenizer"),
])
def test_a_bad_prompts_file_is_refused_in_one_line(content, argv, says, tmp_path, capsys):
    path = tmp_path / "p.json"
    if content is not None:
        path.write_text(content)
    assert main(["bench", "--suite", "decode", "--quick", "--device", "cpu", "--prompts-file", str(path),
                 "--no-transformers", *argv]) == 2
    err = capsys.readouterr().err
    assert says.format(path=path) in err and len(err.strip().splitlines()) == 1, err


def test_a_compiled_rows_compile_time_is_what_its_own_calls_compiled(monkeypatch):
    """Steps are shared (the speculative rows' verifier is sequential's step, every batch size the same steps):
    each row reports what its own calls compiled, not its steps' running totals. A stand-in step "compiles"
    one second per length it was not warmed at before."""
    import snlp.bench.decode_suite as suite
    from snlp.decode.steps import EagerStep, sequential_step, snlp_step

    class Counting(EagerStep):
        def __init__(self, eager):
            super().__init__(eager.forward, eager.fn)
            self.compile_s, self.seen = 0.0, set()

        def warm(self, cache, lengths):
            new = set(lengths) - self.seen
            self.seen |= new
            self.compile_s += len(new)
            return float(len(new))

        def warm_prefill(self, cache, T):  # the prefill's own graph (Step.warm_prefill)
            return self.warm(cache, [("fill", T)]) if T > 0 else 0.0

    monkeypatch.setattr(suite, "sequential_step", lambda model, comp: Counting(sequential_step(model, False)))
    monkeypatch.setattr(suite, "snlp_step", lambda runner, comp: Counting(snlp_step(runner, False)))
    res = run_decode_suite(DecodeSuiteConfig(quick=True, device="cpu", batch_sizes=(1,), new_tokens=4, rounds=1,
                                             warmup=1, transformers=False, treatments=("compiled",), blocks=(2, 3)))
    got = {(r.method, r.block): r.compile_s for r in res.rows if r.library == "snlp"}
    # sequential: its prefill and its one-token step; the plan's SNLP decoding: the same two lengths of its own
    # step; each speculative row: only its verifier's B + 1 (the drafter's one-token step was compiled above)
    assert got == {("snlp sequential", None): 2.0, ("snlp snlp", None): 2.0, ("snlp speculative", 2): 1.0,
                   ("snlp speculative", 3): 1.0}


def test_an_adapted_drafter_gets_its_own_exact_speculative_rows(tmp_path):
    from snlp.io.drafter import save_drafter
    from snlp.method.drafter import make_drafter

    base = random_llama(quick=True, seed=3)
    save_checkpoint(tmp_path / "ck", base)
    drafter = make_drafter(base, "3xF1-h0-K1")
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():  # another suffix than the base's: the drafter must be the one drafting
        for block in drafter.model.blocks[drafter.suffix_start:]:
            for p in block.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    save_drafter(tmp_path / "dr", drafter)
    res = run_decode_suite(DecodeSuiteConfig(ckpt=str(tmp_path / "ck"), drafter=str(tmp_path / "dr"), quick=True,
                                             device="cpu", batch_sizes=(1, 2), new_tokens=6, rounds=1, warmup=0,
                                             transformers=False))
    rows = [r for r in res.rows if r.method == "snlp speculative (drafter)"]
    assert [r.batch for r in rows] == [1, 2] and all(r.plan == "3xF1-h0-K1" for r in rows)
    assert all(r.matches_sequential and 0.0 <= r.alpha <= 1.0 for r in rows)
    assert res.reference == [argmax_loop(base, p, 6) for p in res.prompts]
    own = [r for r in res.rows if r.method == "snlp speculative" and r.batch == 1]
    assert own and own[0].alpha != rows[0].alpha  # the drafter's suffix, not the base's, drafted


def test_a_drafter_of_another_model_is_refused(tmp_path):
    from snlp.io.drafter import save_drafter
    from snlp.method.drafter import make_drafter

    save_checkpoint(tmp_path / "ck", random_llama(quick=True, seed=3))
    save_drafter(tmp_path / "dr", make_drafter(random_llama(quick=True, seed=4), "3xF1-h0-K1"))
    with pytest.raises(ValueError, match="belongs to another model"):
        run_decode_suite(DecodeSuiteConfig(ckpt=str(tmp_path / "ck"), drafter=str(tmp_path / "dr"), quick=True,
                                           device="cpu", batch_sizes=(1,), new_tokens=2, rounds=1, warmup=0))


def two_rows_one_failing(call: int, error: Exception):
    """Two rows of the suite, and the callables of their methods: the first always returns, the second raises
    `error` on its `call`-th call; `calls` counts each one's calls."""
    from snlp.bench.decode_suite import DecodeSuiteRow

    calls = {"ok": 0, "flaky": 0}

    def ok():
        calls["ok"] += 1

    def flaky():
        calls["flaky"] += 1
        if calls["flaky"] == call:
            raise error

    rows = [DecodeSuiteRow(method=m, library="snlp", treatment="eager", batch=1) for m in ("a", "b")]
    return rows, {0: ok, 1: flaky}, calls


def test_a_method_that_fails_mid_run_is_a_skipped_row_and_the_others_go_on():
    from snlp.bench.decode_suite import round_robin_calls

    rows, fns, calls = two_rows_one_failing(3, RuntimeError("CUDA graph overwritten\nsecond line"))
    seen = []
    times = round_robin_calls(fns, rows, warmup=1, rounds=4, device="cpu", check=seen.append)
    assert list(times) == [0] and len(times[0]) == 4 and calls["ok"] == 5
    assert rows[1].skipped.startswith("failed in timed round 3: RuntimeError: CUDA graph overwritten")
    assert rows[1].to_dict()["exact"] is None and rows[0].to_dict()["exact"] is True  # the JSON's: as the table's
    assert seen.count(1) == 2 and seen.count(0) == 5  # tokens checked after every call that returned


def test_a_row_that_fails_after_a_progress_report_keeps_no_speed_from_it():
    from snlp.bench.decode_suite import round_robin_calls

    rows, fns, _ = two_rows_one_failing(4, RuntimeError("boom"))
    reports = []

    def on_progress(times, what):  # as run_batch's does: figures from the calls so far
        reports.append(what)
        for i, secs in times.items():
            rows[i].seconds, rows[i].tokens_per_s, rows[i].speedup = list(secs), 1.0, 1.0

    round_robin_calls(fns, rows, warmup=1, rounds=4, device="cpu", check=lambda i: None, on_progress=on_progress)
    assert rows[1].skipped.startswith("failed in timed round 4") and rows[1].tokens_per_s is None
    assert rows[1].speedup is None and rows[1].seconds == [] and len(rows[0].seconds) == 4
    # every first call (compilation happens there), then one report per later round
    assert reports == ["first call of row 1 of 2", "first call of row 2 of 2"] + \
        [f"round {r} of 5 (timed {r - 1} of 4)" for r in range(2, 6)]
    assert rows[1].compile_s is None


def test_a_run_cut_short_keeps_every_round_it_finished():
    """The files the CLI rewrites on its way hold the rows measured so far, labelled partial; a kill (here: the
    progress callback raising, as a timeout's signal would stop the process there) loses only the round running."""
    from snlp.bench.decode_suite import markdown

    snaps = []

    class Killed(Exception):
        pass

    def progress(result, what):
        snaps.append((what, json.loads(json.dumps(result.to_dict())), markdown(result)))
        if what == "batch 4: round 3 of 4 (timed 2 of 3)":  # batch 1 done, batch 4 two of three timed rounds in
            raise Killed

    cfg = DecodeSuiteConfig(quick=True, device="cpu", batch_sizes=(1, 4), new_tokens=3, rounds=3, warmup=1,
                            transformers=False)
    with pytest.raises(Killed):
        run_decode_suite(cfg, progress=progress)
    what, last, md = snaps[-1]
    assert not last["complete"] and "**PARTIAL**" in md
    b1 = [r for r in last["rows"] if r["batch"] == 1]
    b4 = [r for r in last["rows"] if r["batch"] == 4 and not r["skipped"]]
    assert b1 and all(len(r["seconds"]) == 3 for r in b1 if not r["skipped"])  # the finished batch, whole
    assert b4 and all(len(r["seconds"]) == 2 and r["tokens_per_s"] is not None for r in b4)
    assert all(r["matches_sequential"] for r in b4 if r["exact"])  # tokens checked from the first call on
    assert md.count("2 of 3 timed rounds") == len(b4)
    first = next(s for w, s, _ in snaps if w.startswith("batch 1: first call of row 1"))
    assert first["rows"][0]["first_call_s"] is not None and first["rows"][0]["tokens_per_s"] is None
    assert "not run yet" in next(m for w, _, m in snaps if w.startswith("batch 1: first call of row 1"))
    done = run_decode_suite(cfg)
    assert done.complete and "PARTIAL" not in markdown(done) and "timed rounds" not in markdown(done)
    # a batch size listed twice is refused (rows are compared by batch size), before any work
    with pytest.raises(ValueError, match="distinct"):
        run_decode_suite(DecodeSuiteConfig(quick=True, device="cpu", batch_sizes=(1, 4, 1)),
                         progress=lambda *a: pytest.fail("ran"))
    assert "| - | - | --no-transformers |" in markdown(done)  # a skipped row claims no exactness
    skipped = [r for r in done.to_dict()["rows"] if r["skipped"]]
    assert skipped and all(r["exact"] is None for r in skipped)  # nor in the JSON


def test_a_row_is_as_good_as_its_worst_call():
    from snlp.bench.decode_suite import DecodeSuiteRow, fold_tokens

    row = DecodeSuiteRow(method="a", library="snlp", treatment="eager", batch=2)
    ref = [[1, 2, 3], [4, 5, 6]]
    fold_tokens(row, [[1, 2, 3], [4, 5, 6]], ref)
    assert row.matches_sequential and row.mismatched_rows == 0 and row.first_mismatch is None
    fold_tokens(row, [[1, 2, 3], [4, 9, 6]], ref)
    fold_tokens(row, [[1, 2, 3], [4, 5, 6]], ref)  # a later good call does not clear the verdict
    assert row.matches_sequential is False and row.mismatched_rows == 1 and row.first_mismatch == 1
    fold_tokens(row, [[7, 2, 3], [4, 5, 6]], ref)
    assert row.first_mismatch == 0 and row.mismatched_rows == 1


def test_an_approximate_rows_note_names_its_own_reason():
    """The table's note on an approximate snlp row says why that plan is approximate: a reversed chunk order at K = C
    (exact only from 2C - 1 iterations) or a tol stop at K = C is neither "K < C" nor "M > 1"."""
    from snlp.bench.decode_suite import (DecodeSuiteConfig, DecodeSuiteMeta, DecodeSuiteResult, DecodeSuiteRow,
                                         markdown)

    plans = ("3xF1-h0-K3-order:reversed", "3xF1-h0-K3-tol:0.001", "3xF2-h0-K1", "3xF1-h0-K3")
    rows = [DecodeSuiteRow(method="snlp snlp", library="snlp", treatment="eager", batch=1, plan=p,
                           exact=p == "3xF1-h0-K3") for p in plans]
    meta = DecodeSuiteMeta(device="cpu", device_type="cpu", torch="x", cuda=None, transformers=None,
                           dtype="float32", date="d", command=None, platform="p", threads=1, model="m", n_layer=6,
                           n_embd=64, prompts="random ids", prompt_len=8, new_tokens=8)
    md = markdown(DecodeSuiteResult(DecodeSuiteConfig(quick=True).resolved(), meta, rows, complete=True))
    lines = {p: next(ln for ln in md.splitlines() if f"| {p} |" in ln) for p in plans}
    assert "approximate by design (K = 3 < 5, the iterations it is exact from)" in lines[plans[0]]
    assert "approximate by design (tol 0.001 may stop the solve early)" in lines[plans[1]]
    assert "K = 1 < 3" in lines[plans[2]] and "M = 2 > 1: the fused model" in lines[plans[2]]
    assert "approximate" not in lines[plans[3]] and "K < C or M > 1" not in md


def test_comparisons_name_the_rows_they_compare_and_call_overlapping_ranges_a_tie():
    from snlp.bench.decode_suite import DecodeSuiteRow, comparisons

    def row(method, tps, lo, hi, treatment="eager", **kw):
        return DecodeSuiteRow(method=method, library="snlp" if method.startswith("snlp") else "transformers",
                              treatment=treatment, batch=1, tokens_per_s=tps, tokens_per_s_min=lo, tokens_per_s_max=hi,
                              seconds=[1.0] * 5, **kw)  # 5 rounds: separated ranges can resolve a lead
    rows = [row("snlp sequential", 100, 95, 105), row("hf greedy", 50, 45, 55), row("hf greedy (static)", 80, 70, 96),
            row("snlp speculative", 300, 290, 310, plan="6xF1-h0-K1", block=4, matches_sequential=True),
            row("snlp speculative", 900, 890, 910, plan="2xF1-h0-K1", block=4, matches_sequential=False),
            row("hf early-exit", 100, 90, 110, plan="E=2"), row("hf prompt-lookup", None, None, None, skipped="x")]
    lines = comparisons(rows)
    assert lines[0] == ("- B=1, eager: snlp sequential 1.25x (a tie: the min-max ranges overlap) the tok/s of "
                        "transformers' faster greedy row (hf greedy (static))")
    assert lines[1] == ("- B=1: the fastest snlp self-speculative row (eager, 6xF1-h0-K1, block 4) 3.00x the tok/s of "
                        "the fastest transformers assisted row (hf early-exit, E=2)")  # a row off the tokens is no row
    assert len(lines) == 2


def test_a_comparison_with_a_transformers_row_of_other_tokens_says_so():
    """The snlp side of a comparison line decodes snlp sequential's tokens (its speculative rows are picked among
    those that do); a transformers row whose tokens differ (its "= seq" no) is named as such on the line, with the
    table's counts, not compared as if it decoded the same text."""
    from snlp.bench.decode_suite import DecodeSuiteRow, comparisons

    def row(method, tps, **kw):
        return DecodeSuiteRow(method=method, library="snlp" if method.startswith("snlp") else "transformers",
                              treatment="eager", batch=1, prompts=4, tokens_per_s=tps, tokens_per_s_min=tps - 5,
                              tokens_per_s_max=tps + 5, seconds=[1.0] * 5, **kw)
    off = dict(matches_sequential=False, mismatched_rows=3, first_mismatch=7)
    rows = [row("snlp sequential", 100, matches_sequential=True), row("hf greedy", 50, **off),
            row("snlp speculative", 300, plan="6xF1-h0-K1", block=4, matches_sequential=True),
            row("hf prompt-lookup", 200, plan="N=3", **off), row("hf early-exit", 150, plan="E=2",
                                                                matches_sequential=True)]
    greedy, assisted = comparisons(rows)
    assert greedy.endswith("(hf greedy; its tokens differ from snlp sequential's on 3/4 prompts, from token 7)")
    assert assisted.endswith("(hf prompt-lookup, N=3; its tokens differ from snlp sequential's on 3/4 prompts, "
                             "from token 7)")
    rows[1].matches_sequential = True
    assert comparisons(rows)[0].endswith("(hf greedy)")


@pytest.mark.skipif(not HAVE_HF, reason="transformers is not installed")
@pytest.mark.parametrize("treatments, runs", [
    (("compiled",), set()),  # on the CPU: no transformers row can run compiled, and none eager is compared
    (("eager", "compiled"), {("hf greedy", "eager"), ("hf greedy (static)", "eager"), ("hf early-exit", "eager"),
                             ("hf prompt-lookup", "eager")}),
])
def test_transformers_rows_follow_the_treatments_or_say_why_not(treatments, runs):
    """--treatments compiled alone: transformers' eager-only rows (dynamic cache, assisted) have no eager snlp row
    to be compared with, so they are skipped with that reason instead of timed for nothing; a compiled static-cache
    row off CUDA is a skipped row saying why (transformers compiles it on CUDA only), not left out unsaid."""
    from snlp.bench.decode_suite import _hf_methods, hf_twin

    model = random_llama(quick=True)
    hf, why = hf_twin(model, torch.device("cpu"), torch.float32)
    assert why is None
    cfg = DecodeSuiteConfig(quick=True, device="cpu", batch_sizes=(1,), treatments=treatments).resolved()
    got = _hf_methods(hf, [[list(range(8))]], cfg, 1)
    ran = {(kw["method"], kw["treatment"]) for kw, fn in got if not isinstance(fn, str)}
    assert ran == runs
    skipped = {(kw["method"], kw["treatment"]): fn for kw, fn in got if isinstance(fn, str)}
    assert "CUDA only" in skipped[("hf greedy (static)", "compiled")]
    if "eager" not in treatments:
        assert all("eager only" in skipped[(m, "eager")]
                   for m in ("hf greedy", "hf early-exit", "hf prompt-lookup"))


def test_random_smollm2_has_smollm2s_shape_and_says_its_weights_are_random():
    from snlp.bench.decode_suite import load_model

    model, tok, label = load_model("random-smollm2", quick=False)
    c = model.config  # the converted GGUF's (tests/io/test_smollm2.py checks these against transformers' model)
    assert (c.n_layer, c.n_embd, c.n_head, c.n_kv_head, c.hidden_dim, c.vocab_size) == (30, 576, 9, 3, 1536, 49152)
    assert c.tie_embeddings and c.rope_base == 100000.0 and tok is None
    assert label.startswith("random weights (SmolLM2-135M's shape") and "speed only" in label


def test_an_ordered_plan_is_exact_only_after_its_own_exact_iterations():
    """A reversed correction order needs Plan.exact_iters() > C iterations: at K = C its row is not called exact (its
    tokens differed from sequential while the row said exact), at K = exact_iters it is, and its tokens agree."""
    from conftest import make_model

    from snlp.method.plan import Plan

    m = make_model(seed=1, n_layer=4)
    late = Plan.parse("3xF1-h0-K3-order:reversed", 4)
    done = late.with_(iters=late.exact_iters())
    res = run_decode_suite(DecodeSuiteConfig(quick=True, device="cpu", dtype="float64", batch_sizes=(1,), prompt_len=5,
                                             new_tokens=4, plans=(str(late), str(done)), blocks=(2,), rounds=1,
                                             warmup=0, transformers=False), model=m)
    rows = {r.plan: r for r in res.rows if r.method == "snlp snlp"}
    assert late.exact_iters() > late.chunks
    assert not rows[str(late)].exact and rows[str(done)].exact and rows[str(done)].matches_sequential


def test_the_table_marks_an_x_seq_cell_inside_the_sequential_rows_range_a_tie():
    """The table printed "snlp snlp 1.22x" from ranges 736-1438 vs sequential's 591-973 (overlapping) as a result,
    while the comparison lines under it call such a pair a tie: the cell now says (tie) by the same rule."""
    from snlp.bench.decode_suite import DecodeSuiteMeta, DecodeSuiteResult, DecodeSuiteRow, markdown

    def row(method, tps, lo, hi, batch=1, **kw):
        return DecodeSuiteRow(method=method, library="snlp" if method.startswith("snlp") else "transformers",
                              treatment="eager", batch=batch, tokens_per_s=tps, tokens_per_s_min=lo,
                              tokens_per_s_max=hi, speedup=tps / {1: 613.9, 4: 1868.5}[batch], seconds=[1.0] * 5, **kw)
    rows = [row("snlp sequential", 613.9, 591.0, 973.2), row("snlp snlp", 750.7, 736.0, 1437.8, plan="3xF1-h0-K1"),
            row("hf greedy", 363.7, 362.6, 466.3), row("snlp sequential", 1868.5, 1468.3, 1906.9, batch=4),
            row("hf greedy", 1395.8, 1364.8, 1838.6, batch=4)]
    meta = DecodeSuiteMeta(device="cpu", device_type="cpu", torch="t", cuda=None, transformers="x", dtype="float32",
                           date="d", command=None, platform="p", threads=1, model="m", n_layer=6, n_embd=64,
                           prompts="random ids", prompt_len=16, new_tokens=8)
    md = markdown(DecodeSuiteResult(config=DecodeSuiteConfig(quick=True, warmup=1, rounds=5), meta=meta, rows=rows,
                                    complete=True))
    cells = {(r.split(" | ")[0].strip("| "), r.split(" | ")[1]): r.split(" | ")[6]
             for r in md.splitlines() if r.startswith("| 1 ") or r.startswith("| 4 ")}
    assert cells[("1", "snlp sequential")] == "1.00x" and cells[("1", "snlp snlp")] == "1.22x (tie)"
    assert cells[("1", "hf greedy")] == "0.59x"  # 362.6-466.3 vs 591.0-973.2: apart
    assert cells[("4", "hf greedy")] == "0.75x (tie)"


def test_separated_ranges_over_too_few_rounds_are_a_tie():
    """Every one of 3 rounds of a row faster than every one of 3 of another happens by chance with p = 2 / C(6, 3) =
    0.1 (the rank-sum test's exact two-sided p), yet the table and the comparison lines called separated ranges a
    lead however few the rounds (the quick suite times 3): at 3 and 3 a tie, at 4 and 4 (p = 0.029) a lead."""
    from scipy.stats import mannwhitneyu

    from snlp.bench.decode_suite import DecodeSuiteRow, comparisons
    from snlp.bench.stats import separation_p

    def row(method, tps, lo, hi, n):
        return DecodeSuiteRow(method=method, library="snlp" if method.startswith("snlp") else "transformers",
                              treatment="eager", batch=1, tokens_per_s=tps, tokens_per_s_min=lo, tokens_per_s_max=hi,
                              seconds=[1.0] * n)
    for n, tie in ((2, True), (3, True), (4, False), (6, False)):
        a, b = [10.0 + i for i in range(n)], [20.0 + i for i in range(n)]  # separated
        assert separation_p(n, n) == pytest.approx(mannwhitneyu(a, b, alternative="two-sided", method="exact").pvalue)
        line = comparisons([row("snlp sequential", 25, 20, 20 + n - 1, n), row("hf greedy", 12, 10, 10 + n - 1, n)])[0]
        assert ("(a tie: the ranges are separated" in line) is tie, (n, line)
    assert separation_p(4, 3) > 0.05 > separation_p(5, 3)


def test_a_plan_that_cannot_batch_is_refused_before_the_model_loads(monkeypatch, capsys):
    """A DiagN / Newton plan at a batch size above 1 was refused only when that batch size's snlp / speculative rows
    ran, after the model loaded, the references were decoded and the batch-1 rows were timed: now in one line before
    the model loads. Batch size 1 alone (single prompts) takes it."""
    import snlp.bench.decode_suite as S

    def load_model(*a, **k):
        raise AssertionError("the model loaded before the plans were checked")
    monkeypatch.setattr(S, "load_model", load_model)
    for plan in ("3xF1-h0-K1-diag", "3xF1-h0-K1-newton"):
        assert main(["bench", "--suite", "decode", "--quick", "--device", "cpu", "--suite-plans", plan]) == 2
        err = capsys.readouterr().err.strip()
        assert "batched decoding supports the idn, none and hcn surrogates (decode suite: batch size 1 runs it)" in err
        assert "\n" not in err, err
    assert DecodeSuiteConfig(quick=True, device="cpu", plans=("3xF1-h0-K1-diag",), batch_sizes=(1,)).resolved()


@pytest.mark.parametrize("saved", [False, True])
def test_token_ids_outside_the_vocabulary_are_refused_before_the_model_loads(saved, tmp_path, monkeypatch):
    """A token-id prompt outside the model's vocabulary is refused from the random model's or the snlp
    checkpoint's config alone: no weight is read (load_model is never called)."""
    import snlp.bench.decode_suite as suite

    ckpt, V = None, 256  # --quick's random model
    if saved:
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=300, n_layer=2, n_head=2, n_embd=32, sequence_len=64))
        model.init_weights(seed=0)
        save_checkpoint(tmp_path / "ck", model)
        ckpt, V = str(tmp_path / "ck"), 300
    path = tmp_path / "p.json"
    path.write_text(json.dumps([list(range(8)), list(range(7)) + [V]]))

    def no_load(*a, **k):
        raise AssertionError("the model loaded before the prompts were checked")

    monkeypatch.setattr(suite, "load_model", no_load)
    with pytest.raises(ValueError, match=f"prompt 2 of .* has token id {V}, outside the model's vocabulary of {V}"):
        run_decode_suite(DecodeSuiteConfig(ckpt=ckpt, quick=True, device="cpu", batch_sizes=(2,), prompt_len=8,
                                           prompts_file=str(path), transformers=False))


def test_tokens_per_s_counts_the_tokens_a_call_generated_not_the_budget(monkeypatch):
    """A method that stops short of the budget (here 3 tokens of every prompt dropped) is credited with the tokens it
    generated: tok/s = its tokens / its wall time, not prompts x new tokens / wall time (and its "= seq" says no)."""
    import statistics

    from snlp.bench import decode_suite as ds

    made = ds._snlp_methods

    def with_a_short_row(*a, **k):
        out = made(*a, **k)
        kw, step, fn = out[0]  # snlp sequential, eager

        def short():
            res = fn()
            for r in res:
                r.tokens = r.tokens[:-3]
            return res
        return out + [(dict(kw, method="snlp short"), step, short)]
    monkeypatch.setattr(ds, "_snlp_methods", with_a_short_row)
    cfg = ds.DecodeSuiteConfig(quick=True, batch_sizes=(2,), transformers=False, methods=("snlp",), rounds=3,
                               plans=("6xF1-h0-K6",))
    rows = {r.method: r for r in ds.run_decode_suite(cfg).rows}
    short, full = rows["snlp short"], rows["snlp sequential"]
    assert short.matches_sequential is False and full.matches_sequential
    assert short.tokens_per_s == pytest.approx(statistics.median(2 * (8 - 3) / s for s in short.seconds))
    assert full.tokens_per_s == pytest.approx(statistics.median(2 * 8 / s for s in full.seconds))


def test_each_row_records_the_tokens_its_calls_generated_and_other_counts_are_flagged(monkeypatch):
    """The JSON holds what each row generated (per prompt in its last call, per timed call in all), so a reader can
    check the "same prompts, same token counts" its x seq stands on; a row whose calls generated other counts than
    the sequential reference (here 3 tokens of every prompt dropped) says so in the table and on a comparison line.
    Reference: the tokens every call of each row returned, recorded here as they come back."""
    from snlp.bench import decode_suite as ds

    made, returned = ds._snlp_methods, {}

    def recording(*a, **k):
        out = []
        for kw, step, fn in made(*a, **k) + [(dict(made(*a, **k)[0][0], method="snlp short"), None, None)]:
            if fn is None:  # snlp sequential, eager, with its last 3 tokens of every prompt dropped
                base = out[0][2]

                def fn(base=base):
                    res = base.__wrapped__()
                    for r in res:
                        r.tokens = r.tokens[:-3]
                    return res
                step = out[0][1]

            def call(fn=fn, m=kw["method"], t=kw["treatment"]):
                res = fn()
                returned.setdefault((m, t), []).append([len(r.tokens) for r in res])
                return res
            call.__wrapped__ = fn
            out.append((kw, step, call))
        return out
    monkeypatch.setattr(ds, "_snlp_methods", recording)
    cfg = ds.DecodeSuiteConfig(quick=True, batch_sizes=(2,), transformers=False, methods=("snlp", "speculative"),
                               rounds=3, warmup=1, plans=("6xF1-h0-K6",))
    res = ds.run_decode_suite(cfg)
    rows = {(r.method, r.treatment, r.block): r for r in res.rows if not r.skipped}
    assert len(rows) == 4  # sequential, snlp, speculative (block 4), short (the hf rows: skipped, --no-transformers)
    for (m, t, _), r in rows.items():
        calls = returned[(m, t)]
        assert len(calls) == 1 + cfg.rounds and r.generated == calls[-1]
        assert r.generated_per_call == [sum(c) for c in calls[1:]] and len(r.seconds) == cfg.rounds
        assert r.tokens_per_s == pytest.approx(statistics.median(n / s for n, s in zip(r.generated_per_call,
                                                                                       r.seconds)))
        assert r.same_counts == (calls == [[len(x) for x in res.reference[:2]]] * len(calls)), m
    short = rows[("snlp short", "eager", None)]
    assert short.same_counts is False and short.generated == [8 - 3, 8 - 3]
    assert all(r.same_counts for k, r in rows.items() if k[0] != "snlp short")
    line = next(ln for ln in markdown(res).splitlines() if "| snlp short |" in ln)
    assert "other token counts than snlp sequential's: its last call generated 10 where snlp sequential generated 16" \
        in line
    js = res.to_dict()["rows"]
    assert [(r["generated"], r["generated_per_call"], r["same_counts"]) for r in js] == \
        [(r.generated, r.generated_per_call, r.same_counts) for r in res.rows]
    # a comparison line flags a transformers row of other counts, as it flags one of other tokens
    from snlp.bench.decode_suite import DecodeSuiteRow, comparisons

    def row(method, tps, **kw):
        return DecodeSuiteRow(method=method, library="snlp" if method.startswith("snlp") else "transformers",
                              treatment="eager", batch=1, prompts=2, tokens_per_s=tps, tokens_per_s_min=tps - 5,
                              tokens_per_s_max=tps + 5, seconds=[1.0] * 5, matches_sequential=True, **kw)
    lines = comparisons([row("snlp sequential", 100, generated=[8, 8], same_counts=True),
                         row("hf greedy", 50, generated=[8, 4], same_counts=False)])
    assert lines[0].endswith("(hf greedy; other token counts than snlp sequential's: its last call generated 12 (its "
                             "tok/s is over other work))")


def test_a_row_of_other_counts_says_which_call_differed_and_never_contradicts_itself():
    """The note on a row whose calls generated other token counts names what differed: a short warm-up call with full
    timed calls is no tok/s "over other work"; a call that returned fewer prompts is set against the reference of
    every prompt of the call (not of as many as it returned); equal totals split otherwise are said per prompt; and a
    comparison line flags its snlp sequential side as it flags the transformers side. Reference: the counts of the
    calls fed in, summed here."""
    from snlp.bench.decode_suite import DecodeSuiteRow, comparisons, fold_counts, other_counts

    ref = [[1] * 8, [2] * 8]

    def row(method, calls, timed, tps=100.0):
        r = DecodeSuiteRow(method=method, library="snlp" if method.startswith("snlp") else "transformers",
                           treatment="eager", batch=2, prompts=2, tokens_per_s=tps, tokens_per_s_min=tps - 5,
                           tokens_per_s_max=tps + 5, seconds=[1.0] * len(timed), matches_sequential=True)
        for c in calls:
            fold_counts(r, [[0] * n for n in c], ref)
        r.generated_per_call = timed
        return r

    warm = row("hf greedy", [[5, 8], [8, 8], [8, 8]], [16, 16])  # only the warm-up call was short
    assert warm.same_counts is False
    text = other_counts(warm, ref)
    assert "over other work" not in text and "earlier call" in text and "16" in text
    timed = row("hf greedy", [[8, 8], [5, 8], [8, 8]], [13, 16])  # a timed call short, the last one full
    assert "its timed calls generated 13, 16 where snlp sequential generated 16" in other_counts(timed, ref)
    fewer = row("hf greedy", [[8]], [8])  # one prompt of the call's two came back
    assert "its last call generated 8 where snlp sequential generated 16" in other_counts(fewer, ref)
    split = row("hf greedy", [[9, 7]], [16])
    assert "its last call generated 16 (9, 7 per prompt) where snlp sequential generated 16 (8, 8)" in \
        other_counts(split, ref)
    seq = row("snlp sequential", [[8, 6]], [14], tps=200.0)
    line = comparisons([seq, row("hf greedy", [[8, 8]], [16], tps=50.0)], ref)[0]
    assert "snlp sequential's row: other token counts than snlp sequential's: its last call generated 14 where " \
        "snlp sequential generated 16" in line
    line = comparisons([row("snlp sequential", [[8, 8]], [16], tps=200.0), warm], ref)[0]
    assert "earlier call" in line and "over other work" not in line


def test_a_causal_plan_is_never_called_exact_and_its_speculative_rows_are():
    """A causal plan (the suffix's windows dropped) computes another function at any K: at K = C its snlp row is not
    called exact (exact_iters is None for it; the rule compared K with it), while its speculative row, verified by the
    model, is exact and matches sequential."""
    from conftest import make_model

    m = make_model(seed=1, n_layer=4)
    res = run_decode_suite(DecodeSuiteConfig(quick=True, device="cpu", dtype="float64", batch_sizes=(1,), prompt_len=5,
                                             new_tokens=4, plans=("3xF1-h0-K3-causal",), blocks=(2,), rounds=1,
                                             warmup=0, transformers=False), model=m)
    snlp = next(r for r in res.rows if r.method == "snlp snlp")
    spec = next(r for r in res.rows if r.method == "snlp speculative")
    assert snlp.plan == "3xF1-h0-K3-causal" and not snlp.exact
    assert spec.exact and spec.matches_sequential


def test_a_given_model_comes_back_as_it_was_given_and_a_config_asking_another_dtype_is_refused(tmp_path):
    """run_decode_suite cast a caller's model in place (`model.to(device, dtype).eval()`): an fp64 model in train mode
    came back fp32 and in eval mode. A given model is now timed as it is (its dtype and device are the run's, the other
    benchmarks' eval_mode restores every submodule's mode), with an adapted drafter built on it too; a config naming
    another dtype is refused before any work. Reference: a fresh copy of the model taken before the call."""
    import copy

    from conftest import make_model

    from snlp.io.drafter import save_drafter
    from snlp.method.drafter import make_drafter

    m = make_model(seed=2, n_layer=4).train()
    m.blocks[1].eval()  # a caller's mixed modes: a frozen block among trained ones
    d = make_drafter(m, "3xF1-h0-K1")
    save_drafter(tmp_path / "dr", d)
    before = copy.deepcopy(m)
    modes = [mod.training for mod in m.modules()]
    params = [p for p in m.parameters()]
    cfg = DecodeSuiteConfig(quick=True, batch_sizes=(1,), prompt_len=5, new_tokens=4, plans=("3xF1-h0-K1",),
                            blocks=(2,), rounds=1, warmup=0, transformers=False, drafter=str(tmp_path / "dr"))
    res = run_decode_suite(cfg, model=m)
    assert res.config.dtype == "float64" and res.config.device == "cpu"
    assert res.reference == [argmax_loop(before, p, 4) for p in res.prompts]  # it decoded the fp64 model
    assert "snlp speculative (drafter)" in {r.method for r in res.rows}
    assert [mod.training for mod in m.modules()] == modes
    assert all(a is b for a, b in zip(m.parameters(), params, strict=True))  # the caller's own tensors
    for (k, a), (k2, b) in zip(m.state_dict().items(), before.state_dict().items()):
        assert k == k2 and a.dtype == b.dtype == torch.float64 and a.device == b.device and torch.equal(a, b), k
    for bad, why in ((dict(dtype="float32"), "the given model is float64 on cpu and the config asks float32 on cpu"),
                     (dict(device="meta"), "the config asks float64 on meta")):
        with pytest.raises(ValueError, match=why):
            run_decode_suite(DecodeSuiteConfig(quick=True, batch_sizes=(1,), transformers=False, **bad), model=m)
        assert [mod.training for mod in m.modules()] == modes
        assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(m.state_dict().values(),
                                                                           before.state_dict().values()))


@pytest.mark.skipif(not HAVE_HF, reason="transformers is not installed")
def test_a_given_bf16_model_keeps_its_transformers_twin_of_its_own_weights():
    """A given model is timed in its own dtype, and hf_twin checked the twin's fp32 logits against that model's: a
    bf16 model's own rounding (max rel err ~8e-3 > TWIN_TOL) was reported as "not the same model" and every
    transformers row was skipped (a CUDA model met the CPU probe). The check now runs on an fp32 CPU copy of its
    weights (the upcast is exact) and the twin, cast to bf16, holds the model's own weights. References: the model's
    own tensors, and a deep copy taken before the call."""
    import copy

    from snlp.bench.decode_suite import hf_twin

    m = random_llama(True, 0).to(torch.bfloat16)
    before = copy.deepcopy(m)
    hf, note = hf_twin(m, torch.device("cpu"), torch.bfloat16)
    assert note is None, note
    assert hf.model.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(hf.model.embed_tokens.weight, m.wte.weight)  # its own weights, bit for bit
    assert torch.equal(hf.model.layers[0].mlp.down_proj.weight, m.blocks[0].mlp.c_proj.weight)
    res = run_decode_suite(DecodeSuiteConfig(quick=True, batch_sizes=(1,), prompt_len=5, new_tokens=4,
                                             plans=("2xF1-h0-K1",), blocks=(2,), rounds=1, warmup=0,
                                             methods=("snlp",)), model=m)
    assert res.meta.hf_note is None and res.config.dtype == "bfloat16"
    assert {"hf greedy", "hf greedy (static)"} <= {r.method for r in res.rows if r.library != "snlp"}
    for (k, a), b in zip(m.state_dict().items(), before.state_dict().values()):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b), k  # the caller's model: not cast, not changed


def test_suite_plans_cap_a_k_past_the_exact_count_with_the_warning_plans_give(tmp_path, capsys):
    """`--suite-plans 3xF1-h0-K9` ran K = 9 (the row said exact, the time was nine iterations) with no word, where
    `--plans` caps K at the exact count with a warning (snlp.method.plan.cli_plan). The suite now reads its plans as
    `--plans` does: the same warning, the capped plan run; a plan named twice (once capped) is refused, naming the
    suite's flag."""
    out = tmp_path / "d.json"
    says = ("plan 3xF1-h0-K9: K = 9 is beyond K = 3, from which the plan is exact (its output equals the model run "
            "sequentially); running 3xF1-h0-K3")
    with pytest.warns(UserWarning, match=re.escape(says)):
        assert main(["bench", "--suite", "decode", "--quick", "--device", "cpu", "--suite-plans", "3xF1-h0-K9",
                     "--batch-sizes", "1", "--suite-runs", "1", "--suite-warmup", "0", "--no-transformers",
                     "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["plan"] for r in rows if r["method"] in ("snlp snlp", "snlp speculative")} == {"3xF1-h0-K3"}
    with pytest.warns(UserWarning, match="running 3xF1-h0-K3"):
        assert main(["bench", "--suite", "decode", "--quick", "--device", "cpu",
                     "--suite-plans", "3xF1-h0-K3,3xF1-h0-K9"]) == 2
    assert "--suite-plans lists 3xF1-h0-K3 twice (3xF1-h0-K3 and 3xF1-h0-K9 are one plan)" in capsys.readouterr().err
