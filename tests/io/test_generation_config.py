"""A Hugging Face model's generation config (generation_config.json: eos_token_id, possibly a list, as
Llama-3-Instruct and Qwen2.5 ship) is carried through convert, checkpoint, load and export, and every snlp
generation path stops where transformers' generate stops; `snlp eval --harness` uses the harness's own bootstrap
count for its stderr."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import word_tokenizer  # noqa: E402
from snlp import load, sequential_generate, snlp_generate, speculative_generate  # noqa: E402
from snlp.apps.cli import main  # noqa: E402

V = 97
EOS = V - 2  # the word tokenizer's </s>
PROMPT = [5, 17, 3, 44, 9, 12]
N = 16


def tiny_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   bos_token_id=V - 3, eos_token_id=EOS, attn_implementation="sdpa")
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A transformers directory whose generation_config.json lists the tokenizer's EOS and one more id: a token
    greedy decoding of PROMPT emits at its 4th step (and not before)."""
    hf = tiny_llama()
    with torch.no_grad():
        free = hf.generate(torch.tensor([PROMPT]), max_new_tokens=N, min_new_tokens=N, do_sample=False,
                           pad_token_id=0)[0, len(PROMPT):].tolist()
    k = next(i for i in range(3, N) if free[i] not in free[:i] and free[i] != EOS)
    stop = free[k]
    hf.generation_config.eos_token_id = [EOS, stop]
    d = tmp_path_factory.mktemp("hf") / "model"
    hf.save_pretrained(str(d))
    word_tokenizer(V).save_pretrained(str(d))
    assert json.loads((d / "generation_config.json").read_text())["eos_token_id"] == [EOS, stop]
    with torch.no_grad():  # the outside reference: transformers' own generate with that config
        ref = transformers.AutoModelForCausalLM.from_pretrained(str(d)).eval().generate(
            torch.tensor([PROMPT]), max_new_tokens=N, do_sample=False, pad_token_id=0)[0, len(PROMPT):].tolist()
    assert ref == free[:k + 1] and ref[-1] == stop
    return d, stop, ref


def test_convert_load_and_every_decoding_path_stop_where_transformers_does(hf_dir, tmp_path):
    d, stop, ref = hf_dir
    assert main(["convert", str(d), "--out", str(tmp_path / "ck")]) == 0
    model, tok = load(tmp_path / "ck")
    assert tok.stop_ids == (EOS, stop) and tok.eos_id == EOS
    eos = list(tok.stop_ids)
    assert sequential_generate(model, PROMPT, max_new_tokens=N, eos_id=eos).tokens == ref
    assert snlp_generate(model, PROMPT, "4xF1-h0-K4", max_new_tokens=N, eos_id=eos).tokens == ref  # K >= C: exact
    for plan in ("2xF1-h0-K1", "1xF2-h0-K1"):
        assert speculative_generate(model, PROMPT, plan, block=3, max_new_tokens=N, eos_id=eos).tokens == ref
    rows = sequential_generate(model, [PROMPT, PROMPT[:4]], max_new_tokens=N, eos_id=eos)  # a ragged batch
    assert rows[0].tokens == ref and rows[0].stop == "eos"
    rows = speculative_generate(model, [PROMPT, PROMPT[:4]], "2xF1-h0-K1", block=3, max_new_tokens=N, eos_id=eos)
    assert rows[0].tokens == ref


def test_generate_chat_stops_at_the_generation_config_ids(hf_dir, tmp_path):
    d, stop, _ = hf_dir
    assert main(["convert", str(d), "--out", str(tmp_path / "ck")]) == 0
    _, tok = load(tmp_path / "ck")
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "t3 t7"}]))
    with torch.no_grad():
        ref = transformers.AutoModelForCausalLM.from_pretrained(str(d)).eval().generate(
            torch.tensor([prompt]), max_new_tokens=N, do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    assert main(["generate", str(tmp_path / "ck"), "--prompt", "t3 t7", "--chat", "--max-new-tokens", str(N),
                 "--quiet", "--json", str(tmp_path / "g.json")]) == 0
    assert json.loads((tmp_path / "g.json").read_text())["tokens"] == ref


def argmax_loop(hf, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens of transformers' forward, no stop id: what decoding the whole budget gives."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


PLAIN = " ".join(f"t{i}" for i in PROMPT)  # the word tokenizer reads it as PROMPT (no BOS: no post-processor)
MODES = {"sequential": [], "snlp": ["--plan", "4xF1-h0-K4"],  # K >= C: exact
         "speculative": ["--plan", "2xF1-h0-K1", "--block", "3", "--no-baseline"],
         "jacobi": ["--plan", "2xF1-h0-K1", "--block", "3"]}


@pytest.mark.parametrize("mode", MODES)
def test_a_plain_prompt_stops_where_transformers_generate_does_in_every_mode(hf_dir, tmp_path, mode):
    """`snlp generate --prompt TEXT` (no --chat) stopped only at --eos-id (default none) and decoded past the
    generation config's EOS where transformers' generate() stops: now it stops at the config's ids by default in
    every mode and with --prompts-file, and says which ids and whence; --eos-id ID overrides them and --eos-id none
    decodes the whole budget (transformers' forward as an argmax loop)."""
    d, stop, ref = hf_dir
    ck = tmp_path / "ck"
    assert main(["convert", str(d), "--out", str(ck)]) == 0

    def gen(*extra, prompt=("--prompt", PLAIN)):
        out = tmp_path / "g.json"
        assert main(["generate", str(ck), *prompt, "--max-new-tokens", str(N), "--mode", mode, *MODES[mode],
                     "--quiet", "--json", str(out), *extra]) == 0
        return json.loads(out.read_text())

    got = gen()
    assert got["tokens"] == ref and got["stop"] == "eos"
    assert got["stop_ids"] == [EOS, stop] and got["stop_ids_source"] == "generation_config"
    if mode != "jacobi":  # --prompts-file decodes with the other three
        (tmp_path / "p.txt").write_text(f"{PLAIN}\n{PLAIN}\n")
        rows = gen(prompt=("--prompts-file", str(tmp_path / "p.txt")))
        assert [r["tokens"] for r in rows["results"]] == [ref, ref] and rows["stop_ids"] == [EOS, stop]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(d)).eval()
    whole = argmax_loop(hf, PROMPT, N)
    assert whole[:len(ref)] == ref and len(whole) == N
    none = gen("--eos-id", "none")
    assert none["tokens"] == whole and none["stop_ids"] == [] and none["stop_ids_source"] == "flag"
    own = whole[1]  # an id of the flag's own: it stops at its first occurrence, and only there
    mine = gen("--eos-id", str(own))
    assert mine["tokens"] == whole[:whole.index(own) + 1] and mine["stop_ids"] == [own]


def test_the_summary_names_the_stop_ids_and_where_they_came_from(hf_dir, tmp_path, capsys):
    d, stop, ref = hf_dir
    assert main(["convert", str(d), "--out", str(tmp_path / "ck")]) == 0
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "ck"), "--prompt", PLAIN, "--max-new-tokens", str(N)]) == 0
    out = capsys.readouterr().out
    assert f"stop: eos, stop ids {EOS},{stop} (the model's generation config" in out.splitlines()[-1]
    assert "</s>" not in out and f"t{stop}" not in out.splitlines()[0].split()[len(PROMPT):]  # the stop is not printed
    assert main(["generate", str(tmp_path / "ck"), "--prompt", PLAIN, "--max-new-tokens", "3", "--eos-id",
                 "none"]) == 0
    assert "stop ids none (--eos-id none: the whole --max-new-tokens budget)" in capsys.readouterr().out


