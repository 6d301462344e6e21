"""Seams of the distributed path, on CPU / gloo with spawned ranks (as in
tests/dist/test_distributed.py): the preheat init distributed equals the single-process solve; `snlp generate
--chat --mode speculative` compares like runs; `--distributed` honours or refuses --chat / --compile /
--repeats; every tensor a collective sees lives on the rank's device, a rank materialises only its own
layers from the checkpoint, and a collective that fails for a non-timeout reason says so."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import make_model, tokens, free_port as _free_port, init_gloo as _init, spawn_ranks as _spawn

from snlp.method import preheat
from snlp.decode.generate import sequential_generate, snlp_generate
from snlp.method.plan import Plan
from snlp.method.solver import solve

pytestmark = pytest.mark.usefixtures("one_thread")

PREHEAT_PLANS = ["4xF1-preheat-K1", "4xF1-preheat-K2-elk:0.25", "3xF2-preheat-K1", "5xF1-preheat-K0",
                 "4xF1-preheat-K2-order:reversed", "4xF1-preheat-K1-diag:fd"]
PREHEAT_MHC_PLANS = ["4xF1-preheat-K2-hcn"]
DECODE_PLAN = "4xF1-preheat-K1"
PROMPT = [1, 5, 9]





def _calibrated(mhc: bool = False):
    model = make_model(seed=1, hc_streams=2) if mhc else make_model(seed=0)
    return model, preheat.fit(model, preheat.CalibrateConfig(rank=4, batch=2, seq_len=8))


# ----------------------------------------------------------------------------- the preheat init
def _preheat_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from snlp.dist.layer_parallel import DistributedSNLP

    _init(rank, world, port)
    res = {"solve": {}, "errors": {}}
    for mhc, plans in ((False, PREHEAT_PLANS), (True, PREHEAT_MHC_PLANS)):
        for plan in plans:
            model, pre = _calibrated(mhc)
            r = DistributedSNLP(model, plan, preheat=pre).solve(tokens(model))  # the explicit calibration
            res["solve"][(mhc, plan)] = dict(states=r.states, hidden=r.hidden, logits=r.logits)
    model, pre = _calibrated()
    runner = DistributedSNLP(model, DECODE_PLAN, keep_layers=True, preheat=pre)
    res["attached"] = runner.solve(tokens(model)).states
    res["decode"] = runner.generate(PROMPT, "snlp", max_new_tokens=5).tokens
    for what, plan, kw in (("none", "4xF1-preheat-K1", {}), ("unused", "4xF1-h0-K1", {"preheat": pre})):
        try:
            DistributedSNLP(make_model(seed=0), plan, **kw)
            res["errors"][what] = ""
        except ValueError as e:
            res["errors"][what] = str(e)
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2])
def test_distributed_preheat_init_equals_single_process(world, tmp_path):
    _spawn(_preheat_worker, world, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    tol = dict(rtol=1e-10, atol=1e-10)  # fp64 models: the same ops regrouped
    for mhc, plans in ((False, PREHEAT_PLANS), (True, PREHEAT_MHC_PLANS)):
        for plan in plans:
            model, pre = _calibrated(mhc)
            with torch.no_grad():
                ref = solve(model, tokens(model), plan, keep_states=True, preheat=pre)
                h0 = solve(model, tokens(model), plan.replace("preheat", "h0"))
            parts = [rk["solve"][(mhc, plan)] for rk in ranks]
            states = torch.cat([p["states"] for p in parts])
            torch.testing.assert_close(states, ref.states[-1], **tol, msg=f"{plan} P={world}")
            torch.testing.assert_close(parts[-1]["hidden"], ref.hidden, **tol)
            torch.testing.assert_close(parts[-1]["logits"], model.head(ref.hidden), **tol)
            # the law has teeth: preheat and h0 differ here (the bug was a silent h0 solve)
            assert (parts[-1]["hidden"] - h0.hidden).abs().max() > 1e-3, plan
    model, pre = _calibrated()
    with torch.no_grad():
        ref = solve(model, tokens(model), DECODE_PLAN, keep_states=True, preheat=pre)
    torch.testing.assert_close(torch.cat([rk["attached"] for rk in ranks]), ref.states[-1], rtol=1e-10, atol=1e-10)
    dec = snlp_generate(model, PROMPT, DECODE_PLAN, 5, preheat=pre).tokens
    assert all(rk["decode"] == dec for rk in ranks)
    for rk in ranks:
        assert "pass its calibration (preheat=...)" in rk["errors"]["none"]
        assert "does not read it" in rk["errors"]["unused"]


# ----------------------------------------------------------------------------- --chat speculative baseline
CHAT_TEXT = ("First Citizen: Before we proceed any further, hear me speak. All: Speak, speak. "
             "First Citizen: You are all resolved rather to die than to famish? All: Resolved. resolved. ") * 20
CHAT_TEMPLATE = ("{% for m in messages %}<|user_start|>{{ m['content'] }}<|user_end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant_start|>{% endif %}")
CHAT_PROMPT = "First Citizen:"
CHAT_NEW = 12


@pytest.fixture(scope="module")
def chat_ckpt(tmp_path_factory):
    """A tiny checkpoint with a chat tokenizer (a converted model's kind: BOS/EOS tokens and a template) whose
    model says EOS after a few tokens: its EOS row of lm_head is twice the row of the 4th greedy token, so
    the greedy chat reply stops there (checked: stop == eos well before --max-new-tokens)."""
    from snlp.io.checkpoint import save_checkpoint
    from snlp.decode.generate import sequential_generate
    from snlp.io.tokenizer import BOS, MIN_VOCAB, Tokenizer

    bpe = Tokenizer.train([CHAT_TEXT], vocab_size=MIN_VOCAB + 40)
    tok = Tokenizer(bpe.tok, {"bos_token": BOS, "eos_token": "<|assistant_end|>", "chat_template": CHAT_TEMPLATE})
    model = make_model(seed=3, dtype=torch.float32, vocab_size=tok.vocab_size, n_layer=4, n_head=2, n_kv_head=1,
                       n_embd=32, sequence_len=128, scale=0.15)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": CHAT_PROMPT}]))
    free = sequential_generate(model, prompt, CHAT_NEW).tokens
    with torch.no_grad():
        model.lm_head.weight[tok.eos_id] = 2 * model.lm_head.weight[free[3]]
    stopped = sequential_generate(model, prompt, CHAT_NEW, eos_id=tok.eos_id)
    assert stopped.stop == "eos" and len(stopped.tokens) < CHAT_NEW // 2, stopped  # the precondition of the tests
    return save_checkpoint(tmp_path_factory.mktemp("chat") / "tiny-chat", model, tokenizer=tok), stopped.tokens


def test_chat_speculative_baseline_stops_at_the_same_eos(chat_ckpt, tmp_path):
    import json

    from snlp.apps.cli import main

    ckpt, ref = chat_ckpt
    out = tmp_path / "spec.json"
    assert main(["generate", str(ckpt), "--chat", "--prompt", CHAT_PROMPT, "--mode", "speculative", "--plan",
                 "2xF2-h0-K1", "--block", "3", "--repeats", "1", "--max-new-tokens", str(CHAT_NEW), "--quiet",
                 "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["tokens"] == ref and rec["stop"] == "eos"
    # the baseline ran the same (EOS-stopped) decode: its tokens equal the reported run's
    assert rec["matches_sequential"] and rec["report"]["matches_sequential"]


# ----------------------------------------------------------------------------- --distributed and its flags
def test_distributed_generate_honours_chat_and_repeats(chat_ckpt, tmp_path):
    import json
    import subprocess
    import sys

    ckpt, ref = chat_ckpt
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
           "-m", "snlp", "generate", str(ckpt), "--distributed", "--chat", "--prompt", CHAT_PROMPT, "--mode",
           "speculative", "--plan", "2xF1-h0-K1", "--block", "3", "--repeats", "2", "--max-new-tokens", str(CHAT_NEW),
           "--quiet", "--json", str(tmp_path / "dist.json")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr[-3000:]
    rec = json.loads((tmp_path / "dist.json").read_text())
    assert rec["tokens"] == ref and rec["stop"] == "eos"  # the chat prompt, stopped at the chat EOS
    # memory_per_rank counts the KV window the decodes held (prompt + --max-new-tokens positions of every layer,
    # split over the ranks); it said kv_bytes 0
    from snlp.io.checkpoint import load

    model, tok = load(ckpt)
    cfg, n = model.config, len(tok.chat_prompt([{"role": "user", "content": CHAT_PROMPT}])) + CHAT_NEW
    kv = [m["kv_bytes"] for m in rec["memory_per_rank"]]
    assert sum(kv) == 2 * cfg.n_layer * cfg.n_kv_head * n * cfg.head_dim * 4 and min(kv) > 0  # fp32
    assert rec["matches_sequential"] and rec["sequential_tokens"] == ref
    assert rec["repeats"] == 2 and rec["measured_speedup"] > 0 and "timed over 2 runs of each" in out.stdout
    # 2 paired runs cannot resolve the ratio, and the line says so instead of printing it as a result
    assert rec["speedup_verdict"] == "tie" and "2 paired runs cannot resolve a lead" in out.stdout
    # each rate is its own side's median: the paired ratios' range, which holds their ratio too, stands beside them
    lo, hi = rec["speedup_range"]
    assert f"which ran {lo:.2f}-{hi:.2f}x" in out.stdout and "(each side's own median)" in out.stdout


def test_distributed_plain_prompt_stops_at_the_models_eos_as_single_process_generate(chat_ckpt, tmp_path):
    """`snlp generate --distributed --prompt TEXT` (no --chat) stopped only at --eos-id: now, as the single-process
    command, at the converted tokenizer's EOS (where transformers' generate() of its export stops), and the record
    says which ids and whence. The prompt is the chat turn written out as text, which the tokenizer reads as the chat
    prompt's ids, so the reference is the fixture's EOS-stopped greedy reply."""
    import json
    import subprocess
    import sys

    from snlp.io.checkpoint import load

    ckpt, ref = chat_ckpt
    _, tok = load(ckpt)
    text = tok.apply_chat_template([{"role": "user", "content": CHAT_PROMPT}])
    assert tok.prompt_ids(text) == tok.chat_prompt([{"role": "user", "content": CHAT_PROMPT}])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", f"--master_port={_free_port()}",
           "-m", "snlp", "generate", str(ckpt), "--distributed", "--prompt", text, "--mode", "snlp", "--plan",
           "4xF1-h0-K4", "--max-new-tokens", str(CHAT_NEW), "--quiet", "--json", str(tmp_path / "dist.json")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr[-3000:]
    rec = json.loads((tmp_path / "dist.json").read_text())
    assert rec["tokens"] == ref and rec["stop"] == "eos"
    assert (rec["stop_ids"], rec["stop_ids_source"]) == ([tok.eos_id], "tokenizer")
    assert f"stop: eos, stop ids {tok.eos_id} (the tokenizer's EOS" in out.stdout


def test_distributed_generate_streams_what_single_process_generate_streams(chat_ckpt, capsys):
    """rank 0 streamed a chat's end-of-turn stop as text (<|assistant_end|>) and the reply on the prompt's line, where
    `snlp generate` puts the reply on a line of its own and hides the stop (the summary line names it): the streamed
    text is now the single-process command's, the summary line aside."""
    import subprocess
    import sys

    from snlp.apps.cli import main

    ckpt, ref = chat_ckpt
    args = ["generate", str(ckpt), "--chat", "--prompt", CHAT_PROMPT, "--mode", "snlp", "--plan", "2xF1-h0-K1",
            "--max-new-tokens", str(CHAT_NEW), "--device", "cpu"]
    assert main(args) == 0
    single = capsys.readouterr().out.splitlines()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", f"--master_port={_free_port()}",
           "-m", "snlp", *args, "--distributed"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr[-3000:]
    dist = out.stdout.splitlines()
    assert single[-1].startswith("[snlp ") and dist[-1].startswith("[distributed snlp ")
    assert dist[:-1] == single[:-1] and single[0] == CHAT_PROMPT


