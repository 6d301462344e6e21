"""A -causal plan on a model whose suffix has no sliding window changes nothing (Plan.check_model refuses it): for a
.gguf file or a transformers directory the refusal comes from its header / config.json, before any weight loads;
and a -causal plan whose windows all span the run's longest sequence is warned about (Plan.causal_idle)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import transformers

import snlp.eval.harness
import snlp.io.hf
import snlp.train.adapt
from snlp.apps.cli import main
from snlp.apps.common import check_plans_fit
from snlp.method.plan import Plan

gguf = pytest.importorskip("gguf")

L, D, F, V = 4, 8, 16, 16


def tiny_gguf(path):
    """A complete 4-layer dense Llama GGUF (zeros; what check_gguf accepts): header and tensors, no tokenizer."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(L)
    w.add_context_length(64)
    w.add_embedding_length(D)
    w.add_feed_forward_length(F)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    shapes = {"attn_norm": (D,), "ffn_norm": (D,), "attn_q": (D, D), "attn_k": (D // 2, D), "attn_v": (D // 2, D),
              "attn_output": (D, D), "ffn_gate": (F, D), "ffn_up": (F, D), "ffn_down": (D, F)}
    w.add_tensor("token_embd.weight", np.zeros((V, D), np.float32))
    w.add_tensor("output_norm.weight", np.zeros(D, np.float32))
    for layer in range(L):
        for name, shape in shapes.items():
            w.add_tensor(f"blk.{layer}.{name}.weight", np.zeros(shape, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def mistral_dir(path, sliding_window):
    transformers.MistralConfig(vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=L,
                               num_attention_heads=2, num_key_value_heads=1, sliding_window=sliding_window,
                               architectures=["MistralForCausalLM"]).save_pretrained(path)
    return path


@pytest.fixture
def no_load(monkeypatch):
    """Any model load fails the test: the refusal must come before it."""
    def loaded(*a, **k):
        raise AssertionError("the model loaded before the refusal")

    # the modules that bind from_hf at import are imported at the top and patched here: one first imported under
    # the patch kept the fake for every later test of its process (a later `snlp adapt` test failed with this)
    for mod in (snlp.io.hf, snlp.train.adapt, snlp.eval.harness):
        monkeypatch.setattr(mod, "from_hf", loaded)
    monkeypatch.setattr(snlp.io.hf, "_load_hf", loaded)


def test_check_plans_fit_reads_a_gguf_header_and_a_transformers_config(tmp_path, no_load):
    g = tiny_gguf(tmp_path / "m.gguf")
    with pytest.raises(ValueError, match="layers 2..3 have none .* changes nothing, drop -causal"):
        check_plans_fit(str(g), ["2xF1-h0-K1-causal"], transformers_ok=True)
    with pytest.raises(ValueError, match="only L = 4"):  # its depth from the header too
        check_plans_fit(str(g), ["5xF1-h0-K1"], transformers_ok=True)
    check_plans_fit(str(g), ["2xF1-h0-K1"], transformers_ok=True)
    full = mistral_dir(tmp_path / "full", None)
    with pytest.raises(ValueError, match="changes nothing, drop -causal"):
        check_plans_fit(str(full), ["2xF1-h0-K1-causal"], transformers_ok=True)
    slid = mistral_dir(tmp_path / "slid", 4)  # windows w = 3: keys i - j <= 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_plans_fit(str(slid), ["2xF1-h0-K1-causal"], transformers_ok=True)  # T unknown: no warning
        check_plans_fit(str(slid), ["2xF1-h0-K1-causal"], transformers_ok=True, longest=5)  # 5 - 1 > 3: it bites
    with pytest.warns(UserWarning, match="at most 4 tokens: it changes nothing here"):
        check_plans_fit(str(slid), ["2xF1-h0-K1-causal"], transformers_ok=True, longest=4)


@pytest.mark.parametrize("argv", [
    ["adapt", "{src}", "--plan", "2xF1-h0-K1-causal", "--out", "{tmp}/ad"],
    ["eval", "{src}", "--harness", "lambada_openai", "--plans", "2xF1-h0-K1-causal"],
    ["bench", "--suite", "decode", "--ckpt", "{src}", "--suite-plans", "2xF1-h0-K1-causal"],
])
@pytest.mark.parametrize("kind", ["gguf", "transformers"])
def test_commands_refuse_a_causal_plan_before_the_model_loads(tmp_path, no_load, capsys, argv, kind):
    src = tiny_gguf(tmp_path / "m.gguf") if kind == "gguf" else mistral_dir(tmp_path / "hf", None)
    rc = main([a.format(src=src, tmp=tmp_path) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2 and "changes nothing, drop -causal" in err and "loaded before" not in err


def test_causal_idle_is_the_window_law():
    """causal_idle says 'nothing changes' exactly where every windowed suffix layer keeps all T keys (w >= T - 1)."""
    from conftest import make_model

    m = make_model()  # windows in layers 0, 2, 4 of 6 (pattern "SL"), sequence_len // 2 wide
    w = m.config.window(4)
    p = Plan.parse("3xF1-h0-K1-causal")
    assert p.causal_idle(m.config, w + 1) and p.causal_idle(m.config, 1)
    assert p.causal_idle(m.config, w + 2) is None
    assert Plan.parse("3xF1-h0-K1").causal_idle(m.config, 1) is None


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """A 4-layer checkpoint with a tokenizer whose layer 2 keeps a window of w + 1 = 4 tokens (make_model: short_window
    3 in layers 0 and 2) and layer 3 attends fully: 2xF1-h0-K1-causal drops layer 2's window."""
    from conftest import text_checkpoint
    from snlp.io.checkpoint import load_config

    ck = text_checkpoint(tmp_path_factory.mktemp("win"))[0]
    config = load_config(ck)
    assert [config.window(layer) for layer in (2, 3)] == [3, -1]
    return ck, config.window(2)


CAUSAL = "2xF1-h0-K1-causal"


def causal_warnings(argv) -> list[str]:
    """The causal_idle warnings of one CLI call (which must succeed)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert main(argv) == 0
    return [str(w.message) for w in seen if "changes nothing here" in str(w.message)]


@pytest.mark.parametrize("mode", ["snlp", "speculative", "prompts-file"])
def test_generate_warns_where_every_window_spans_the_prompt_and_its_new_tokens(windowed, tmp_path, mode):
    """`snlp generate` with a -causal plan: warned exactly where prompt + --max-new-tokens <= w + 1 (every kept token's
    query reads keys no window drops), as `snlp eval` is; past that the window bites and nothing is said."""
    from snlp import load

    ck, w = windowed
    text = "First Citizen"
    n = len(load(ck)[1].prompt_ids(text))
    assert 1 <= n <= w  # room for one new token inside the window
    if mode == "prompts-file":
        (tmp_path / "p.txt").write_text(f"{text}\nFirst\n")  # the longest prompt counts
        run = ["--prompts-file", str(tmp_path / "p.txt"), "--batch-size", "2", "--mode", "speculative"]
    else:
        run = ["--prompt", text, "--mode", mode]
    for new, said in ((w + 1 - n, True), (w + 2 - n, False)):
        got = causal_warnings(["generate", str(ck), *run, "--plan", CAUSAL, "--max-new-tokens", str(new), "--quiet",
                               *(["--no-baseline"] if "speculative" in run else [])])
        assert len(got) == int(said) and (not said or f"at most {w + 1} tokens" in got[0]), (new, got)


def test_bench_decode_warns_where_every_window_spans_the_prompt_and_its_new_tokens(windowed):
    """`snlp bench --decode` (single process and --batch-sizes): warned exactly where --prompt-len + --new-tokens
    <= w + 1, as the forward benchmark is at --tokens; random weights too (their windows: sequence_len // 2)."""
    ck, w = windowed
    run = ["bench", "--decode", "--plans", CAUSAL, "--runs", "1", "--warmup", "0", "--blocks", "2"]
    for prompt, new, said in ((2, w - 1, True), (2, w, False)):
        for batch in ([], ["--batch-sizes", "2"]):
            got = causal_warnings([*run, "--ckpt", str(ck), "--prompt-len", str(prompt), "--new-tokens", str(new),
                                   *batch])
            assert len(got) == int(said) and (not said or f"at most {prompt + new} tokens" in got[0]), (batch, got)
    rand = ["--depth", "4", "--width", "32", "--head-dim", "16", "--window-pattern", "SL"]
    got = causal_warnings([*run, *rand, "--prompt-len", "4", "--new-tokens", "2"])
    assert len(got) == 1 and "at most 6 tokens" in got[0], got
    got = causal_warnings(["bench", "--plans", CAUSAL, "--runs", "1", "--warmup", "0", *rand, "--tokens", "8"])
    assert len(got) == 1 and "at most 8 tokens" in got[0], got  # the forward benchmark on random weights too


def test_distributed_generate_warns_as_one_process_does(windowed, monkeypatch):
    """`snlp generate --distributed` (one rank, torchrun's environment set by hand): rank 0 warns as the single
    process does, at the same boundary."""
    from conftest import free_port
    from snlp import load

    ck, w = windowed
    n = len(load(ck)[1].prompt_ids("First"))
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
        monkeypatch.setenv(k, v)
    for new, said in ((w + 1 - n, True), (w + 2 - n, False)):
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        got = causal_warnings(["generate", str(ck), "--distributed", "--mode", "snlp", "--plan", CAUSAL, "--prompt",
                               "First", "--max-new-tokens", str(new), "--quiet", "--device", "cpu"])
        assert len(got) == int(said), (new, got)


def test_distributed_bench_warns_before_any_rank_starts(windowed, monkeypatch):
    """`snlp bench --distributed` (--decode and the prefill benchmark) warns as the single-process bench does, before
    any rank starts: here the torchrun environment is missing, so the command stops right after the warning."""
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    ck, w = windowed

    def said(*argv) -> list[str]:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert main(["bench", "--distributed", "--plans", CAUSAL, "--runs", "1", "--warmup", "0", *argv]) == 2
        return [str(x.message) for x in seen if "changes nothing here" in str(x.message)]

    for new, n in ((w - 1, 1), (w, 0)):
        assert len(said("--decode", "--ckpt", str(ck), "--prompt-len", "2", "--new-tokens", str(new))) == n, new
    # with --decode every plan runs its prefill rows at --tokens too: a longer prefill is where the window bites
    for tokens, n in ((w + 1, 1), (w + 2, 0)):
        got = said("--decode", "--ckpt", str(ck), "--prompt-len", "2", "--new-tokens", str(w - 1),
                   "--tokens", str(tokens))
        assert len(got) == n and (not n or f"at most {w + 1} tokens" in got[0]), (tokens, got)
    got = said("--depth", "4", "--width", "32", "--head-dim", "16", "--window-pattern", "SL", "--tokens", "8")
    assert len(got) == 1 and "at most 8 tokens" in got[0], got


def test_decode_suite_warns_where_every_window_spans_its_sequences(windowed):
    """`snlp bench --suite decode` warns as `snlp bench --decode` does: on a checkpoint where --prompt-len +
    --suite-new-tokens <= w + 1 (every prompt is cut to --prompt-len), at a paper shape (--shapes, whose drafter steps
    decode one token after the prompt) where --prompt-len + 1 <= w + 1; past that the window bites and nothing is
    said."""
    ck, w = windowed
    run = ["bench", "--suite", "decode", "--suite-plans", CAUSAL, "--suite-runs", "1", "--suite-warmup", "0"]
    for new, said in ((w - 1, True), (w, False)):
        got = causal_warnings([*run, "--ckpt", str(ck), "--suite-methods", "snlp", "--no-transformers",
                               "--batch-sizes", "1", "--prompt-len", "2", "--suite-new-tokens", str(new)])
        assert len(got) == int(said) and (not said or f"at most {2 + new} tokens" in got[0]), (new, got)
    # the quick 3B shape: 10 layers, the last two a window of 8 (it keeps 9 tokens) and a full one
    for prompt, said in ((8, True), (9, False)):
        got = causal_warnings([*run, "--shapes", "3B", "--quick", "--prompt-len", str(prompt), "--blocks", "1",
                               "--alpha", "0.5"])
        assert len(got) == int(said) and (not said or "at most 9 tokens" in got[0]), (prompt, got)


def test_decode_suite_refuses_an_unknown_shape_before_timing_any(monkeypatch, capsys):
    """--shapes 3B,nope timed the 3B shape, then stopped on the unknown one: every shape is checked first."""
    import snlp.bench.ssd_prediction as ssd

    timed = []
    monkeypatch.setattr(ssd, "paper_shape_prediction", lambda shape, *a, **k: timed.append(shape) or [])
    assert main(["bench", "--suite", "decode", "--shapes", "3B,nope", "--quick"]) == 2
    assert "unknown --shapes nope" in capsys.readouterr().err and timed == []


@pytest.mark.parametrize("shape", [["--shape", "70B"], ["--depth", "4"]])
def test_simulate_devices_refuses_a_causal_plan_its_windowless_shape_cannot_take(shape, capsys):
    """The cost model's shapes have no sliding window (every layer attends fully) and it prices none: a -causal plan
    was priced as its non-causal twin; it is refused (Plan.check_model's line) before anything is timed."""
    argv = ["bench", "--simulate-devices", "2", *shape, "--plans", "2xF1-h0-K1,2xF1-h0-K1-causal", "--link-gbps", "100",
            "--link-latency-us", "5", "--roofline-gbytes", "1000"]
    assert main(argv) == 2
    err = capsys.readouterr()
    assert "2xF1-h0-K1-causal" in err.err and "changes nothing, drop -causal" in err.err
    assert "2xF1-h0-K1 on" not in err.out  # nothing priced before the refusal