def test_a_prompts_file_row_prints_what_a_single_prompt_streams(hf_dir, tmp_path, capsys):
    """A single --prompt streams its text without the stop id (the summary line names it); --prompts-file printed each
    row with it (`t{stop}` or `</s>` glued to the reply), now that a plain prompt stops at the generation config's
    ids. Reference: the single prompt's streamed line, and its tokens decoded without the last (the stop)."""
    d, stop, ref = hf_dir
    ck = tmp_path / "ck"
    assert main(["convert", str(d), "--out", str(ck)]) == 0
    _, tok = load(ck)
    capsys.readouterr()
    assert main(["generate", str(ck), "--prompt", PLAIN, "--max-new-tokens", str(N)]) == 0
    single = capsys.readouterr().out.splitlines()[0]
    assert single == PLAIN + tok.decode(ref[:-1]) and ref[-1] == stop
    (tmp_path / "p.txt").write_text(f"{PLAIN}\n")
    assert main(["generate", str(ck), "--prompts-file", str(tmp_path / "p.txt"), "--max-new-tokens", str(N),
                 "--json", str(tmp_path / "b.json")]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"[0] {single}"
    row = json.loads((tmp_path / "b.json").read_text())["results"][0]
    assert row["tokens"] == ref and row["text"] == tok.decode(ref, mark_missing=True)  # the record keeps the stop


def test_export_writes_the_list_and_transformers_stops_there(hf_dir, tmp_path):
    d, stop, ref = hf_dir
    assert main(["convert", str(d), "--out", str(tmp_path / "ck")]) == 0
    assert main(["export", str(tmp_path / "ck"), "--out", str(tmp_path / "exp")]) == 0
    gc = json.loads((tmp_path / "exp" / "generation_config.json").read_text())
    assert gc["eos_token_id"] == [EOS, stop] and gc["bos_token_id"] == V - 3
    with torch.no_grad():
        again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "exp")).eval().generate(
            torch.tensor([PROMPT]), max_new_tokens=N, do_sample=False, pad_token_id=0)[0, len(PROMPT):].tolist()
    assert again == ref


@pytest.fixture(scope="module")
def no_eos_dir(tmp_path_factory):
    """A transformers directory whose generation config names no EOS (eos_token_id None; config.json keeps the
    tokenizer's </s>, as Llama's does) and whose tokenizer has </s>: transformers' generate() then decodes the whole
    budget. The rows of </s> and of a token greedy decoding of PROMPT first emits at step k are swapped in the
    embedding and the head (the same model with two ids renamed), so </s> is a greedy token inside the budget."""
    hf = tiny_llama()
    with torch.no_grad():
        free = hf.generate(torch.tensor([PROMPT]), max_new_tokens=N, min_new_tokens=N, do_sample=False,
                           pad_token_id=0)[0, len(PROMPT):].tolist()
        k = next(i for i in range(3, N - 2) if free[i] not in free[:i] and EOS not in free[:i + 1])
        for w in (hf.model.embed_tokens.weight, hf.lm_head.weight):
            w[[free[k], EOS]] = w[[EOS, free[k]]].clone()
    hf.generation_config.eos_token_id = None
    d = tmp_path_factory.mktemp("hf_no_eos") / "model"
    hf.save_pretrained(str(d))
    word_tokenizer(V).save_pretrained(str(d))
    assert "eos_token_id" not in json.loads((d / "generation_config.json").read_text())
    assert json.loads((d / "config.json").read_text())["eos_token_id"] == EOS
    ref = greedy_generate(d, PROMPT)  # the outside reference: transformers' generate() of the folder
    assert len(ref) == N and ref[k] == EOS and ref[:k] == free[:k]
    return d, ref