def test_distributed_generate_says_what_single_process_generate_says(chat_ckpt):
    """--mode speculative --no-baseline printed no block, alpha or tokens/round (snlp generate's line has them
    whether it times a baseline or not), and the notes on an empty prompt and on a decode that may run past the
    trained context were never said."""
    import subprocess
    import sys

    from snlp.io.checkpoint import load_config

    ckpt, _ = chat_ckpt
    n = load_config(ckpt).sequence_len
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", f"--master_port={_free_port()}",
           "-m", "snlp", "generate", str(ckpt), "--distributed", "--prompt", "", "--mode", "speculative", "--plan",
           "2xF1-h0-K1", "--block", "3", "--no-baseline", "--max-new-tokens", str(n), "--quiet"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr[-3000:]
    assert ", B=3, alpha=" in out.stdout and "tokens/round=" in out.stdout
    assert " over 1 rank] " in out.stdout  # was "over 1 ranks"
    assert "the prompt is empty" in out.stderr and "past the model's trained context" in out.stderr


def test_distributed_generate_applies_the_repetition_penalty(chat_ckpt, tmp_path):
    """`snlp generate --distributed --repetition-penalty P` refused the flag (the layer-parallel decoder applied no
    penalty); now the speculative run and its pipelined sequential baseline both apply it: the tokens are the
    single-process sequential decoder's with the same penalty, the baseline's too."""
    import json
    import subprocess
    import sys

    from snlp.io.checkpoint import load

    ckpt, ref = chat_ckpt
    model, tok = load(ckpt)
    prompt = tok.chat_prompt([{"role": "user", "content": CHAT_PROMPT}])
    want = sequential_generate(model, prompt, CHAT_NEW, eos_id=list(tok.chat_stop_ids), repetition_penalty=0.8).tokens
    assert want != ref  # the penalty acts on this reply
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
           "-m", "snlp", "generate", str(ckpt), "--distributed", "--chat", "--prompt", CHAT_PROMPT, "--mode",
           "speculative", "--plan", "2xF1-h0-K1", "--block", "3", "--repeats", "1", "--max-new-tokens", str(CHAT_NEW),
           "--repetition-penalty", "0.8", "--quiet", "--json", str(tmp_path / "dist.json")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr[-3000:]
    rec = json.loads((tmp_path / "dist.json").read_text())
    assert rec["tokens"] == want and rec["sequential_tokens"] == want and rec["matches_sequential"]
    # the record names the penalty that ran and whence, as single-process `snlp generate --json` does
    assert (rec["sampling"]["repetition_penalty"], rec["sampling"]["repetition_penalty_source"]) == (0.8, "flag")
    assert "repetition_penalty" not in rec and "repetition_penalty_source" not in rec  # once, in "sampling"