def greedy_generate(d, prompt: list[int]) -> list[int]:
    """transformers' generate() of the folder `d` (its own generation config; fp32, greedy): the new tokens."""
    with torch.no_grad():
        return transformers.AutoModelForCausalLM.from_pretrained(str(d)).eval().generate(
            torch.tensor([prompt]), max_new_tokens=N, do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()


@pytest.mark.parametrize("mode", ["sequential", "snlp"])
def test_a_source_naming_no_eos_decodes_the_whole_budget_as_transformers_does(no_eos_dir, tmp_path, capsys, mode):
    """A source whose generation config names no EOS: transformers' generate() decodes the whole budget, past the
    tokenizer's </s>, while the converted model stopped at </s> (source "tokenizer"): the checkpoint had no record
    telling it from one converted before the EOS list was recorded. `snlp convert` now records the empty list, and
    `snlp generate` (plain prompt and --chat) decodes the budget, as transformers' generate() of the folder."""
    d, ref = no_eos_dir
    ck = tmp_path / "ck"
    assert main(["convert", str(d), "--out", str(ck)]) == 0
    assert json.loads((ck / "tokenizer_meta.json").read_text())["eos_token_ids"] == []
    _, tok = load(ck)
    assert tok.stop_ids == () and tok.chat_stop_ids == () and tok.eos_id == EOS
    capsys.readouterr()
    out = tmp_path / "g.json"
    assert main(["generate", str(ck), "--prompt", PLAIN, "--max-new-tokens", str(N), "--mode", mode, *MODES[mode],
                 "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["tokens"] == ref and got["stop"] == "max_new_tokens"
    assert (got["stop_ids"], got["stop_ids_source"]) == ([], "generation_config")
    assert "stop ids none (the model's generation config names no EOS" in capsys.readouterr().out.splitlines()[-2]
    chat = tok.chat_prompt([{"role": "user", "content": "t3 t7"}])
    assert main(["generate", str(ck), "--prompt", "t3 t7", "--chat", "--max-new-tokens", str(N), "--mode", mode,
                 *MODES[mode], "--quiet", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["tokens"] == greedy_generate(d, chat)


def test_export_of_a_source_naming_no_eos_writes_none_and_generates_as_the_source(no_eos_dir, tmp_path):
    """`snlp export` wrote the tokenizer's </s> as the generation config's EOS of a source that named none, so
    transformers' generate() of the export stopped where that of the source did not. Reference: generate() of the
    source folder, tokens identical."""
    d, ref = no_eos_dir
    assert main(["convert", str(d), "--out", str(tmp_path / "ck")]) == 0
    assert main(["export", str(tmp_path / "ck"), "--out", str(tmp_path / "exp")]) == 0
    assert json.loads((tmp_path / "exp" / "generation_config.json").read_text()).get("eos_token_id") is None
    assert transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "exp")).generation_config.eos_token_id \
        is None
    assert greedy_generate(tmp_path / "exp", PROMPT) == ref
    _, again = load(tmp_path / "ck")  # converting the export again records the same none
    assert main(["convert", str(tmp_path / "exp"), "--out", str(tmp_path / "ck2")]) == 0
    assert load(tmp_path / "ck2")[1].stop_ids == again.stop_ids == ()


def test_a_checkpoint_converted_before_the_list_was_recorded_stops_at_the_tokenizers_eos(no_eos_dir, tmp_path):
    """A checkpoint whose tokenizer_meta.json has no eos_token_ids (converted before the list was recorded) keeps
    stopping at the tokenizer's EOS, and its export names that EOS, as before. Reference: the source's whole-budget
    greedy tokens cut after their first </s>; transformers' generate() of the export."""
    d, ref = no_eos_dir
    ck = tmp_path / "ck"
    assert main(["convert", str(d), "--out", str(ck)]) == 0
    meta = json.loads((ck / "tokenizer_meta.json").read_text())
    meta.pop("eos_token_ids", None)  # (a source without a list: none was recorded)
    (ck / "tokenizer_meta.json").write_text(json.dumps(meta))
    cut = ref[:ref.index(EOS) + 1]
    assert load(ck)[1].stop_ids == (EOS,)
    out = tmp_path / "g.json"
    assert main(["generate", str(ck), "--prompt", PLAIN, "--max-new-tokens", str(N), "--quiet",
                 "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["tokens"] == cut and (got["stop_ids"], got["stop_ids_source"]) == ([EOS], "tokenizer")
    assert main(["export", str(ck), "--out", str(tmp_path / "exp")]) == 0
    assert json.loads((tmp_path / "exp" / "generation_config.json").read_text())["eos_token_id"] == EOS
    assert greedy_generate(tmp_path / "exp", PROMPT) == cut


def test_recorded_stop_ids_none_differs_from_none_recorded(no_eos_dir):
    """Tokenizer.with_stop_ids: [] records that the generation config names no EOS (stop_ids empty), None records
    nothing (the tokenizer's EOS); a recorded list must hold ids of the vocabulary, [] included."""
    from snlp.io.tokenizer import Tokenizer

    d, _ = no_eos_dir
    tok = Tokenizer.from_hf(transformers.AutoTokenizer.from_pretrained(str(d)))
    assert "eos_token_ids" not in tok.meta and tok.stop_ids == (EOS,)
    assert tok.with_stop_ids([]).stop_ids == () and tok.with_stop_ids([]).meta["eos_token_ids"] == []
    assert tok.with_stop_ids([]).with_stop_ids(None).stop_ids == (EOS,)
    assert tok.with_stop_ids([7, EOS, 7]).stop_ids == (7, EOS)
    assert Tokenizer(tok.tok, {**tok.meta, "eos_token_ids": []}).stop_ids == ()
    for bad in ([V], [-1], "95", 95):
        with pytest.raises(ValueError, match="eos_token_ids"):
            Tokenizer(tok.tok, {**tok.meta, "eos_token_ids": bad})


def test_harness_generation_stops_at_the_generation_config_ids(hf_dir, tmp_path):
    pytest.importorskip("lm_eval")
    from snlp.eval.harness import SNLPLM

    d, stop, ref = hf_dir
    assert main(["convert", str(d), "--out", str(tmp_path / "ck")]) == 0
    model, tok = load(tmp_path / "ck")
    for plan, decode in ((None, None), ("2xF1-h0-K1", "speculative"), ("4xF1-h0-K4", "snlp")):
        lm = SNLPLM(pretrained=model, tokenizer=tok, plan=plan, decode=decode, device="cpu")
        assert lm._generate([PROMPT], N, 0.0) == [ref]


def test_harness_stderr_uses_the_harness_bootstrap_count(monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    import importlib
    import inspect

    import lm_eval.tasks
    from snlp.eval.harness import evaluate_methods

    seen = {}

    class Tasks:
        all_tasks = ["t"]

        def __init__(self, *a, **k):
            pass

    def fake_evaluate(**kw):
        seen.update(kw)
        return {"results": {}, "config": {}}

    class LM:
        method, model_args, batch_size, device = "sequential", "pretrained=x", 1, "cpu"

        def unapplied_defaults(self, sampling):  # a model without generation-config settings to refuse
            return {}

        def repetition_penalty_for(self, task_value=None):  # nor a penalty
            return 1.0

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", Tasks)
    monkeypatch.setattr(lm_eval, "simple_evaluate", fake_evaluate)
    evaluate_methods([LM()], ["t"])
    real = inspect.unwrap(importlib.import_module("lm_eval.evaluator").simple_evaluate)
    assert seen["bootstrap_iters"] == inspect.signature(real).parameters["bootstrap_iters"].default == 100000
    evaluate_methods([LM()], ["t"], bootstrap_iters=7)  # an explicit count is passed as given
    assert seen["bootstrap_iters"] == 7


def test_convert_refuses_an_out_that_holds_a_checkpoint(hf_dir, tmp_path, capsys):
    """`snlp convert SRC --out RUN` over a trained run replaced its weights and config and dropped its optimizer and
    train state (save_checkpoint keeps only the files it does not own): refused before the source is read."""
    d, _, _ = hf_dir
    assert main(["convert", str(d), "--out", str(tmp_path / "ck")]) == 0
    (tmp_path / "ck" / "optimizer.pt").write_bytes(b"a trained run's states")
    before = {f.name: f.read_bytes() for f in (tmp_path / "ck").iterdir()}
    capsys.readouterr()
    assert main(["convert", str(d), "--out", str(tmp_path / "ck")]) == 2
    assert "already holds a checkpoint" in capsys.readouterr().err
    assert {f.name: f.read_bytes() for f in (tmp_path / "ck").iterdir()} == before
    (tmp_path / "tok").mkdir()  # a tokenizer's own folder: its tokenizer.json was replaced by the model's
    (tmp_path / "tok" / "tokenizer.json").write_text('{"mine": true}')
    assert main(["convert", str(d), "--out", str(tmp_path / "tok")]) == 2
    assert "already holds a checkpoint or model (tokenizer.json)" in capsys.readouterr().err
    assert [(p.name, p.read_text()) for p in (tmp_path / "tok").iterdir()] == [("tokenizer.json", '{"mine": true}')]
    for sub in ("stages", "noreg"):  # a speedrun's folder: its stages would no longer be reusable
        (tmp_path / "sr" / sub).mkdir(parents=True)
    assert main(["convert", str(d), "--out", str(tmp_path / "sr")]) == 2
    assert "holds a speedrun" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "sr").iterdir()) == ["noreg", "stages"]


def test_export_refuses_an_out_that_holds_a_checkpoint_or_model(hf_dir, tmp_path, capsys):
    """`snlp export CKPT --out CKPT` (or any run's folder) wrote transformers' config.json and weights over the
    checkpoint's, after which the folder loaded as neither: refused before the model loads, every file kept."""
    d, _, _ = hf_dir
    ck = tmp_path / "ck"
    assert main(["convert", str(d), "--out", str(ck)]) == 0
    (ck / "optimizer.pt").write_bytes(b"a trained run's states")
    before = {f.name: f.read_bytes() for f in ck.iterdir()}
    assert main(["export", str(ck), "--out", str(tmp_path / "hf")]) == 0  # a new folder: written
    for out in (ck, tmp_path / "hf"):  # its own folder; an earlier export (or a downloaded transformers model)
        capsys.readouterr()
        assert main(["export", str(ck), "--out", str(out)]) == 2
        assert "already holds a checkpoint or model" in capsys.readouterr().err
    assert {f.name: f.read_bytes() for f in ck.iterdir()} == before
    assert load(ck)[0].config.n_layer == 4
    (tmp_path / "dr").mkdir()
    (tmp_path / "dr" / "drafter.json").write_text("{}")
    assert main(["export", str(ck), "--out", str(tmp_path / "dr")]) == 2
    assert "holds a drafter" in capsys.readouterr().err
    assert [p.name for p in (tmp_path / "dr").iterdir()] == ["drafter.json"]


def test_generate_says_which_of_the_models_generation_defaults_it_does_not_apply(hf_dir, tmp_path, capsys):
    """transformers' generate() samples a model whose generation_config says do_sample (Qwen2.5-, Llama-3-Instruct),
    filters with top_k 50 unless told otherwise, and applies repetition_penalty even when greedy; snlp applies its
    flags and the config's repetition penalty. The run names what it leaves out and the flags that match, says that
    it applies the penalty, and says nothing else where both agree."""
    d, _, _ = hf_dir
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(d))
    hf.generation_config.update(do_sample=True, temperature=0.7, top_k=20, top_p=0.8, repetition_penalty=1.05)
    src = tmp_path / "sampling"
    hf.save_pretrained(str(src))
    word_tokenizer(V).save_pretrained(str(src))
    assert main(["convert", str(src), "--out", str(tmp_path / "ck")]) == 0

    def note(*flags):
        capsys.readouterr()
        assert main(["generate", str(tmp_path / "ck"), "--prompt", "t3 t7", "--max-new-tokens", "2", "--quiet",
                     *flags]) == 0
        return [line for line in capsys.readouterr().err.splitlines() if "generation_config" in line]

    greedy = note()
    assert len(greedy) == 1 and "--temperature 0.7 --top-k 20 --top-p 0.8" in greedy[0] \
        and "this run applies its repetition_penalty=1.05 as transformers' generate() does" in greedy[0]
    alike = note("--temperature", "0.7", "--top-k", "20", "--top-p", "0.8")
    assert len(alike) == 1 and "samples" not in alike[0] and "applies this model's generation_config's " \
        "repetition_penalty=1.05" in alike[0] and "does not apply" not in alike[0]
    off = note("--temperature", "0.7", "--top-k", "20", "--top-p", "0.8", "--repetition-penalty", "1")
    assert len(off) == 1 and "--repetition-penalty 1 where transformers' generate() applies" in off[0]
    assert note("--temperature", "0.7", "--top-k", "20", "--top-p", "0.8", "--repetition-penalty", "1.05") == []
    other = note("--temperature", "0.7")
    assert len(other) == 1 and "--top-k 20 --top-p 0.8" in other[0]


def test_generate_names_transformers_top_k_default_when_sampling_a_converted_model(hf_dir, tmp_path, capsys):
    d, _, _ = hf_dir  # greedy by default: nothing to say when greedy, top_k 50 when sampling
    assert main(["convert", str(d), "--out", str(tmp_path / "ck")]) == 0
    for flags, said in (((), False), (("--temperature", "0.9"), True), (("--temperature", "0.9", "--top-k", "50"),
                                                                        False)):
        capsys.readouterr()
        assert main(["generate", str(tmp_path / "ck"), "--prompt", "t3", "--max-new-tokens", "2", "--quiet",
                     *flags]) == 0
        err = capsys.readouterr().err
        assert ("--top-k 50" in err) is said, (flags, err)


@pytest.fixture(scope="module")
def peaky_llama():
    """tiny_llama with its weights scaled up: logits spread enough that temperature, top_k and top_p each change the
    sampled distribution."""
    hf = tiny_llama()
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(4)
    return hf


NOTE_CASES = [  # (generation_config, this run's temperature, top_k, top_p)
    ({"do_sample": False, "temperature": 0.6, "top_p": 0.9}, 0.8, 0, 1.0),  # a temperature beside do_sample false
    ({"temperature": 0.6}, 0.8, 50, 1.0),  # the filters agree, the config's temperature does not
    ({"do_sample": True, "min_p": 0.0, "min_new_tokens": 0}, 1.0, 50, 1.0),  # neutral processors: nothing to say
    ({}, 0.9, 0, 1.0),
    ({"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.8}, 0.5, 0, 1.0),
    # sampling at temperature 0, which generate() refuses: the note offered --temperature 0 and named generate(
    # do_sample=True), which raises; the call that decodes gives this run's temperature
    ({"do_sample": True, "temperature": 0.0, "top_k": 20}, 0.8, 0, 1.0),
]


@pytest.mark.parametrize("config,temperature,top_k,top_p", NOTE_CASES)
def test_defaults_note_flags_sample_as_the_generate_call_it_names(peaky_llama, config, temperature, top_k, top_p):
    """The reference is transformers' own generate() on this generation_config: the call the note names (or, where
    it says nothing, generate(do_sample=True), given this run's temperature where the config has none) samples from
    the distribution snlp's Sampling draws from under the flags the note gives. A config's temperature beside
    do_sample false or unset is generate(do_sample=True)'s, and was left out; min_p 0 / min_new_tokens 0 change
    nothing and were named as outputs that differ."""
    import re

    from snlp.apps.generation_defaults import defaults_note
    from snlp.decode.session import sampling

    note = defaults_note(config, temperature, top_k, top_p)
    if note is None:
        call = {"do_sample": True, **({} if "temperature" in config else {"temperature": temperature})}
        flags = (temperature, top_k, top_p)
    else:
        assert "does not apply" not in note, note  # no processor here changes the distribution
        args = re.search(r"generate\(([^)]*)\) samples", note).group(1)
        call = {k: (True if v == "True" else float(v)) for k, v in (a.split("=") for a in args.split(", "))}
        given = dict(re.findall(r"--([a-z-]+) (\S+)", re.search(r"\(give (.*) to sample alike\)", note).group(1)))
        flags = (float(given.get("temperature", temperature)), int(float(given.get("top-k", top_k))),
                 float(given.get("top-p", top_p)))
    peaky_llama.generation_config = transformers.GenerationConfig(**config)
    with torch.no_grad():
        out = peaky_llama.generate(torch.tensor([PROMPT]), max_new_tokens=1, return_dict_in_generate=True,
                                   output_scores=True, output_logits=True, pad_token_id=0, **call)
    ref = out.scores[0][0].softmax(-1)
    assert (ref > 0).sum() > 1, "the case must leave more than one token to draw from"
    ours = sampling(*flags).probs(out.logits[0][0])
    assert torch.allclose(ours, ref, rtol=0, atol=1e-6), (note, call, flags, (ours - ref).abs().max())


def test_defaults_note_names_classifier_free_guidance(peaky_llama):
    """guidance_scale != 1 is a logits processor transformers applies in greedy decoding too (the output part)."""
    from snlp.apps.generation_defaults import defaults_note

    peaky_llama.generation_config = transformers.GenerationConfig(guidance_scale=1.5)
    with torch.no_grad():
        out = peaky_llama.generate(torch.tensor([PROMPT]), max_new_tokens=1, return_dict_in_generate=True,
                                   output_scores=True, output_logits=True, pad_token_id=0)
    assert not torch.allclose(out.scores[0].log_softmax(-1), out.logits[0].log_softmax(-1))
    note = defaults_note({"guidance_scale": 1.5}, 0.0, 0, 1.0)
    assert note and "guidance_scale=1.5" in note and "does not apply" in note
    assert defaults_note({"guidance_scale": 1.0}, 0.0, 0, 1.0) is None


def sampling_checkpoint(hf_dir, tmp_path) -> None:
    """tmp_path/ck: the fixture model converted with a generation_config that samples (temperature 0.7, top_k 20,
    top_p 0.8)."""
    d, _, _ = hf_dir
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(d))
    hf.generation_config.update(do_sample=True, temperature=0.7, top_k=20, top_p=0.8)
    src = tmp_path / "sampling"
    hf.save_pretrained(str(src))
    word_tokenizer(V).save_pretrained(str(src))
    assert main(["convert", str(src), "--out", str(tmp_path / "ck")]) == 0


def test_distributed_generate_names_the_generation_defaults_too(hf_dir, tmp_path, capsys, monkeypatch):
    """`snlp generate --distributed` (one rank, torchrun's environment set by hand) samples with the same flags and
    left the converted model's do_sample / temperature / top_k / top_p unsaid: the single-process note, once."""
    from conftest import free_port

    sampling_checkpoint(hf_dir, tmp_path)
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(k, v)
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "ck"), "--distributed", "--mode", "sequential", "--plan", "2xF1-h0-K1",
                 "--prompt", "t3 t7", "--max-new-tokens", "2", "--quiet", "--device", "cpu"]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if "generation_config" in line]
    assert len(err) == 1 and "--temperature 0.7 --top-k 20 --top-p 0.8" in err[0], err


def test_generate_jacobi_is_not_told_to_sample(hf_dir, tmp_path, capsys):
    """--mode jacobi is greedy only: the note offered '--temperature 0.7 --top-k 20 --top-p 0.8 to sample alike',
    flags that mode refuses; it now names the greedy call to compare with."""
    sampling_checkpoint(hf_dir, tmp_path)
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "ck"), "--mode", "jacobi", "--plan", "2xF1-h0-K1", "--prompt", "t3 t7",
                 "--max-new-tokens", "2", "--quiet"]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if "generation_config" in line]
    assert len(err) == 1 and "--temperature" not in err[0] and "do_sample=False" in err[0], err


def test_defaults_note_names_beam_search(peaky_llama):
    """num_beams > 1 in a generation_config makes transformers' generate() search beams, greedy or not, and the
    outputs part from snlp's single sequence; the note said nothing."""
    from snlp.apps.generation_defaults import defaults_note

    outs = {}
    for beams in (1, 4):
        peaky_llama.generation_config = transformers.GenerationConfig(num_beams=beams)
        with torch.no_grad():
            outs[beams] = peaky_llama.generate(torch.tensor([PROMPT]), max_new_tokens=N, min_new_tokens=N,
                                               pad_token_id=0)[0].tolist()
    assert outs[1] != outs[4]
    note = defaults_note({"num_beams": 4}, 0.0, 0, 1.0)
    assert note and "num_beams=4" in note and "does not apply" in note
    assert defaults_note({"num_beams": 1}, 0.0, 0, 1.0) is None


@pytest.fixture(scope="module")
def penalised_dir(tmp_path_factory):
    """The fixture model with a generation_config repetition_penalty (Qwen2.5-Instruct ships 1.05; 1.6 here, so it
    moves greedy tokens), converted (`ck`) beside its transformers source (`src`)."""
    d = tmp_path_factory.mktemp("pen")
    hf = tiny_llama()
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(3)  # logits spread enough that 1.6 reorders them, not all of them
    hf.generation_config.update(repetition_penalty=1.6, eos_token_id=None)
    hf.save_pretrained(str(d / "src"))
    word_tokenizer(V).save_pretrained(str(d / "src"))
    assert main(["convert", str(d / "src"), "--out", str(d / "ck")]) == 0
    return d / "ck"