@pytest.fixture(scope="module")
def penalised_ckpt(tmp_path_factory):
    """A tiny checkpoint whose (converted-model kind of) tokenizer carries a generation_config with
    repetition_penalty 1.3, as `snlp convert` keeps a transformers model's."""
    from snlp.io.checkpoint import save_checkpoint
    from snlp.io.tokenizer import BOS, MIN_VOCAB, Tokenizer

    bpe = Tokenizer.train([CHAT_TEXT], vocab_size=MIN_VOCAB + 40)
    tok = Tokenizer(bpe.tok, {"bos_token": BOS, "eos_token": "<|assistant_end|>", "chat_template": CHAT_TEMPLATE,
                              "generation_config": {"repetition_penalty": 1.3}})
    model = make_model(seed=3, dtype=torch.float32, vocab_size=tok.vocab_size, n_layer=4, n_head=2, n_kv_head=1,
                       n_embd=32, sequence_len=64, scale=0.15)
    return save_checkpoint(tmp_path_factory.mktemp("pen") / "tiny-pen", model, tokenizer=tok)


def test_distributed_bench_decode_applies_the_penalty_it_names(penalised_ckpt, tmp_path):
    """`snlp bench --distributed --decode --ckpt C` with a generation_config repetition_penalty decoded without it
    and said nothing (and refused --repetition-penalty): now, as the single-process `snlp bench --decode`, every
    decode row runs with the config's value, or the flag's, and the header line and each row's JSON say which value
    and whence. The printed rank count reads "1 rank" (was "1 ranks")."""
    import json
    import subprocess
    import sys

    def bench(*flags):
        out = tmp_path / "b.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", f"--master_port={_free_port()}",
               "-m", "snlp", "bench", "--distributed", "--decode", "--ckpt", str(penalised_ckpt), "--plans",
               "2xF1-h0-K1", "--tokens", "4", "--prompt-len", "4", "--new-tokens", "4", "--blocks", "2", "--runs",
               "1", "--warmup", "0", "--json", str(out), *flags]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                             env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()})
        assert run.returncode == 0, run.stderr[-3000:]
        rows = [r for r in json.loads(out.read_text()) if "mode" in r]
        assert len(rows) == 3  # sequential, snlp, speculative B=2
        return run.stdout, rows

    text, rows = bench()
    assert {(r["repetition_penalty"], r["repetition_penalty_source"]) for r in rows} == {(1.3, "generation_config")}
    assert "[1 rank] decode rows: repetition penalty 1.3 (the --ckpt's generation_config)" in text
    assert "1 ranks" not in text and "[1 rank] 2xF1-h0-K1 decode speculative B=2" in text
    text, rows = bench("--repetition-penalty", "1.1")
    assert {(r["repetition_penalty"], r["repetition_penalty_source"]) for r in rows} == {(1.1, "flag")}
    assert "repetition penalty 1.1 (--repetition-penalty)" in text


def _bench_penalty_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from snlp.dist.layer_parallel import DistributedSNLP, distributed_benchmark

    _init(rank, world, port)
    seen = []
    real = DistributedSNLP.generate

    def spy(self, *a, **k):
        seen.append(k.get("repetition_penalty", 1.0))
        return real(self, *a, **k)

    DistributedSNLP.generate = spy
    recs = distributed_benchmark(lambda: make_model(seed=2, vocab_size=13), [Plan.parse("4xF1-h0-K1")], 4, 1, 0, 1,
                                 0, decode=True, prompt_len=3, new_tokens=5, blocks=(2,), repetition_penalty=1.3)
    torch.save({"seen": seen, "recs": [r for r in recs if r["what"] == "decode"]}, os.path.join(out, f"b{rank}.pt"))
    dist.destroy_process_group()


def test_distributed_benchmark_decodes_every_mode_with_the_penalty(tmp_path):
    """distributed_benchmark(repetition_penalty=p): every decode call of every mode applies p (it took no penalty:
    its decodes ran unpenalised), and each decode record carries p."""
    _spawn(_bench_penalty_worker, 1, str(tmp_path))
    got = torch.load(tmp_path / "b0.pt")
    assert got["seen"] and set(got["seen"]) == {1.3}
    assert len(got["recs"]) == 3 and all(r["repetition_penalty"] == 1.3 for r in got["recs"])