def test_generate_applies_the_generation_config_repetition_penalty(penalised_dir, tmp_path, capsys):
    """`snlp generate` on a converted model whose generation_config sets repetition_penalty: the tokens of
    transformers' generate() with that config (it applies the penalty by default, greedy included), in every mode;
    --repetition-penalty 1 gives its tokens without the penalty; a bad flag is refused before the model loads, with
    --distributed too."""
    ck = penalised_dir
    ids = " ".join(f"t{i}" for i in PROMPT[1:])  # the word tokenizer: "tI" is id I, after its BOS

    def tokens(*flags):
        out = tmp_path / "g.json"
        assert main(["generate", str(ck), "--max-new-tokens", str(N), "--quiet", "--json", str(out), *flags]) == 0
        return json.loads(out.read_text())["tokens"]

    from snlp import load

    _, tok = load(ck)
    prompt = tok.prompt_ids(ids)
    with torch.no_grad():
        src = transformers.AutoModelForCausalLM.from_pretrained(str(ck.parent / "src")).eval()
        want = src.generate(torch.tensor([prompt]), max_new_tokens=N, min_new_tokens=N,
                            pad_token_id=0)[0, len(prompt):].tolist()
        free = src.generate(torch.tensor([prompt]), max_new_tokens=N, min_new_tokens=N, pad_token_id=0,
                            repetition_penalty=1.0)[0, len(prompt):].tolist()
    assert want != free
    assert tokens("--prompt", ids) == want
    assert tokens("--prompt", ids, "--mode", "speculative", "--plan", "2xF1-h0-K1", "--no-baseline") == want
    assert tokens("--prompt", ids, "--mode", "jacobi", "--plan", "2xF2-h0-K1") == want
    assert tokens("--prompt", ids, "--repetition-penalty", "1") == free
    assert tokens("--prompt", ids, "--mode", "speculative", "--plan", "2xF1-h0-K1", "--repeats", "1") == want
    assert json.loads((tmp_path / "g.json").read_text())["matches_sequential"] is True  # its baseline penalised too
    pf = tmp_path / "prompts.txt"
    pf.write_text(f"{ids}\nt3\n")
    out = tmp_path / "b.json"
    assert main(["generate", str(ck), "--prompts-file", str(pf), "--batch-size", "2", "--max-new-tokens", str(N),
                 "--quiet", "--json", str(out), "--mode", "speculative", "--plan", "2xF1-h0-K1"]) == 0
    rec = json.loads(out.read_text())
    assert rec["results"][0]["tokens"] == want and rec["matches_sequential"] is True
    for bad in ("0", "nan", "-2"):  # a missing checkpoint: the flag is refused before anything is read
        capsys.readouterr()
        assert main(["generate", str(tmp_path / "nowhere"), "--prompt", "t3", "--repetition-penalty", bad]) == 2
        assert "--repetition-penalty must be a" in capsys.readouterr().err  # nan: the parser's own "a number"
    # --distributed applies it too (tests/dist/test_dist_penalty.py): a good one passes on to the torchrun check, a
    # bad one is refused in the flag's words before it
    assert main(["generate", str(ck), "--prompt", "t3", "--distributed", "--plan", "2xF1-h0-K1",
                 "--repetition-penalty", "1.2"]) == 2
    assert "--distributed needs the torchrun environment" in capsys.readouterr().err
    assert main(["generate", str(ck), "--prompt", "t3", "--distributed", "--plan", "2xF1-h0-K1",
                 "--repetition-penalty", "0"]) == 2
    assert "--repetition-penalty must be a finite number > 0" in capsys.readouterr().err