@pytest.mark.parametrize("argv, msg", [
    (["generate", "{ckpt}", "--distributed", "--mode", "snlp", "--plan", "2xF1-h0-K1", "--repetition-penalty", "0"],
     "--repetition-penalty must be a finite number > 0"),
    (["generate", "{ckpt}", "--distributed", "--mode", "snlp", "--plan", "2xF1-h0-K1", "--compile"],
     "--compile is not supported with --distributed"),
    (["generate", "{ckpt}", "--distributed", "--mode", "speculative", "--plan", "2xF1-h0-K1", "--repeats", "0"],
     "--repeats must be >= 1"),
    (["generate", "{ckpt}", "--distributed", "--mode", "snlp", "--plan", "2xF1-h0-K1-tol:-1"],
     "tol must be a positive number, got '-1'"),
    (["generate", "{ckpt}", "--distributed", "--mode", "snlp", "--plan", "2xF1-h0-K1", "--max-new-tokens", "-1"],
     "--max-new-tokens -1 generates nothing"),
    (["generate", "{ckpt}", "--distributed", "--mode", "sequential", "--plan", "2xF1-h0-K1", "--temperature", "-1"],
     "temperature must be a finite number >= 0"),
    (["generate", "{ckpt}", "--distributed", "--mode", "snlp", "--plan", "2xF1-h0-K1", "--eos-id", "-1"],
     "--eos-id must be a token id >= 0 (got -1)"),
    (["bench", "--distributed", "--depth", "4", "--compile"], "--compile is not supported with --distributed"),
    (["bench", "--distributed", "--depth", "4", "--tokens", "1,4"], "--distributed takes one --tokens value"),
    # refused before any process group (no torchrun here: a later refusal would be the missing-environment one)
    (["generate", "{ckpt}", "--distributed", "--mode", "snlp", "--plan", "2xF1-h0-K1", "--dist-timeout", "0"],
     "--dist-timeout must be a finite number of seconds > 0 (got 0)"),
    (["bench", "--distributed", "--depth", "4", "--plans", "4xF1-h0-K1", "--dist-timeout", "-1"],
     "--dist-timeout must be a finite number of seconds > 0 (got -1)"),
    (["generate", "{ckpt}", "--distributed", "--mode", "snlp", "--plan", "2xF1-h0-K1-newton"],
     "the newton surrogate is not available distributed"),
    (["bench", "--distributed", "--depth", "4", "--plans", "4xF1-h0-K1,4xF1-h0-K1-newton"],
     "the newton surrogate is not available distributed"),
    (["bench", "--distributed", "--depth", "4", "--plans", "8xF1-h0-K1"],
     "plan 8xF1-h0-K1 needs a suffix of N = 8x1 = 8 layers but the model has only L = 4"),
    # what every rank would refuse once the model is open, refused from the checkpoint's config before the group
    (["generate", "{ckpt}", "--distributed", "--mode", "snlp", "--plan", "2xF1-h0-K1", "--eos-id", "5000"],
     "eos_id 5000 holds ids outside the model's vocabulary"),
    (["generate", "{ckpt}", "--distributed", "--mode", "snlp", "--plan", "2xF1-h0-K1-hcn"],
     "the hcn surrogate needs an mHC model"),
    (["generate", "{ckpt}", "--distributed", "--mode", "speculative", "--plan", "2xF1-preheat-K1"],
     "starts from the preheat init but checkpoint"),
    (["bench", "--distributed", "--depth", "4", "--plans", "4xF1-preheat-K1"],
     "random weights have no calibration"),
    (["bench", "--distributed", "--depth", "4", "--plans", "4xF1-h0-K1-hcn"], "the hcn surrogate needs an mHC model"),
    # the single-process bench's counts (--runs 0 failed every rank on the median of no runs; --blocks 0 ran B = 1)
    (["bench", "--distributed", "--depth", "4", "--runs", "0"], "--tokens, --batch and --runs must be >= 1"),
    (["bench", "--distributed", "--depth", "4", "--batch", "0"], "--tokens, --batch and --runs must be >= 1"),
    (["bench", "--distributed", "--depth", "4", "--warmup", "-1"], "--warmup >= 0"),
    (["bench", "--distributed", "--depth", "4", "--threads", "0"], "--threads must be >= 1"),
    (["bench", "--distributed", "--depth", "4", "--decode", "--blocks", "0"], "every block size must be >= 1"),
    (["bench", "--distributed", "--depth", "4", "--decode", "--blocks", "2,x"], "--blocks must be comma-separated"),
    (["bench", "--distributed", "--depth", "4", "--decode", "--new-tokens", "0"], "--new-tokens and every block"),
    (["bench", "--distributed", "--depth", "4", "--decode", "--prompt-len", "0"], "--prompt-len, --new-tokens"),
    # flags the run does not read would change nothing
    (["bench", "--distributed", "--depth", "4", "--link-gbps", "5"],
     "--link-gbps is not read by `snlp bench --distributed` without --decode"),
    (["bench", "--distributed", "--depth", "4", "--decode", "--repetition-penalty", "0"],
     "--repetition-penalty must be a finite number > 0"),
    (["bench", "--distributed", "--depth", "4", "--repetition-penalty", "1.2"],
     "--repetition-penalty is not read by `snlp bench --distributed` without --decode"),
    (["bench", "--distributed", "--depth", "4", "--blocks", "2"],
     "--blocks is not read by `snlp bench --distributed` without --decode"),
    (["bench", "--suite", "paper", "--distributed"], "--distributed is not read by `snlp bench --suite paper`"),
    # a plan listed twice: every rank refused it after the process group started
    (["bench", "--distributed", "--depth", "4", "--plans", "4xF1-h0-K1,4xF1-K1"],
     "--plans lists 4xF1-h0-K1 twice (4xF1-h0-K1 and 4xF1-K1 are one plan)"),
    (["bench", "--distributed", "--ckpt", "{ckpt}", "--plans", "2xF1-h0-K1,2xF1-K1"], "--plans lists 2xF1-h0-K1 twice"),
    # a diag:fd eps below the dtype's FD step floor: each rank's DistributedSNLP refused it at that plan's turn, after
    # the process group started and the plans before it were timed
    (["bench", "--distributed", "--depth", "4", "--plans", "4xF1-h0-K1,4xF1-h0-K1-diag:fd-eps:1e-5"],
     "eps:1e-05 is below the smallest FD step of the compute dtype float32"),
    (["bench", "--distributed", "--ckpt", "{ckpt}", "--plans", "2xF1-h0-K1,2xF1-h0-K1-diag:fd-eps:1e-5"],
     "eps:1e-05 is below the smallest FD step of the compute dtype float32"),
    (["bench", "--simulate-devices", "2", "--ckpt", "{ckpt}", "--roofline-gbytes", "100", "--plans", "2xF1-h0-K1"],
     "--ckpt is not read by `snlp bench --simulate-devices"),
    (["bench", "--simulate-devices", "2", "--distributed", "--shape", "3B", "--roofline-gbytes", "100"],
     "--distributed is not read by `snlp bench --simulate-devices"),
    (["bench", "--simulate-devices", "2", "--hc-streams", "2", "--roofline-gbytes", "100"],
     "--hc-streams is not read by `snlp bench --simulate-devices"),
    (["bench", "--simulate-devices", "2", "--shape", "3B", "--depth", "8", "--roofline-gbytes", "100"],
     "--shape 3B is a whole shape; --depth would change nothing"),
    (["bench", "--simulate-devices", "2", "--shape", "3B", "--roofline-gbytes", "100", "--tokens", "1,4"],
     "--simulate-devices takes one --tokens value (got 1,4)"),
    # counts and roofline inputs the cost model priced silently (a batch of 0 or -2, a negative bandwidth or floor,
    # an efficiency above 1), divided by (efficiency 0) or failed on after measuring (--runs 0)
    (["bench", "--simulate-devices", "2", "--shape", "3B", "--roofline-gbytes", "100", "--batch", "0"],
     "--batch must be >= 1 (got 0)"),
    (["bench", "--simulate-devices", "2", "--shape", "3B", "--roofline-gbytes", "100", "--batch", "-2"],
     "--batch must be >= 1 (got -2)"),
    (["bench", "--simulate-devices", "2", "--shape", "3B", "--roofline-gbytes", "-100"],
     "--roofline-gbytes must be a finite memory bandwidth > 0 GB/s"),
    (["bench", "--simulate-devices", "2", "--shape", "3B", "--roofline-gbytes", "100", "--roofline-efficiency", "0"],
     "--roofline-efficiency is the fraction of --roofline-gbytes a step reaches: it must lie in (0, 1]"),
    (["bench", "--simulate-devices", "2", "--shape", "3B", "--roofline-gbytes", "100", "--roofline-efficiency",
      "1.5"], "it must lie in (0, 1] (got 1.5)"),
    (["bench", "--simulate-devices", "2", "--shape", "3B", "--roofline-gbytes", "100", "--op-floor-us", "-5"],
     "--op-floor-us must be a finite number of microseconds >= 0"),
    (["bench", "--simulate-devices", "2", "--depth", "4", "--runs", "0"], "--runs must be >= 1 and --warmup >= 0"),
    (["bench", "--simulate-devices", "2", "--depth", "4", "--warmup", "-1"], "--runs must be >= 1 and --warmup >= 0"),
])
def test_distributed_refuses_what_it_cannot_honour(chat_ckpt, argv, msg, capsys, monkeypatch):
    """Refused before any process group is set up (no torchrun environment: a refusal that came later would be the
    missing-environment one)."""
    from snlp.apps.cli import main

    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)

    assert main([a.format(ckpt=chat_ckpt[0]) for a in argv]) == 2
    assert msg in capsys.readouterr().err


def test_generate_distributed_refuses_an_fd_eps_below_the_floor_before_launching_the_ranks(chat_ckpt, capsys,
                                                                                           monkeypatch):
    """generate --distributed passed a diag:fd eps below the FD step floor of the ranks' dtype (fp32: 3.45e-4) on to
    the process group: each rank's DistributedSNLP refused it there, after the group had started. Refused in the
    parent, before the launcher is called (a launcher that records its calls stands in for the process group); the
    floor's own value is launched."""
    import snlp.apps.dist as D
    from snlp.apps.cli import main

    launched = []
    monkeypatch.setattr(D, "_run_ranked", lambda command, args, body: launched.append(args.plan) or 0)
    base = ["generate", str(chat_ckpt[0]), "--distributed", "--mode", "snlp", "--device", "cpu", "--plan"]
    assert main(base + ["2xF1-h0-K1-diag-eps:1e-5"]) == 2
    assert "eps:1e-05 is below the smallest FD step of the compute dtype float32" in capsys.readouterr().err
    assert launched == []
    assert main(base + ["2xF1-h0-K1-diag-eps:0.000346"]) == 0 and launched == ["2xF1-h0-K1-diag-eps:0.000346"]


@pytest.mark.parametrize("argv", [
    ["generate", "{ckpt}", "--distributed", "--mode", "snlp", "--plan", "2xF1-h0-K1"],
    ["bench", "--distributed", "--depth", "4", "--plans", "4xF1-h0-K1,2xF1-h0-K1"],
])
def test_distributed_refuses_fewer_chunks_than_ranks_before_the_process_group(chat_ckpt, argv, capsys, monkeypatch):
    """torchrun's WORLD_SIZE is known before the group starts: a plan with C < P chunks is refused there (the rest
    of torchrun's environment is unset, so a later refusal would be the missing-environment one instead)."""
    from snlp.apps.cli import main

    for k in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert main([a.format(ckpt=chat_ckpt[0]) for a in argv]) == 2
    assert "a plan with C = 2 chunks cannot be spread over 3 ranks" in capsys.readouterr().err


def test_distributed_refuses_a_smear_checkpoint_before_the_process_group(tmp_path, capsys, monkeypatch):
    """Every rank would refuse nanochat's smear in DistributedSNLP after opening the checkpoint; the CLI refuses it
    once, from the config, before the group (unset torchrun environment: otherwise that refusal would come first)."""
    from snlp.apps.cli import main
    from snlp.io.checkpoint import save_checkpoint

    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    ckpt = save_checkpoint(tmp_path / "smear", make_model(seed=0, n_embd=32, smear=True, dtype=torch.float32))
    assert main(["generate", str(ckpt), "--distributed", "--mode", "snlp", "--plan", "2xF1-h0-K1"]) == 2
    assert "distributed SNLP does not carry nanochat's smear / backout" in capsys.readouterr().err
    assert main(["bench", "--distributed", "--ckpt", str(ckpt), "--plans", "2xF1-h0-K1"]) == 2
    assert "distributed SNLP does not carry nanochat's smear / backout" in capsys.readouterr().err


@pytest.mark.parametrize("what, msg", [("transformers", "is a transformers model directory"),
                                       ("no-weights", "has no model.safetensors"), ("no-tokenizer", "has no tokenizer")])