def test_the_benchmarks_apply_the_generation_config_repetition_penalty(penalised_dir, tmp_path):
    """`snlp bench --suite decode` and `snlp bench --decode` on a converted model whose generation_config sets a
    repetition penalty decoded without it, while the suite's transformers rows got the call's own config: now, as
    `snlp generate`, they apply it by default (the suite's reference is transformers' own generate() of the source
    model, which applies it), and --repetition-penalty 1 turns it off; the records say which value ran."""
    from snlp.bench.decode_suite import DecodeSuiteConfig, run_decode_suite

    ck, n = penalised_dir, 8
    res = run_decode_suite(DecodeSuiteConfig(ckpt=str(ck), quick=True, device="cpu", batch_sizes=(1, 2), new_tokens=n,
                                             rounds=1, warmup=0, blocks=(2,)))
    assert (res.meta.repetition_penalty, res.meta.repetition_penalty_from) == (1.6, "generation_config")
    with torch.no_grad():
        src = transformers.AutoModelForCausalLM.from_pretrained(str(ck.parent / "src")).eval()
        want = [src.generate(torch.tensor([q]), max_new_tokens=n, min_new_tokens=n, pad_token_id=0)[0, len(q):].tolist()
                for q in res.prompts]
        free = [src.generate(torch.tensor([q]), max_new_tokens=n, min_new_tokens=n, pad_token_id=0,
                             repetition_penalty=1.0)[0, len(q):].tolist() for q in res.prompts]
    assert res.reference == want and want != free
    ran = [r for r in res.rows if r.tokens_per_s is not None]
    assert any(r.library == "transformers" for r in ran) and all(r.matches_sequential for r in ran if r.exact)
    for flags, p in (([], 1.6), (["--repetition-penalty", "1"], 1.0)):
        out = tmp_path / "d.json"
        assert main(["bench", "--decode", "--ckpt", str(ck), "--plans", "2xF1-h0-K1", "--new-tokens", "4", "--runs",
                     "1", "--warmup", "0", "--json", str(out), *flags]) == 0
        rows = json.loads(out.read_text())  # a list of rows
        assert all(r["repetition_penalty"] == p for r in rows), rows
        assert all(r["matches_sequential"] for r in rows if r["mode"] != "snlp"), rows  # K = 1 < C: approximate


def test_an_integer_generation_config_penalty_is_refused_as_transformers_refuses_it(penalised_dir, tmp_path, capsys):
    """A generation_config.json that writes repetition_penalty as an integer (2 for 2.0): transformers' generate()
    raises on it (its RepetitionPenaltyLogitsProcessor takes a float; at 1 it builds none), while snlp applied 2.0,
    so the two parted silently. Now snlp refuses it in one line, as transformers does; 1 and 2.0 still decode."""
    import shutil

    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    from snlp.io.generation import config_repetition_penalty

    with pytest.raises(ValueError):  # the reference: transformers itself
        RepetitionPenaltyLogitsProcessor(2)
    RepetitionPenaltyLogitsProcessor(2.0)
    with pytest.raises(ValueError, match=r"repetition_penalty=2, an integer, which transformers' generate\(\) "
                                         r"refuses too .*write 2.0") as err:
        config_repetition_penalty({"repetition_penalty": 2})
    assert "\n" not in str(err.value)
    assert config_repetition_penalty({"repetition_penalty": 1}) == 1.0
    assert config_repetition_penalty({"repetition_penalty": 2.0}) == 2.0
    ck = tmp_path / "ck"
    shutil.copytree(penalised_dir, ck)
    meta_file = ck / "tokenizer_meta.json"
    meta = json.loads(meta_file.read_text())
    meta["generation_config"]["repetition_penalty"] = 2
    meta_file.write_text(json.dumps(meta))
    capsys.readouterr()
    assert main(["generate", str(ck), "--prompt", "t3", "--max-new-tokens", "2", "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert "repetition_penalty=2, an integer" in err and "\n" not in err, err
    assert main(["generate", str(ck), "--prompt", "t3", "--max-new-tokens", "2", "--quiet",
                 "--repetition-penalty", "2"]) == 0  # the flag overrides the config's value, as in transformers
    assert "transformers' generate() raises on this model's generation_config's repetition_penalty=2 unless the call " \
           "gives one; this run applies --repetition-penalty 2" in capsys.readouterr().err


def test_generate_json_records_the_penalty_that_ran_and_its_source(hf_dir, tmp_path):
    """`snlp generate --json` did not record the repetition penalty it applied (a converted model's
    generation_config value ran unrecorded): the record now holds the value every decode applied and its source,
    flag / generation_config / default, for --prompt and --prompts-file; the tokens are the penalised decode's."""
    d, _, _ = hf_dir
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(d))
    hf.generation_config.update(repetition_penalty=1.3)
    src = tmp_path / "pen"
    hf.save_pretrained(str(src))
    word_tokenizer(V).save_pretrained(str(src))
    assert main(["convert", str(src), "--out", str(tmp_path / "ck")]) == 0
    assert main(["convert", str(d), "--out", str(tmp_path / "plain")]) == 0
    prompts = tmp_path / "p.txt"
    prompts.write_text("t3 t7\nt5\n")
    model, tok = load(tmp_path / "ck")
    for ck, flags, want in (("ck", [], (1.3, "generation_config")), ("ck", ["--repetition-penalty", "1.1"],
                                                                     (1.1, "flag")),
                            ("plain", [], (1.0, "default"))):
        for where in (["--prompt", "t3 t7"], ["--prompts-file", str(prompts)]):
            out = tmp_path / "g.json"
            assert main(["generate", str(tmp_path / ck), *where, "--max-new-tokens", "6", "--quiet", "--json",
                         str(out), *flags]) == 0
            rec = json.loads(out.read_text())
            sampling = rec["sampling"]  # the one place the penalty and its source are recorded
            assert (sampling["repetition_penalty"], sampling["repetition_penalty_source"]) == want, (ck, flags, where)
            assert "repetition_penalty" not in rec and "repetition_penalty_source" not in rec
            if ck == "ck" and where[0] == "--prompt":
                ref = sequential_generate(model, tok.prompt_ids("t3 t7"), 6, eos_id=list(tok.stop_ids),
                                          repetition_penalty=want[0]).tokens
                assert rec["tokens"] == ref


@pytest.mark.parametrize("config", [{"penalty_alpha": 0.6}, {"penalty_alpha": 0.6, "top_k": 1}, {"penalty_alpha": 0.0},
                                    {"penalty_alpha": 0.6, "top_k": 4}, {"dola_layers": "low"},
                                    {"force_words_ids": [[5]]}, {"num_beams": 2}, {}])
@pytest.mark.parametrize("sampling", [False, True])
def test_a_generation_config_is_named_exactly_where_transformers_leaves_greedy_or_sampling(config, sampling):
    """penalty_alpha (contrastive search), dola_layers (DoLa) and force_words_ids (constrained beam search) in a
    converted model's generation_config were read by no check: snlp generate said nothing and the harness decoded
    greedily where transformers' generate() runs (or, in transformers 5, refuses without trust_remote_code) another
    mode. The law: a config is named exactly where GenerationConfig.get_generation_mode is neither greedy nor sample."""
    import transformers

    from snlp.io.generation import unapplied_defaults

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gc = transformers.GenerationConfig(**config, do_sample=sampling)
        # what generate() does before it picks the mode (_prepare_generation_config): unset fields get its defaults
        gc.update(**gc._get_default_generation_params(), defaults_only=True)
        mode = gc.get_generation_mode()
    assert bool(unapplied_defaults(config, sampling)) == (mode not in ("greedy_search", "sample")), (config, mode)


def test_generate_names_a_penalty_only_its_flag_applies(tmp_path, capsys):
    """--repetition-penalty P on a converted model whose generation_config sets none: transformers' generate() applies
    none, so the outputs part; the note said nothing (it named a difference only where the config set a penalty).
    The reference: transformers' own generate() of the source model, without and with the penalty."""
    hf = tiny_llama()
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(3)  # logits spread enough that 1.6 reorders them (as penalised_dir)
    hf.generation_config.update(eos_token_id=None)
    hf.save_pretrained(str(tmp_path / "src"))
    word_tokenizer(V).save_pretrained(str(tmp_path / "src"))
    assert main(["convert", str(tmp_path / "src"), "--out", str(tmp_path / "ck")]) == 0
    ids = " ".join(f"t{i}" for i in PROMPT[1:])
    _, tok = load(tmp_path / "ck")
    prompt = tok.prompt_ids(ids)
    with torch.no_grad():
        src = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "src")).eval()
        default = src.generate(torch.tensor([prompt]), max_new_tokens=N, min_new_tokens=N,
                               pad_token_id=0)[0, len(prompt):].tolist()
        penalised = src.generate(torch.tensor([prompt]), max_new_tokens=N, min_new_tokens=N, pad_token_id=0,
                                 repetition_penalty=1.6)[0, len(prompt):].tolist()
    assert default != penalised

    def run(*flags):
        capsys.readouterr()
        out = tmp_path / "g.json"
        assert main(["generate", str(tmp_path / "ck"), "--prompt", ids, "--max-new-tokens", str(N), "--quiet",
                     "--json", str(out), *flags]) == 0
        return json.loads(out.read_text())["tokens"], [ln for ln in capsys.readouterr().err.splitlines()
                                                       if "generation_config" in ln]

    tokens, note = run("--repetition-penalty", "1.6")
    assert tokens == penalised and len(note) == 1, note
    assert "this run applies --repetition-penalty 1.6 where transformers' generate() applies none" in note[0] \
        and "outputs differ" in note[0]
    for flags in ((), ("--repetition-penalty", "1")):  # what generate() does: nothing to say
        tokens, note = run(*flags)
        assert tokens == default and note == [], (flags, note)