@pytest.mark.parametrize("command", ["generate", "bench"])
def test_distributed_refuses_what_no_rank_can_load_before_the_process_group(what, msg, command, tmp_path, capsys,
                                                                           monkeypatch):
    """A folder every rank's RankCheckpoint refuses (a transformers export, a checkpoint missing its weights) or
    generate cannot decode text with (no tokenizer) was refused by every rank after the group started; now once,
    before it (unset torchrun environment: a later refusal would be the missing-environment one)."""
    import json

    from snlp.apps.cli import main
    from snlp.io.checkpoint import save_checkpoint

    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    if what == "no-tokenizer" and command == "bench":
        pytest.skip("bench reads no text")
    ckpt = save_checkpoint(tmp_path / "c", make_model(seed=0, n_embd=16, n_layer=4, dtype=torch.float32))
    if what == "transformers":
        (ckpt / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    elif what == "no-weights":
        (ckpt / "model.safetensors").unlink()
    argv = (["generate", str(ckpt), "--distributed", "--mode", "snlp", "--plan", "2xF1-h0-K1"] if command == "generate"
            else ["bench", "--distributed", "--ckpt", str(ckpt), "--plans", "2xF1-h0-K1"])
    assert main(argv) == 2
    assert msg in capsys.readouterr().err


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan"), float("inf")])
def test_init_distributed_refuses_a_timeout_c10d_cannot_keep(timeout, monkeypatch):
    """0 or a negative timeout is an already expired deadline in c10d (every rank's rendezvous fails with a C++
    traceback), inf overflows timedelta: a ValueError before the environment is read or a group starts."""
    import torch.distributed as dist

    from snlp.dist.layer_parallel import init_distributed

    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(ValueError, match="timeout must be a finite number of seconds > 0"):
        init_distributed(timeout)
    assert not dist.is_initialized()


# ----------------------------------------------------------------------------- devices, rank-local load, errors
COLLECTIVES = ("all_gather", "broadcast", "send", "recv", "isend", "irecv", "all_reduce")


class _Done:
    def wait(self):
        return True


def _record_collectives(log: list, call_real: bool) -> None:
    """Wrap the torch.distributed calls snlp.distributed makes so that every tensor passed is recorded as
    (op, device); with call_real=False (meta-device ranks: gloo has no data to move) the op is not run."""
    import torch.distributed as dist

    def wrap(name):
        real = getattr(dist, name)

        def f(*args, **kw):
            ts = [a for a in args if isinstance(a, torch.Tensor)]
            ts += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
            log.extend((name, str(t.device)) for t in ts)
            if call_real:
                return real(*args, **kw)
            return _Done() if name in ("isend", "irecv") else None
        return f

    for name in COLLECTIVES:
        setattr(dist, name, wrap(name))


def _devices_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from snlp.dist.layer_parallel import DistributedSNLP, check_consistent

    _init(rank, world, port)
    cpu_log, meta_log, meta_errors = [], [], []
    _record_collectives(cpu_log, call_real=True)  # 1. CPU ranks, every path, the real gloo ops
    model = make_model(seed=0)
    runner = DistributedSNLP(model, "4xF1-h0-K2-tol:1e-9", keep_layers=True)
    runner.solve(tokens(model))
    for mode in ("snlp", "speculative", "sequential"):
        runner.generate(PROMPT, mode, max_new_tokens=4, block=2, temperature=0.7, seed=1)
    runner.generate(PROMPT, "snlp", max_new_tokens=2, temperature=0.7, seed=None)  # crashed: manual_seed(None)
    DistributedSNLP(make_model(seed=0), "4xF1-h0-K1-diag:fd").solve(tokens(model))
    DistributedSNLP(make_model(seed=1, hc_streams=2), "4xF1-h0-K1-hcn").solve(tokens(model))
    # 2. meta-device ranks: shapes only, so every tensor made for a collective shows where it was made; a host
    # read of a meta value (the broadcast tol update, finiteness flag, tokens) ends each path, after its op
    _record_collectives(meta_log, call_real=False)
    meta = make_model(seed=0).to("meta")
    meta.check_tokens = lambda idx: None  # meta ids hold no values to range-check
    idx = tokens(make_model(seed=0)).to("meta")
    for plan in ("4xF1-h0-K2", "4xF1-fwd-K2-tol:1e-3", "4xF1-h0-K1"):
        r = DistributedSNLP(meta, plan, keep_layers=True, check=False)
        for call in (lambda: r.solve(idx, check_finite=plan == "4xF1-h0-K1"), lambda: r.pipeline_forward(idx),
                     lambda: r._tokens_from_last([1, 2] if r.rank == r.last else None, 2)):
            try:
                call()
            except RuntimeError as e:  # "Tensor.item() cannot be called on meta tensors" and the like
                meta_errors.append(str(e)[:80])
        meta = make_model(seed=0).to("meta")
        meta.check_tokens = lambda idx: None
    try:
        check_consistent(meta, r.plan, digest=bytes(32))
    except RuntimeError as e:
        meta_errors.append(str(e)[:80])
    torch.save(dict(cpu=cpu_log, meta=meta_log, errors=meta_errors), os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_every_collective_tensor_lives_on_the_rank_device(tmp_path):
    _spawn(_devices_worker, 2, str(tmp_path))
    recs = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    ops = {op for rec in recs for op, _ in rec["cpu"]}
    assert {"all_gather", "broadcast", "recv", "send", "isend"} <= ops, ops  # every op the module uses was seen
    for r, rec in enumerate(recs):
        assert {dev for _, dev in rec["cpu"]} == {"cpu"}
        meta_ops = {op for op, _ in rec["meta"]}
        assert {"all_gather", "broadcast"} <= meta_ops, meta_ops
        wrong = [(op, dev) for op, dev in rec["meta"] if dev != "meta"]
        assert not wrong, f"rank {r}: collectives given tensors off the rank's device: {wrong}"


class _RecordingFile:
    """A safetensors handle that records which tensors are read (get_shape reads only the header)."""

    def __init__(self, f, log: list):
        self.f, self.log = f, log

    def keys(self):
        return self.f.keys()

    def get_tensor(self, name):
        self.log.append(name)
        return self.f.get_tensor(name)

    def get_slice(self, name):
        f, log = self.f.get_slice(name), self.log

        class Slice:
            def get_shape(self):
                return f.get_shape()

            def __getitem__(self, i):
                log.append(name)
                return f[i]
        return Slice()


LOAD_PLAN = "4xF1-preheat-K2"  # 6 layers: prefix 0-1 and chunks 2-5; rank 0: layers 0-3, rank 1: layers 4-5


def _load_worker(rank: int, world: int, port: int, ckpt: str, out: str, other: str) -> None:
    import torch.distributed as dist

    import snlp.dist.load as distload
    from snlp.dist.layer_parallel import CollectiveError, DistributedSNLP, _comm, distributed_benchmark

    _init(rank, world, port)
    reads: list[str] = []
    real = distload.safe_open
    distload.safe_open = lambda *a, **kw: _RecordingFile(real(*a, **kw), reads)
    rc = distload.RankCheckpoint(ckpt, "cpu")
    runner = DistributedSNLP(rc.meta_model(), LOAD_PLAN, keep_layers=True, checkpoint=rc, preheat=rc.preheat())
    params = [(n, p.is_meta, p.numel() * p.element_size()) for n, p in runner.model.named_parameters()]
    model = make_model(seed=0)
    res = dict(reads=reads, params=params, range=(runner.first, runner.stop), inv_freq=runner.model.inv_freq,
               solve=runner.solve(tokens(model)).states,
               decode=runner.generate(PROMPT, "speculative", 5, block=2).tokens)
    n_reads = len(reads)  # the bench path (snlp bench --distributed --ckpt) reads only its own layers too
    res["bench"] = distributed_benchmark(rc.meta_model, [runner.plan], 4, 1, 0, 1, 0, checkpoint=rc)[0]
    res["bench_reads"] = reads[n_reads:]
    try:  # 3. a collective that fails for a reason of its own (here: a root rank that does not exist)
        with _comm("broadcast of a test tensor"):
            dist.broadcast(torch.ones(3), world + 3)
    except CollectiveError as e:
        res["error"] = (type(e).__name__, str(e), type(e.__cause__).__name__)
    mine = distload.RankCheckpoint(ckpt if rank == 0 else other, "cpu")  # rank 1 loads other weights
    try:
        DistributedSNLP(mine.meta_model(), LOAD_PLAN, checkpoint=mine, preheat=rc.preheat())
    except ValueError as e:
        res["mismatch"] = str(e)
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_rank_loads_only_its_layers_and_errors_say_what_failed(tmp_path):
    from snlp.decode.generate import sequential_generate
    from snlp.io.checkpoint import load, load_preheat, save_checkpoint

    model = make_model(seed=0, dtype=torch.float32)
    ckpt = save_checkpoint(tmp_path / "ck", model)
    preheat.fit(model, preheat.CalibrateConfig(rank=4, batch=2, seq_len=8)).save(ckpt / preheat.FILENAME)
    other = save_checkpoint(tmp_path / "other", make_model(seed=5, dtype=torch.float32))
    _spawn(_load_worker, 2, str(ckpt), str(tmp_path), str(other))
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    ref_model, _ = load(ckpt)  # the whole model in one process
    full = sum(p.numel() * p.element_size() for p in ref_model.parameters())
    for r, rk in enumerate(ranks):
        first, stop = rk["range"]
        assert (first, stop) == ((0, 4) if r == 0 else (4, 6))
        read_layers = {int(n.split(".")[1]) for n in rk["reads"] if n.startswith("blocks.")}
        assert read_layers == set(range(first, stop)), (r, read_layers)  # never another rank's layer
        assert ("lm_head.weight" in rk["reads"]) == (r == 1)  # the head: last rank only
        own = {n for n, _ in ref_model.named_parameters() if n.startswith("blocks.")
               and first <= int(n.split(".")[1]) < stop}
        kept = {n for n, meta, _ in rk["params"]}
        assert own <= kept and not any(n.startswith("blocks.") and n not in own for n in kept)
        assert not any(meta for _, meta, _ in rk["params"])  # nothing left unmaterialised
        assert sum(b for *_, b in rk["params"]) < 0.8 * full
        torch.testing.assert_close(rk["inv_freq"], ref_model.inv_freq, rtol=0, atol=0)
        assert {int(n.split(".")[1]) for n in rk["bench_reads"] if n.startswith("blocks.")} == set(range(first, stop))
        assert rk["bench"]["memory_per_rank"][r]["param_bytes"] < 0.8 * full and rk["bench"]["snlp_ms"] > 0
        assert "ranks [1] have a different model weights/config than rank 0" in rk["mismatch"]  # the digest
        name, msg, cause = rk["error"]
        assert name == "CollectiveError" and f"rank {r} of 2: broadcast of a test tensor failed" in msg
        assert "invalid root rank" in msg and "peer rank died" not in msg and cause == "RuntimeError"
    with torch.no_grad():
        ref = solve(ref_model, tokens(ref_model), LOAD_PLAN, keep_states=True, preheat=load_preheat(ckpt, ref_model))
    torch.testing.assert_close(torch.cat([rk["solve"] for rk in ranks]), ref.states[-1], rtol=1e-5, atol=1e-5)
    seq = sequential_generate(ref_model, PROMPT, 5).tokens
    assert all(rk["decode"] == seq for rk in ranks)


# ----------------------------------------------------------------------------- a stale calibration, rank-local
def _stale_worker(rank: int, world: int, port: int, ckpt: str, out: str) -> None:
    import torch.distributed as dist

    import snlp.dist.load as distload
    from snlp.dist.layer_parallel import DistributedSNLP

    _init(rank, world, port)
    rc = distload.RankCheckpoint(ckpt, "cpu")
    try:
        DistributedSNLP(rc.meta_model(), LOAD_PLAN, checkpoint=rc, preheat=rc.preheat())
        msg = ""
    except ValueError as e:
        msg = str(e)
    torch.save(msg, os.path.join(out, f"stale{rank}.pt"))
    dist.destroy_process_group()


def test_rank_local_load_refuses_a_calibration_of_other_weights(tmp_path):
    """A calibration must not outlive its weights, on the distributed path: each rank checks the digests of the
    tensors it read against the calibration's, so a preheat.pt fitted before the weights changed is refused, not used
    (all ranks together check every weight, none reads another rank's layers for it)."""
    from snlp.io.checkpoint import save_checkpoint

    model = make_model(seed=0, dtype=torch.float32)
    pre = preheat.fit(model, preheat.CalibrateConfig(rank=4, batch=2, seq_len=8))
    with torch.no_grad():
        model.blocks[5].mlp.c_fc.weight.add_(0.05)  # training went on: only the last rank's layer changed
    ckpt = save_checkpoint(tmp_path / "ck", model)
    pre.save(ckpt / preheat.FILENAME)  # the stale file, copied back by hand
    _spawn(_stale_worker, 2, str(ckpt), str(tmp_path))
    msgs = [torch.load(tmp_path / f"stale{r}.pt") for r in range(2)]
    for m in msgs:  # rank 1 found it; both ranks refuse (rank 0 alone would hang in its next collective)
        assert m.startswith("rank 1:") and "other weights" in m and "blocks.5.mlp.c_fc.weight" in m


# ----------------------------------------------------------------------------- a diverging plan (rev-harness 2)
def _diverge_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from conftest import blowup_model

    from snlp.dist.layer_parallel import DistributedSNLP
    from snlp.method.solver import SNLPDivergenceError

    _init(rank, world, port)
    res = {}
    runner = DistributedSNLP(blowup_model(61), "8xF1-h0-K1-diag:fd", keep_layers=True)
    for temperature in (0.0, 1.0):
        try:
            res[temperature] = runner.generate(PROMPT, "snlp", max_new_tokens=4, temperature=temperature).tokens
        except SNLPDivergenceError as e:
            res[temperature] = str(e)
    res["sequential"] = runner.generate(PROMPT, "sequential", max_new_tokens=4).tokens
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_distributed_snlp_decoding_of_a_diverging_plan_raises_on_every_rank(tmp_path):
    """The blow-up model's DiagN K = 1 solve overflows (tests/conftest.py): distributed SNLP decoding emitted the argmax
    of its NaN logits; now the last rank's pick flags them, the flag is broadcast like a token, and EVERY rank raises
    SNLPDivergenceError (none is left waiting), greedy and sampled; the sequential pipeline still decodes as the
    full-prefix argmax loop."""
    from conftest import argmax_loop, blowup_model

    _spawn(_diverge_worker, 2, str(tmp_path))
    ref = argmax_loop(blowup_model(61), PROMPT, 4)
    for rank in range(2):
        res = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        for temperature in (0.0, 1.0):
            assert "diverged while decoding: the logits of generated token 1" in str(res[temperature]), (rank, res)
        assert res["sequential"] == ref


# ----------------------------------------------------------------------------- a KV cache beyond the device's memory
def _huge_cache_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from snlp.dist.layer_parallel import DistributedSNLP

    _init(rank, world, port)
    runner = DistributedSNLP(make_model(seed=0, scale=0.05, n_layer=4), "2xF1-h0-K1")
    runner.model.embed = lambda *a, **k: (_ for _ in ()).throw(AssertionError("a forward ran before the refusal"))
    res = {}
    for name, call in (("new_cache", lambda: runner.new_cache(10 ** 12)),
                       ("generate", lambda: runner.generate(PROMPT, "snlp", max_new_tokens=10 ** 12))):
        try:
            call()
            res[name] = "allocated"
        except (ValueError, RuntimeError, AssertionError) as e:
            res[name] = f"{type(e).__name__}: {e}"
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_a_distributed_kv_cache_beyond_memory_is_refused_as_the_single_process_one(tmp_path):
    """A layer-parallel rank's window cache (DistributedSNLP.new_cache, which `snlp generate --distributed` decodes
    with) skipped KVCache.for_model's memory check: `--max-new-tokens 100000000000` ended in every rank's allocator
    traceback ("can't allocate memory: you tried to allocate 19200000000576 bytes"). Each rank now refuses in one
    line, before any forward."""
    _spawn(_huge_cache_worker, 2, str(tmp_path))
    for rank in range(2):
        res = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        for name in ("new_cache", "generate"):
            assert res[name].startswith("ValueError: a KV cache of 1,000,000,000,0"), (rank, name, res[name])
            assert "more than the" in res[name] and "\n" not in res[name], res[name]


def test_checkpoint_digest_ignores_the_header_key_order(tmp_path):
    """safetensors writes the header's maps in no fixed order, so two saves of the same weights can differ in their
    header bytes; the start-up digest (RankCheckpoint.digest) reads them as the same model, and still tells a
    different token embedding apart."""
    import json
    import shutil

    from snlp.dist.load import RankCheckpoint
    from snlp.io.checkpoint import save_checkpoint

    a = save_checkpoint(tmp_path / "a", make_model(seed=0))
    b = tmp_path / "b"
    shutil.copytree(a, b)
    raw = (a / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    flipped = {k: (dict(reversed(v.items())) if k == "__metadata__" else v) for k, v in reversed(header.items())}
    text = json.dumps(flipped, separators=(",", ":")).encode()
    assert len(text) <= n and text != raw[8:8 + len(text)]
    (b / "model.safetensors").write_bytes(raw[:8] + text.ljust(n, b" ") + raw[8 + n:])  # same offsets, same data
    assert RankCheckpoint(b).digest() == RankCheckpoint(a).digest()
    other = make_model(seed=0)
    with torch.no_grad():
        other.wte.weight.add_(1.0)
    assert RankCheckpoint(save_checkpoint(tmp_path / "c", other)).digest() != RankCheckpoint(a).digest()


def _without_head(tmp_path):
    """A checkpoint whose weights file lacks lm_head.weight (its config, untied, expects it)."""
    from safetensors.torch import load_file, save_file

    from snlp.io.checkpoint import save_checkpoint

    ckpt = save_checkpoint(tmp_path / "nohead", make_model(seed=0))
    sd = load_file(str(ckpt / "model.safetensors"))
    del sd["lm_head.weight"]
    save_file(sd, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    return ckpt


def test_rank_checkpoint_names_a_missing_tensor(tmp_path):
    from snlp.dist.load import RankCheckpoint

    ck = RankCheckpoint(_without_head(tmp_path))
    like = ck.meta_model().lm_head.weight
    with pytest.raises(ValueError, match=r"model.safetensors lack lm_head.weight \(config .* expects it\)"):
        ck.tensor("lm_head.weight", like)
    with pytest.raises(ValueError, match="lack lm_head.weight"):
        ck.rows("lm_head.weight", [0], like)


def _missing_tensor_worker(rank: int, world: int, port: int, ckpt: str, out: str) -> None:
    from snlp.dist.layer_parallel import DistributedSNLP
    from snlp.dist.load import RankCheckpoint

    _init(rank, world, port, timeout_s=20.0)
    try:
        ck = RankCheckpoint(ckpt)
        DistributedSNLP(ck.meta_model(), "4xF1-h0-K1", checkpoint=ck)
        msg = ""
    except Exception as e:
        msg = f"{type(e).__name__}: {e}"
    torch.save(msg, os.path.join(out, f"rank{rank}.pt"))
    import torch.distributed as dist

    dist.destroy_process_group()  # a live gloo group can abort the exiting rank (SIGABRT) and fail the spawn


def test_a_tensor_only_one_rank_reads_fails_every_rank_with_its_reason(tmp_path):
    """Only the last rank reads the LM head: its missing tensor is every rank's ValueError naming that rank and the
    tensor, not a RankFailureError on the others ('a peer died') once the timeout has passed."""
    ckpt = _without_head(tmp_path)
    _spawn(_missing_tensor_worker, 2, str(ckpt), str(tmp_path))
    for r in range(2):
        msg = torch.load(tmp_path / f"rank{r}.pt")
        assert msg.startswith("ValueError: rank 1: weights in") and "lack lm_head.weight" in msg, (r, msg)


def _prefill_head_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from snlp.dist.layer_parallel import DistributedSNLP

    _init(rank, world, port)
    model = make_model(seed=3)
    rows: list[int] = []  # positions each lm_head call projects, on this rank
    model.lm_head.register_forward_hook(lambda m, i, o: rows.append(i[0].shape[-2]))
    runner = DistributedSNLP(model, "4xF1-h0-K1", keep_layers=True)
    prompt = list(range(3, 14))  # 11 tokens: a prefill of 10
    res = {}
    for mode in ("sequential", "snlp", "speculative"):
        rows.clear()
        res[mode] = (runner.generate(prompt, mode, max_new_tokens=4, block=2).tokens, list(rows))
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.parametrize("world", [1, 2])
def test_a_distributed_prefill_computes_no_logits(world, tmp_path):
    """The distributed decode's prefill (the prompt but its last token) projected every prompt position through the
    head on the last rank, logits nobody read. Now no call projects more than a verifier's block + 1 positions, and
    the tokens are the single-process decoders' (fp64)."""
    from snlp.decode.generate import sequential_generate

    _spawn(_prefill_head_worker, world, str(tmp_path))
    model, prompt = make_model(seed=3), list(range(3, 14))
    want = {"sequential": sequential_generate(model, prompt, max_new_tokens=4).tokens,
            "snlp": snlp_generate(model, prompt, "4xF1-h0-K1", max_new_tokens=4).tokens}
    want["speculative"] = want["sequential"]
    for r in range(world):
        got = torch.load(tmp_path / f"rank{r}.pt")
        for mode, (toks, rows) in got.items():
            assert toks == want[mode], (r, mode)
            assert max(rows, default=0) <= 3, (r, mode, rows)  # never the prompt's 10 positions
            assert bool(rows) == (r == world - 1), (r, mode, rows)  # the last rank projects


def test_bench_distributed_refuses_a_causal_plan_on_a_window_free_model_before_any_rank(capsys):
    """Every rank's DistributedSNLP refuses -causal where the suffix has no window, but `snlp bench --distributed`
    builds one per plan in turn: on random weights (default --window-pattern L) the plans before it were timed first
    and the ranks then failed. Now refused in one line before the process group (without torchrun here: the refusal
    comes before the torchrun check), and a windowed model reaches that check."""
    from snlp.apps.cli import main

    args = ["bench", "--distributed", "--plans", "4xF1-h0-K1,4xF1-h0-K1-causal", "--depth", "8", "--device", "cpu"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "4xF1-h0-K1-causal" in err[0] and "drop -causal" in err[0]
    assert main(args + ["--window-pattern", "SL"]) == 2
    assert "torchrun" in capsys.readouterr().err