def converted_with_generation_config(hf_dir, tmp_path, **update) -> tuple:
    """(checkpoint dir, its tokenizer meta): `hf_dir` converted, its generation_config updated with `update`."""
    d, _, _ = hf_dir
    ck = tmp_path / "ck"
    assert main(["convert", str(d), "--out", str(ck)]) == 0
    meta_file = ck / "tokenizer_meta.json"
    meta = json.loads(meta_file.read_text())
    meta["generation_config"].update(update)
    meta_file.write_text(json.dumps(meta))
    return ck, meta


def test_generate_on_a_config_sampling_at_temperature_0_offers_no_temperature_0(hf_dir, tmp_path, capsys):
    """A generation_config with do_sample true at temperature 0 (transformers' generate() raises on it): the note
    said generate() "draws by default" and offered "--temperature 0 ... to sample alike", greedy decoding; it now
    says generate() refuses it, and names the call each run compares with."""
    d, _, _ = hf_dir
    ck, meta = converted_with_generation_config(hf_dir, tmp_path, do_sample=True, temperature=0.0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(d)).eval()
    hf.generation_config = transformers.GenerationConfig(**meta["generation_config"])
    with torch.no_grad(), pytest.raises(ValueError, match="temperature"):  # the reference: transformers refuses it
        hf.generate(torch.tensor([PROMPT]), max_new_tokens=2, pad_token_id=0)

    def note(*flags):
        capsys.readouterr()
        assert main(["generate", str(ck), "--prompt", "t3 t7", "--max-new-tokens", "2", "--quiet", *flags]) == 0
        return [ln for ln in capsys.readouterr().err.splitlines() if "generation_config" in ln]

    greedy = note()
    assert len(greedy) == 1 and "refuses" in greedy[0] and "generate(do_sample=False)" in greedy[0] \
        and "--temperature" not in greedy[0] and "draws by default" not in greedy[0], greedy
    sampled = note("--temperature", "0.7", "--top-k", "50")
    assert len(sampled) == 1 and "refuses" in sampled[0] and "--temperature 0 " not in sampled[0] \
        and "compare this run with generate(do_sample=True, temperature=0.7)" in sampled[0], sampled


def test_the_note_says_which_values_are_transformers_defaults(hf_dir, tmp_path, capsys):
    """A generation_config that samples at temperature 0.7 and sets no top_k / top_p: generate() fills those with its
    own defaults (top_k 50, top_p 1), and the note named all three "(its generation_config)" to a run given
    --top-k 20. Each value's source is now said; the values are generate()'s own (the reference: transformers'
    default generation parameters)."""
    ck, meta = converted_with_generation_config(hf_dir, tmp_path, do_sample=True, temperature=0.7)
    assert meta["generation_config"].get("top_k") is None and meta["generation_config"].get("top_p") is None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        filled = transformers.GenerationConfig()._get_default_generation_params()
    assert (filled["top_k"], filled["top_p"]) == (50, 1.0)
    for flags, said in ((["--temperature", "0.7", "--top-k", "20"], "top_k 50, top_p 1 (its generation_config; "
                                                                    "top_k, top_p transformers' defaults)"),
                        ([], "(temperature 0.7, top_k 50, top_p 1; top_k, top_p transformers' defaults)")):
        capsys.readouterr()
        assert main(["generate", str(ck), "--prompt", "t3 t7", "--max-new-tokens", "2", "--quiet", *flags]) == 0
        note = [ln for ln in capsys.readouterr().err.splitlines() if "generation_config" in ln]
        assert len(note) == 1 and said in note[0], (flags, note)
