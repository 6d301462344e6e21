"""snlp as an lm-evaluation-harness model, against the harness's own `hf` model (HFLM) on the SAME
transformers checkpoint: the real SmolLM2-135M-Instruct cut to its first 6 layers (both sides load the one
exported directory), on the tiny offline tasks of tests/data/harness/ (ARC-style multiple choice with 2-shot,
greedy generation, document log-likelihood).

Invariants: per-request log-likelihoods within 1e-4 and identical acc / acc_norm; identical greedy answers and
rolling log-likelihoods; an M = 1 (F1) plan with K >= C reproduces the sequential numbers; self-speculative decoding with a plan
or an (adapted) drafter answers as the model does, while loglikelihood goes through the drafter's own weights.
Nothing reaches a hub: the tasks read local JSON files, HF_HUB_OFFLINE / HF_DATASETS_OFFLINE are set."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before datasets / huggingface_hub read them
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

from harness_fixtures import DATA, base, hf, offline, run, tasks  # noqa: E402,F401
import lm_eval  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from lm_eval.utils import simple_parse_args_string  # noqa: E402

from snlp.apps.cli import main  # noqa: E402
from snlp.eval.harness import SNLPLM  # noqa: E402
from snlp.io.drafter import save_drafter  # noqa: E402
from snlp.method.drafter import make_drafter  # noqa: E402
from snlp.method.plan import Plan  # noqa: E402
from snlp.io.tokenizer import Tokenizer  # noqa: E402

from conftest import blowup_model, make_model  # noqa: E402

FIXTURES = (base, hf, offline, tasks)  # pytest finds these fixtures by their names in this module (offline is autouse)

pytestmark = pytest.mark.usefixtures("one_thread")

EXACT, APPROX = "4xF1-h0-K4", "4xF1-h0-K1"  # F1 with K >= C: the sequential model; K = 1: an approximation


@pytest.fixture(scope="module")
def both(hf, base, tasks):
    """Each task through the harness's hf model (batch 1) and SNLPLM (batch 4, ragged): {task: (hf, ours)}."""
    tm = TaskManager(include_path=str(tasks), include_defaults=False)
    ours = SNLPLM(pretrained=base[0], tokenizer=base[1], batch_size=4)
    spec = {"snlp_arc_tiny": 2, "snlp_gen_tiny": 0, "snlp_text_tiny": 0}
    return {t: (run(hf, tm, t, k), run(ours, tm, t, k)) for t, k in spec.items()}


def samples(result, task):
    return result["samples"][task]


def lls(result, task) -> list[float]:
    return [r[0][0] if isinstance(r[0], (list, tuple)) else r[0] for s in samples(result, task) for r in s["resps"]]


def requests(result, task, kind) -> list[Instance]:
    return [Instance(request_type=kind, doc=s["doc"], arguments=tuple(a), idx=i)
            for s in samples(result, task) for i, a in enumerate(s["arguments"])]


def test_loglikelihood_matches_hf_model(both):
    hf, ours = both["snlp_arc_tiny"]
    a, b = samples(hf, "snlp_arc_tiny"), samples(ours, "snlp_arc_tiny")
    assert [s["arguments"] for s in a] == [s["arguments"] for s in b]  # same 2-shot prompts (same seed)
    assert "Answer:" in a[0]["arguments"][0][0].split("\n\n")[0]  # really 2-shot
    ref, got = torch.tensor(lls(hf, "snlp_arc_tiny")), torch.tensor(lls(ours, "snlp_arc_tiny"))
    assert len(ref) == 24 and (ref != 0).all()
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    for m in ("acc,none", "acc_norm,none", "acc_stderr,none", "acc_norm_stderr,none"):
        assert ours["results"]["snlp_arc_tiny"][m] == hf["results"]["snlp_arc_tiny"][m], m
    assert [s["acc"] for s in a] == [s["acc"] for s in b] and [s["acc_norm"] for s in a] == [s["acc_norm"] for s in b]


def test_rolling_loglikelihood_matches_hf_model(both):
    hf, ours = both["snlp_text_tiny"]
    torch.testing.assert_close(torch.tensor(lls(ours, "snlp_text_tiny"), dtype=torch.float64),
                               torch.tensor(lls(hf, "snlp_text_tiny"), dtype=torch.float64), atol=1e-3, rtol=1e-5)
    for m in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert ours["results"]["snlp_text_tiny"][m] == pytest.approx(hf["results"]["snlp_text_tiny"][m], rel=1e-5)


def test_generate_until_matches_hf_model(both):
    hf, ours = both["snlp_gen_tiny"]
    ref = [s["resps"] for s in samples(hf, "snlp_gen_tiny")]
    assert [s["resps"] for s in samples(ours, "snlp_gen_tiny")] == ref
    assert any(r[0][0].strip() for r in ref)  # something was generated


def test_exact_plan_gives_sequential_numbers(both, base, tasks):
    """F1 (M = 1) with K >= C: the plan's solve is the sequential forward, so every request's log-likelihood and the metrics are
    the sequential ones; a K = 1 plan really runs (its numbers differ)."""
    _, seq = both["snlp_arc_tiny"]
    reqs = requests(seq, "snlp_arc_tiny", "loglikelihood")
    ref = [r for s in samples(seq, "snlp_arc_tiny") for r in s["filtered_resps"]]
    exact = SNLPLM(pretrained=base[0], tokenizer=base[1], plan=EXACT, batch_size=3).loglikelihood(reqs)
    torch.testing.assert_close(torch.tensor([x[0] for x in exact]), torch.tensor([x[0] for x in ref]),
                               atol=1e-5, rtol=0)
    assert [x[1] for x in exact] == [x[1] for x in ref]
    approx = SNLPLM(pretrained=base[0], tokenizer=base[1], plan=APPROX, batch_size=3).loglikelihood(reqs)
    assert max(abs(a[0] - b[0]) for a, b in zip(approx, ref)) > 1e-2
    tm = TaskManager(include_path=str(tasks), include_defaults=False)
    r = run(SNLPLM(pretrained=base[0], tokenizer=base[1], plan=EXACT, batch_size=4), tm, "snlp_arc_tiny", 2)
    for m in ("acc,none", "acc_norm,none"):
        assert r["results"]["snlp_arc_tiny"][m] == seq["results"]["snlp_arc_tiny"][m]


@pytest.mark.slow  # speculative + drafter harness runs of the cut SmolLM2 (CI runs -m slow)
def test_speculative_and_drafter_answers_equal_the_model(both, base, tmp_path):
    """generate_until through self-speculative decoding (the plan's own forward drafting, or an adapted drafter's)
    answers exactly as the model (= the hf model's greedy answers); the drafter's loglikelihood is its own
    approximation: F1 with K >= C gives the drafter's sequential forward, not the base's."""
    model, tok = base
    hf, _ = both["snlp_gen_tiny"]
    reqs = requests(hf, "snlp_gen_tiny", "generate_until")
    ref = [s["resps"][0][0] for s in samples(hf, "snlp_gen_tiny")]
    spec = SNLPLM(pretrained=model, tokenizer=tok, plan=APPROX, decode="speculative", block=3, batch_size=4)
    assert spec.generate_until(reqs) == ref

    d = make_drafter(model, APPROX)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # an "adapted" suffix: the drafter's own weights, not the base's
        for block in d.model.blocks[d.suffix_start:]:
            for p in block.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.02)
    save_drafter(tmp_path / "drafter", d)
    lm = SNLPLM(pretrained=model, tokenizer=tok, drafter=str(tmp_path / "drafter"), batch_size=4)
    assert lm.decode == "speculative" and lm.method == f"drafter:{APPROX}"
    assert lm.generate_until(reqs) == ref

    _, seq = both["snlp_arc_tiny"]
    ll = requests(seq, "snlp_arc_tiny", "loglikelihood")[:8]
    own = SNLPLM(pretrained=model, tokenizer=tok, drafter=str(tmp_path / "drafter"), plan=EXACT).loglikelihood(ll)
    ref_d = SNLPLM(pretrained=d.model, tokenizer=tok).loglikelihood(ll)  # the drafter's model run sequentially
    base_ll = SNLPLM(pretrained=model, tokenizer=tok).loglikelihood(ll)
    torch.testing.assert_close(torch.tensor([x[0] for x in own]), torch.tensor([x[0] for x in ref_d]), atol=1e-4, rtol=0)
    assert max(abs(a[0] - b[0]) for a, b in zip(own, base_ll)) > 1e-3


def test_chat_template_as_hf_model(hf, base):
    model, tok = base
    ours = SNLPLM(pretrained=model, tokenizer=tok)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Question: 2 + 2?\nAnswer:"}]
    for history, gen in ((chat, True), (chat + [{"role": "assistant", "content": "4"}], False)):
        text = ours.apply_chat_template(history, add_generation_prompt=gen)
        assert text == hf.apply_chat_template(history, add_generation_prompt=gen)
        assert ours.tok_encode(text) == hf.tok_encode(text)
    assert ours.chat_template(True) == hf.chat_template(True)
    assert ours.tok_encode("Question: why?") == hf.tok_encode("Question: why?")


@pytest.mark.slow
def test_cli_harness_one_run_per_method(smol_cut_hf, base, tasks, tmp_path, capsys):
    """`snlp eval --harness`: one harness JSON per method (sequential, a plan, a drafter whose plan is that same plan:
    three files), each recording in its config the model_args that produced it, in the harness's own `key=value`
    form, and beside them batch_size and device, which the harness passes again itself (in model_args they made
    `simple_evaluate(model="snlp", model_args=..., batch_size=...)` and the harness's CLI fail: got multiple values
    for 'batch_size'); the harness rebuilds the model from them, and the rebuilt model's run gives the same numbers.
    The checkpoint's path holds a '=', which model_args carry as it is."""
    save_drafter(tmp_path / "drafter", make_drafter(base[0], EXACT))  # an unadapted copy: K >= C, the model itself
    ckpt = tmp_path / "smol=cut"
    ckpt.symlink_to(smol_cut_hf, target_is_directory=True)
    out = tmp_path / "out"
    assert main(["eval", str(ckpt), "--harness", "snlp_arc_tiny", "--harness-include", str(tasks), "--plans",
                 EXACT, "--drafter", str(tmp_path / "drafter"), "--num-fewshot", "1", "--limit", "3", "--batch", "4",
                 "--harness-out", str(out), "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    files = {"sequential": "sequential", EXACT: EXACT, f"drafter:{EXACT}": f"drafter_{EXACT}"}
    runs = {m: json.loads((out / f"{f}.json").read_text()) for m, f in files.items()}
    assert sorted(p.name for p in out.iterdir()) == sorted([f"{f}.json" for f in files.values()] + ["table.md"])
    for m, r in runs.items():
        assert r["n-shot"]["snlp_arc_tiny"] == 1 and "acc_norm,none" in r["results"]["snlp_arc_tiny"], m
        assert m in printed
        cfg = r["config"]
        args = simple_parse_args_string(cfg["model_args"])  # the harness's own parser of --model_args
        assert cfg["model"] == "snlp" and cfg["batch_size"] == 4 and cfg["device"] == "cpu", m
        want = {"pretrained": str(ckpt), "dtype": "float32", "block": 4,
                "decode": {"sequential": "sequential", EXACT: "snlp"}.get(m, "speculative")}
        assert {k: args.get(k) for k in want} == want and not {"batch_size", "device"} & set(args), m
        assert args.get("plan") == (None if m == "sequential" else EXACT), m
        assert args.get("drafter") == (str(tmp_path / "drafter") if m.startswith("drafter") else None), m
        rebuilt = get_model(cfg["model"]).create_from_arg_string(cfg["model_args"],
                                                                 dict(batch_size=cfg["batch_size"], device=cfg["device"]))
        assert rebuilt.method == m and rebuilt.model_args == cfg["model_args"] and rebuilt.batch_size == 4, m
    seq, ex = runs["sequential"]["results"]["snlp_arc_tiny"], runs[EXACT]["results"]["snlp_arc_tiny"]
    assert seq["acc,none"] == ex["acc,none"] and seq["acc_norm,none"] == ex["acc_norm,none"]
    for m in (EXACT, f"drafter:{EXACT}"):  # the harness's own rebuild: by name, with its own batch_size / device
        cfg = runs[m]["config"]
        again = lm_eval.simple_evaluate(model=cfg["model"], model_args=cfg["model_args"], batch_size=cfg["batch_size"],
                                        device=cfg["device"], tasks=["snlp_arc_tiny"], num_fewshot=1, limit=3,
                                        bootstrap_iters=10,
                                        task_manager=TaskManager(include_path=str(tasks), include_defaults=False))
        assert again["config"]["model_args"] == cfg["model_args"]
        for k in ("acc,none", "acc_norm,none", "acc_stderr,none"):
            assert again["results"]["snlp_arc_tiny"][k] == runs[m]["results"]["snlp_arc_tiny"][k], (m, k)
    table = (out / "table.md").read_text()
    assert f"| Task | Metric | Filter | sequential | {EXACT} | drafter:{EXACT} |" in table
    assert "| snlp_arc_tiny | acc |" in table and " ± " in table


@pytest.mark.slow  # a second lm-eval run through its own CLI (CI runs -m slow)
def test_documented_rerun_command_rebuilds_a_column(smol_cut_hf, tasks, tmp_path):
    """docs/harness.md's rerun of one column: the harness's own CLI (lm-eval's `cli_evaluate`, with snlp.eval.harness
    imported: lm-eval has no plugin discovery, so the bare `lm_eval` command does not know `snlp`) given the
    recorded model_args, batch_size and device, prints the recorded metrics."""
    lm = SNLPLM(pretrained=str(smol_cut_hf), plan=APPROX, batch_size=3, device="cpu")
    r = lm_eval.simple_evaluate(model=lm, model_args=lm.model_args, tasks=["snlp_arc_tiny"], num_fewshot=0, limit=3,
                                bootstrap_iters=0, batch_size=lm.batch_size, device=str(lm.device),
                                task_manager=TaskManager(include_path=str(tasks), include_defaults=False))
    cfg, acc = r["config"], r["results"]["snlp_arc_tiny"]
    run_cli = ('import sys, snlp.eval.harness; from lm_eval.__main__ import cli_evaluate; sys.argv[0] = "lm_eval"; '
               'cli_evaluate()')
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    p = subprocess.run([sys.executable, "-c", run_cli, "--model", "snlp", "--model_args", cfg["model_args"],
                        "--batch_size", str(cfg["batch_size"]), "--device", cfg["device"], "--tasks", "snlp_arc_tiny",
                        "--include_path", str(tasks), "--num_fewshot", "0", "--limit", "3", "--output_path",
                        str(tmp_path / "out")], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())
    # the CLI records model_args parsed (a dict): the recorded string, read by the harness's own parser
    assert out["config"]["model_args"] == simple_parse_args_string(cfg["model_args"])
    assert str(out["config"]["batch_size"]) == "3"  # the CLI keeps its argument as text
    for k in ("acc,none", "acc_norm,none"):
        assert out["results"]["snlp_arc_tiny"][k] == acc[k], k


def test_cli_harness_refuses_a_path_with_a_comma_before_any_work(tmp_path, capsys):
    """A ',' cannot be carried by the recorded model_args (lm-eval splits there): refused in one line before the
    checkpoint is loaded (it does not even exist) and nothing written."""
    out = tmp_path / "out"
    assert main(["eval", str(tmp_path / "a,b"), "--harness", "snlp_arc_tiny", "--harness-out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds a ','" in err and len(err.splitlines()) == 1 and not out.exists(), err


@pytest.mark.parametrize("plans,says", [
    (f"{APPROX},{APPROX}", f"--plans lists {APPROX} twice: "),
    ("4xF1-K1,4xF1-h0-K1", f"lists {APPROX} twice (4xF1-K1 and {APPROX} are one plan)"),
    (f"{EXACT},4xF1-h0-K4-order:forward", f"lists {EXACT} twice ({EXACT} and 4xF1-h0-K4-order:forward are one plan)")])
def test_cli_harness_refuses_a_plan_twice_before_any_work(tmp_path, capsys, plans, says):
    """A plan listed twice, or two spellings of one canonical plan, would overwrite its own harness JSON: a one-line
    ValueError before anything is loaded (the checkpoint here does not even exist) and nothing written."""
    out = tmp_path / "out"
    assert main(["eval", str(tmp_path / "no-such-ckpt"), "--harness", "snlp_arc_tiny", "--plans", plans,
                 "--harness-out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1 and not out.exists(), err


def test_cli_harness_refuses_an_unknown_task_before_the_model_loads(tmp_path, capsys, tasks):
    """A typo'd task name was lm-eval's KeyError traceback after the checkpoint had loaded: now one line naming it
    and the closest names, before the checkpoint is read (here it does not even exist), nothing written."""
    out = tmp_path / "out"
    assert main(["eval", str(tmp_path / "no-such-ckpt"), "--harness", "snlp_arc_tinyy", "--harness-include",
                 str(tasks), "--harness-out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "no task named snlp_arc_tinyy" in err and "did you mean snlp_arc_tiny" in err, err
    assert len(err.splitlines()) == 1 and not out.exists(), err


def test_cli_harness_refuses_an_out_that_holds_an_earlier_runs_files(smol_cut_hf, tasks, tmp_path, capsys):
    """A second run into the same --harness-out replaced the earlier run's files of its methods and left the others
    beside them (one folder, two runs' results): refused before any harness run, the files kept."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "sequential.json").write_text('{"an earlier run": 1}')
    assert main(["eval", str(smol_cut_hf), "--harness", "snlp_arc_tiny", "--harness-include", str(tasks), "--limit",
                 "1", "--harness-out", str(out), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after transformers' loading bar
    assert err.startswith("snlp eval: error: ") and "already holds sequential.json of an earlier run" in err, err
    assert [p.name for p in out.iterdir()] == ["sequential.json"]
    assert json.loads((out / "sequential.json").read_text()) == {"an earlier run": 1}


def test_cli_harness_refuses_an_earlier_runs_out_before_loading_and_names_force(tasks, tmp_path, capsys):
    """The refusal of a --harness-out holding an earlier run's files comes before the checkpoint is read (here it
    does not even exist; it came after the model loaded and every plan was bound) and names --force; a drafter's
    file (drafter_PLAN.json, its plan read from drafter.json) counts too."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "4xF1-h0-K1.json").write_text('{"an earlier run": 1}')
    assert main(["eval", str(tmp_path / "no-such-ckpt"), "--harness", "snlp_arc_tiny", "--harness-include", str(tasks),
                 "--plans", "4xF1-K1", "--harness-out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"snlp eval: error: --harness-out {out} already holds 4xF1-h0-K1.json of an earlier run; this run "
                   f"would replace it: choose another --harness-out, pass --force to replace it, or move it away"), err
    d = save_drafter(tmp_path / "dr", make_drafter(make_model(n_layer=4), Plan.parse("2xF2-h0-K1")))
    (out / "drafter_2xF2-h0-K1.json").write_text("{}")
    assert main(["eval", str(tmp_path / "no-such-ckpt"), "--harness", "snlp_arc_tiny", "--harness-include", str(tasks),
                 "--drafter", str(d), "--harness-out", str(out)]) == 2
    assert "already holds drafter_2xF2-h0-K1.json of an earlier run" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["4xF1-h0-K1.json", "drafter_2xF2-h0-K1.json"]


def test_cli_harness_force_replaces_only_the_files_the_run_writes(tasks, tmp_path, capsys):
    """--force: the earlier run's files this run writes (its methods' JSON, table.md) are replaced by the new run's,
    a file the run does not write is left as it is and named, and the run's own results are written."""
    from snlp.io.checkpoint import save_checkpoint

    tok = Tokenizer.train(["Question: which cat sat on the mat? Answer: the cat. a dog ran in the park. " * 4], 300)
    ckpt = save_checkpoint(tmp_path / "tiny", make_model(vocab_size=tok.vocab_size, n_layer=2, dtype=torch.float32,
                                                         sequence_len=256), tokenizer=tok)
    out = tmp_path / "out"
    out.mkdir()
    for name in ("sequential.json", "table.md", "2xF1-h0-K2.json", "notes.txt"):
        (out / name).write_text("an earlier run's\n")
    assert main(["eval", str(ckpt), "--harness", "snlp_arc_tiny", "--harness-include", str(tasks), "--limit", "1",
                 "--num-fewshot", "0", "--plans", "2xF1-h0-K1", "--harness-out", str(out), "--device", "cpu",
                 "--force"]) == 0
    err = capsys.readouterr().err
    assert f"snlp eval: --force: removed sequential.json, table.md from {out}; left 2xF1-h0-K2.json, notes.txt (not " \
           f"written by this run)" in err, err
    assert sorted(p.name for p in out.iterdir()) == ["2xF1-h0-K1.json", "2xF1-h0-K2.json", "notes.txt",
                                                     "sequential.json", "table.md"]
    for name in ("sequential.json", "2xF1-h0-K1.json"):
        assert "snlp_arc_tiny" in json.loads((out / name).read_text())["results"], name
    assert "2xF1-h0-K1" in (out / "table.md").read_text()
    assert (out / "2xF1-h0-K2.json").read_text() == (out / "notes.txt").read_text() == "an earlier run's\n"


def test_cli_harness_cut_short_keeps_the_finished_methods(tasks, tmp_path, capsys, monkeypatch):
    """Each method is its own harness run: a run cut short (here Ctrl-C as the second method starts) keeps the
    finished methods' JSON, table.md and --json marked partial, and says where; the results were written only after
    the last method."""
    import lm_eval

    from snlp.io.checkpoint import save_checkpoint

    tok = Tokenizer.train(["Question: which cat sat on the mat? Answer: the cat. a dog ran in the park. " * 4], 300)
    ckpt = save_checkpoint(tmp_path / "tiny", make_model(vocab_size=tok.vocab_size, n_layer=2, dtype=torch.float32,
                                                         sequence_len=256), tokenizer=tok)
    real, calls = lm_eval.simple_evaluate, []

    def cut_second(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(lm_eval, "simple_evaluate", cut_second)
    out = tmp_path / "out"
    assert main(["eval", str(ckpt), "--harness", "snlp_arc_tiny", "--harness-include", str(tasks), "--limit", "1",
                 "--num-fewshot", "0", "--plans", "2xF1-h0-K1", "--harness-out", str(out), "--device", "cpu",
                 "--json", str(tmp_path / "h.json")]) == 130
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"snlp eval: interrupted; kept the results of 1 of 2 methods (sequential) in {out}"), line
    assert sorted(p.name for p in out.iterdir()) == ["sequential.json", "table.md"]
    assert "snlp_arc_tiny" in json.loads((out / "sequential.json").read_text())["results"]
    assert "**PARTIAL**" in (out / "table.md").read_text()
    assert json.loads((tmp_path / "h.json").read_text())["complete"] is False


@pytest.mark.parametrize("kw,says", [(dict(max_length=0), "max_length must be >= 1"),
                                     (dict(block=0), "block (the speculative draft length) must be >= 1"),
                                     (dict(decode="greedy"), "decode='greedy': use one of"),
                                     (dict(plan="4xF1-h0-K1-tol:-1"), "tol must be a positive number, got '-1'")])
def test_harness_model_args_are_checked_before_the_model_loads(tmp_path, kw, says):
    """A bad max_length / block / decode / plan string was refused only after the checkpoint (and a drafter) had
    loaded: here the checkpoint does not even exist, and the error is about the argument."""
    with pytest.raises(ValueError, match=re.escape(says)):
        SNLPLM(pretrained=str(tmp_path / "no-such-ckpt"), **kw)


@pytest.mark.parametrize("kw,says", [(dict(block=2.5), "block (the speculative draft length) must be an integer"),
                                     (dict(block=True), "block (the speculative draft length) must be an integer"),
                                     (dict(max_length=8.5), "max_length must be an integer, got 8.5"),
                                     (dict(batch_size=2.5), "batch_size must be an integer, got 2.5"),
                                     (dict(batch_size="2.5"), "batch_size must be an integer, got '2.5'"),
                                     (dict(max_batch_size=3.5), "max_batch_size must be an integer, got 3.5"),
                                     (dict(max_batch_size=0), "max_batch_size must be >= 1, got 0")])
def test_numeric_harness_model_args_are_integers_never_truncated(tmp_path, kw, says):
    """block=2.5 (model_args types "2.5" as a float) was int()-truncated to 2, max_length / batch_size alike, and
    model_args then recorded a value nobody gave; each is refused in one line before the model loads, as seed= is."""
    with pytest.raises(ValueError, match=re.escape(says)):
        SNLPLM(pretrained=str(tmp_path / "no-such-ckpt"), **kw)


def test_a_model_without_tokenizer_is_named_in_one_line(tmp_path):
    """`snlp eval HF_DIR --harness ...` on a transformers directory without tokenizer.json printed the whole model's
    repr (hundreds of lines, the GPT object) before ": no tokenizer". The message names the source, in one line."""
    with pytest.raises(ValueError) as e:
        SNLPLM(pretrained=make_model(n_layer=2), name="runs/x")
    assert str(e.value).startswith("runs/x: no tokenizer") and "\n" not in str(e.value)
    with pytest.raises(ValueError, match="^the model: no tokenizer"):
        SNLPLM(pretrained=make_model(n_layer=2))


def test_a_transformers_model_object_is_refused_with_the_way_to_convert_it():
    """pretrained=<a transformers model> was taken for a path (its repr: "File name too long", 2 s in)."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2))
    with pytest.raises(TypeError, match=r"^pretrained is a LlamaForCausalLM \(transformers\), not an snlp GPT: .*from_hf"):
        SNLPLM(pretrained=hf)


def test_method_files_refuse_any_collision():
    """Names that map to one file (or differ only in case, as on a case-insensitive file system) are refused too:
    with the current names a drafter's file (drafter_PLAN.json) cannot meet a plan's (PLAN.json), this checks the
    rule itself."""
    from snlp.apps.eval_harness import check_method_files, method_file

    check_method_files(["sequential", APPROX, f"drafter:{APPROX}"])  # three distinct files
    assert method_file(f"drafter:{APPROX}") == f"drafter_{APPROX}.json"
    with pytest.raises(ValueError, match="would both be written to drafter_x.json"):
        check_method_files(["sequential", "drafter:x", "drafter_x"])
    with pytest.raises(ValueError, match="would both be written"):
        check_method_files(["sequential", "Sequential"])


def test_registered_and_refusals(smol_cut_hf, base):
    model, tok = base
    lm = get_model("snlp").create_from_arg_string(f"pretrained={smol_cut_hf},plan={APPROX},batch_size=2")
    assert isinstance(lm, SNLPLM) and str(lm.plan) == APPROX and lm.batch_size == 2 and lm.decode == "snlp"
    with pytest.raises(ValueError, match="unknown model_args"):
        SNLPLM(pretrained=model, tokenizer=tok, temprature=0.5)
    with pytest.raises(ValueError, match="decode=speculative needs a plan"):
        SNLPLM(pretrained=model, tokenizer=tok, decode="speculative")
    with pytest.raises(ValueError, match="batch_size=auto"):
        SNLPLM(pretrained=model, tokenizer=tok, batch_size="auto")
    req = Instance(request_type="generate_until", doc={}, idx=0,
                   arguments=("Hello", {"until": ["\n"], "max_gen_toks": 2, "do_sample": True, "temperature": 0.7,
                                                 "min_p": 0.1}))
    with pytest.raises(ValueError, match="min_p"):
        SNLPLM(pretrained=model, tokenizer=tok).generate_until([req])


def test_snlp_imports_without_lm_eval():
    """lm-eval is an optional extra: snlp, its CLI and `snlp eval` import without it; the harness module does not,
    and `snlp eval --harness` says how to install it."""
    code = ("import sys; sys.modules['lm_eval'] = None\n"
            "import snlp, snlp.apps.cli, snlp.apps.eval, snlp.eval\n"
            "try:\n    import snlp.eval.harness\nexcept ImportError:\n    print('ok')\n"
            "from snlp.apps.cli import main\n"
            "print(main(['eval', 'CKPT', '--harness', 'arc_easy']))\n")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["ok", "2"], r.stdout + r.stderr
    assert "pip install -e '.[harness]'" in r.stderr


def test_own_tokenizer_model_against_a_naive_loop():
    """A tiny fp64 model with snlp's own BPE (BOS before each document, its own chat format): each request's
    log-likelihood is the naive sum of log-softmax over the full forward's logits, the same in batches of 1 and 3
    for a plan (ragged rows are independent), and the chat template renders as render_chat does."""
    tok = Tokenizer.train(["the cat sat on the mat. a dog ran in the park. " * 4], 300)
    model = make_model(vocab_size=tok.vocab_size, n_layer=4, sequence_len=64, window_pattern="L")
    pairs = [("the cat", " sat on the mat"), ("a dog ran", " in"), ("the", " park. a cat"), ("a", " mat")]
    reqs = [Instance(request_type="loglikelihood", doc={}, arguments=p, idx=0) for p in pairs]
    got = SNLPLM(pretrained=model, tokenizer=tok, batch_size=2, dtype="float64").loglikelihood(reqs)
    for (ctx, cont), (ll, greedy) in zip(pairs, got):
        c, w = [tok.bos_id] + tok.encode(ctx), [tok.bos_id] + tok.encode(ctx + cont)
        x = torch.tensor([w[:-1]])
        with torch.no_grad():
            logp = torch.log_softmax(model(x)[0].double(), -1)
        ref = sum(float(logp[t - 1, w[t]]) for t in range(len(c), len(w)))
        assert ll == pytest.approx(ref, abs=1e-9)
        assert greedy == all(int(logp[t - 1].argmax()) == w[t] for t in range(len(c), len(w)))
    one = SNLPLM(pretrained=model, tokenizer=tok, plan="2xF1-h0-K1", batch_size=1, dtype="float64").loglikelihood(reqs)
    three = SNLPLM(pretrained=model, tokenizer=tok, plan="2xF1-h0-K1", batch_size=3, dtype="float64").loglikelihood(reqs)
    assert [a[0] for a in one] == pytest.approx([b[0] for b in three], abs=1e-10)
    assert max(abs(a[0] - b[0]) for a, b in zip(one, got)) > 1e-6  # the plan is not the sequential model here
    msgs = [{"role": "user", "content": "the cat"}]
    lm = SNLPLM(pretrained=model, tokenizer=tok, dtype="float64")
    assert lm.tok_encode(lm.apply_chat_template(msgs)) == tok.render_chat(msgs, add_generation_prompt=True)[0]


@pytest.mark.parametrize("kw", [{}, {"plan": APPROX, "decode": "speculative", "block": 3}])
def test_generate_until_on_a_model_whose_own_forward_turns_nan_raises_naming_it(kw):
    """A weight made NaN after loading: generate_until answered with tokens read off NaN logits (token 0); now the
    sequential and the speculative answers raise NonFiniteModelError naming the model's own forward, which the
    harness run does not record as a plan's divergence."""
    from snlp import SNLPDivergenceError
    from snlp.decode.session import NonFiniteModelError

    tok = Tokenizer.train(["the cat sat on the mat. a dog ran in the park. " * 4], 300)
    model = make_model(vocab_size=tok.vocab_size, n_layer=4, sequence_len=64, window_pattern="L")
    with torch.no_grad():
        model.blocks[1].mlp.c_proj.weight[0, 0] = float("nan")
    req = Instance(request_type="generate_until", doc={}, arguments=("the cat", {"until": ["\n"], "max_gen_toks": 5}),
                   idx=0)
    lm = SNLPLM(pretrained=model, tokenizer=tok, dtype="float64", **kw)
    with pytest.raises(NonFiniteModelError, match=r"^the model's own forward \(not an SNLP plan\) gives NaN/inf "
                       r"logits for generated token 1") as e:
        lm.generate_until([req])
    assert not isinstance(e.value, SNLPDivergenceError)


def test_tol_plan_scores_do_not_depend_on_the_batch():
    """A tol plan's per-row stop test took its norms over the right padding of a batch: a request's log-likelihood
    moved by up to 0.9 between batch size 1 and 4 (depth-8 fp64 model, requests of very different lengths)."""
    tok = Tokenizer.train(["the cat sat on the mat. a dog ran in the park. " * 4], 300)
    model = make_model(seed=5, vocab_size=tok.vocab_size, n_layer=8, sequence_len=64, window_pattern="L")
    pairs = [("the cat sat on the mat. a dog ran in the park. the cat", " sat on the mat"), ("a", " in"),
             ("the", " park. a cat"), ("a dog", " mat")]
    reqs = [Instance(request_type="loglikelihood", doc={}, arguments=p, idx=0) for p in pairs]
    plan = "7xF1-h0-K6-tol:0.5"
    one = SNLPLM(pretrained=model, tokenizer=tok, plan=plan, batch_size=1, dtype="float64").loglikelihood(reqs)
    four = SNLPLM(pretrained=model, tokenizer=tok, plan=plan, batch_size=4, dtype="float64").loglikelihood(reqs)
    assert [a[0] for a in one] == pytest.approx([b[0] for b in four], abs=1e-10)


def test_a_diverged_plan_is_shown_diverged(tasks):
    """A plan whose solve turns NaN/inf is a `diverged` column, not NaN log-likelihoods scored as picks: a tiny
    depth-8 model whose MLP inputs are scaled 1000x (the sequential forward stays finite, the exact-Jacobian Newton
    step of a K = 1 plan overflows)."""
    from snlp.eval.harness import evaluate_methods, markdown

    tok = Tokenizer.train([(DATA / "arc_tiny_test.jsonl").read_text()] * 3, 300)
    m = blowup_model(tok.vocab_size, sequence_len=128)
    lms = [SNLPLM(pretrained=m, tokenizer=tok, plan=p, batch_size=8) for p in (None, "8xF1-h0-K1-newton")]
    recs = evaluate_methods(lms, ["snlp_arc_tiny"], num_fewshot=0, limit=2, include=str(tasks), bootstrap_iters=10)
    assert [r.method for r in recs] == ["sequential", "8xF1-h0-K1-newton"]
    assert not recs[0].diverged and recs[0].results["snlp_arc_tiny"]["acc,none"] in (0.0, 0.5, 1.0)
    assert recs[1].diverged and not recs[1].results
    row = next(line for line in markdown(recs).splitlines() if line.startswith("| snlp_arc_tiny | acc |"))
    assert row.endswith("| diverged |") and " ± " in row


def test_a_diverging_plan_generation_is_diverged_not_scored(tasks):
    """generate_until with decode=snlp on a plan whose solve turns NaN: its answers were the argmax of NaN logits
    (token 0, here BOS: the answer ''), scored as a real exact_match of 0.0. snlp_generate now raises
    SNLPDivergenceError, so the method is `diverged` (as its loglikelihood always was), and its record carries the
    config every other method's run records (model_args, batch_size, device, seeds, ...). decode=speculative still
    answers as the model: the model verifies every token."""
    from snlp.eval.harness import evaluate_methods, markdown
    from snlp.method.solver import SNLPDivergenceError

    plan = "8xF1-h0-K1-newton"
    tok = Tokenizer.train([(DATA / "arc_tiny_test.jsonl").read_text()] * 3, 300)
    m = blowup_model(tok.vocab_size, sequence_len=128)
    req = [Instance("generate_until", {}, ("the cat", {"until": ["."], "max_gen_toks": 6, "do_sample": False}), 0)]
    with pytest.raises(SNLPDivergenceError, match=f"plan {plan} diverged while decoding"):
        SNLPLM(pretrained=m, tokenizer=tok, plan=plan).generate_until(req)
    seq = SNLPLM(pretrained=m, tokenizer=tok).generate_until(req)
    assert SNLPLM(pretrained=m, tokenizer=tok, plan=plan, decode="speculative").generate_until(req) == seq
    lms = [SNLPLM(pretrained=m, tokenizer=tok, plan=p, batch_size=4, name="ckpt") for p in (None, plan)]
    recs = evaluate_methods(lms, ["snlp_gen_tiny"], num_fewshot=0, include=str(tasks), bootstrap_iters=10)
    assert [(r.method, r.diverged) for r in recs] == [("sequential", False), (plan, True)]
    row = next(line for line in markdown(recs).splitlines() if line.startswith("| snlp_gen_tiny | exact_match |"))
    assert row.endswith("| diverged |")
    ok, bad = recs[0].harness["config"], recs[1].harness["config"]
    assert set(bad) == set(ok) and bad["model_args"] == lms[1].model_args and "plan=" + plan in bad["model_args"]
    assert {k: v for k, v in bad.items() if k not in ("model_args", "method")} == \
        {k: v for k, v in ok.items() if k not in ("model_args", "method")}
    assert recs[1].harness["diverged"] and "diverged while decoding" in recs[1].harness["error"]


def test_chat_template_run_matches_hf_model(hf, base, tasks):
    """apply_chat_template=True (the harness's --apply_chat_template): the same chat-rendered prompts and
    log-likelihoods as the hf model."""
    tm = TaskManager(include_path=str(tasks), include_defaults=False)
    ours = SNLPLM(pretrained=base[0], tokenizer=base[1], batch_size=4)
    runs = [lm_eval.simple_evaluate(model=lm, tasks=["snlp_arc_tiny"], num_fewshot=1, limit=2, task_manager=tm,
                                    apply_chat_template=True, log_samples=True, bootstrap_iters=10) for lm in (hf, ours)]
    a, b = (samples(r, "snlp_arc_tiny") for r in runs)
    assert [s["arguments"] for s in a] == [s["arguments"] for s in b]
    assert a[0]["arguments"][0][0].startswith("<|im_start|>")  # really chat-rendered
    torch.testing.assert_close(torch.tensor(lls(runs[1], "snlp_arc_tiny")), torch.tensor(lls(runs[0], "snlp_arc_tiny")),
                               atol=1e-4, rtol=0)


def test_a_second_harness_run_into_the_same_default_folder_is_refused_before_it_clears_it(tasks, tmp_path, capsys,
                                                                                          monkeypatch):
    """Two harness runs of one checkpoint started in one folder both wrote harness-<CKPT name>/ (with --force the
    second cleared the first's files): the default --harness-out is held as a typed one is, from before --force
    clears it."""
    from snlp.io.checkpoint import save_checkpoint
    from snlp.runtime.outputs import locked_output

    tok = Tokenizer.train(["Question: which cat sat on the mat? Answer: the cat. a dog ran in the park. " * 4], 300)
    ckpt = save_checkpoint(tmp_path / "tiny", make_model(vocab_size=tok.vocab_size, n_layer=2, dtype=torch.float32,
                                                         sequence_len=256), tokenizer=tok)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "harness-tiny").mkdir()
    (tmp_path / "harness-tiny" / "sequential.json").write_text("the first run's\n")
    with locked_output("harness-tiny"):  # the first run, in progress
        rc = main(["eval", str(ckpt), "--harness", "snlp_arc_tiny", "--harness-include", str(tasks), "--limit", "1",
                   "--num-fewshot", "0", "--device", "cpu", "--force"])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2 and line.startswith("snlp eval: error: --harness-out harness-tiny is in use by a run in progress"), line
    assert (tmp_path / "harness-tiny" / "sequential.json").read_text() == "the first run's\n"


def test_cli_harness_files_are_strict_json(tasks, tmp_path, capsys):
    """Each method's JSON, and --json, parse with a strict JSON parser (JavaScript's JSON.parse, jq): they are written
    by snlp.runtime.device.json_text (a NaN null, an inf "inf"), as every snlp command's files. Over one question the
    standard errors are undefined: lm-eval 0.4 says "N/A" there, and a NaN any metric gave would be null, never the
    bare NaN Python's json writes."""
    from snlp.io.checkpoint import save_checkpoint

    def refuse(name):
        raise ValueError(f"non-strict JSON constant {name}")

    tok = Tokenizer.train(["Question: which cat sat on the mat? Answer: the cat. a dog ran in the park. " * 4], 300)
    ckpt = save_checkpoint(tmp_path / "tiny", make_model(vocab_size=tok.vocab_size, n_layer=2, dtype=torch.float32,
                                                         sequence_len=256), tokenizer=tok)
    out = tmp_path / "out"
    assert main(["eval", str(ckpt), "--harness", "snlp_arc_tiny", "--harness-include", str(tasks), "--limit", "1",
                 "--num-fewshot", "0", "--plans", "2xF1-h0-K1", "--harness-out", str(out), "--device", "cpu",
                 "--json", str(tmp_path / "h.json")]) == 0
    for path in (out / "sequential.json", out / "2xF1-h0-K1.json", tmp_path / "h.json"):
        json.loads(path.read_text(), parse_constant=refuse)


@pytest.mark.parametrize("chat", [False, True])
def test_records_carry_what_lm_evals_own_results_file_carries(tasks, tmp_path, chat):
    """Each method's record against the results file lm-eval's own EvaluationTracker writes for the same run: the
    record lacked chat_template / its sha, fewshot_as_multiturn, system_instruction and task_hashes, so a run with
    --apply-chat-template and one without wrote the same config; and fewshot_as_multiturn is the one `lm_eval
    --apply_chat_template` sets (False without a template), not simple_evaluate's default True."""
    from lm_eval.loggers import EvaluationTracker

    from snlp.eval.harness import evaluate_methods

    tok = Tokenizer.train([(DATA / "arc_tiny_test.jsonl").read_text()] * 3, 300)
    model = make_model(vocab_size=tok.vocab_size, n_layer=2, sequence_len=256, window_pattern="L")
    lm = SNLPLM(pretrained=model, tokenizer=tok, dtype="float64", batch_size=8)
    tm = TaskManager(include_path=str(tasks), include_defaults=False)
    [rec] = evaluate_methods([lm], ["snlp_arc_tiny"], num_fewshot=1, limit=2, apply_chat_template=chat,
                             bootstrap_iters=0, tm=tm)
    tracker = EvaluationTracker(output_path=str(tmp_path))
    r = lm_eval.simple_evaluate(model=lm, model_args=lm.model_args, tasks=["snlp_arc_tiny"], num_fewshot=1, limit=2,
                                task_manager=tm, apply_chat_template=chat, fewshot_as_multiturn=chat,
                                bootstrap_iters=0, log_samples=False, evaluation_tracker=tracker)
    tracker.save_results_aggregated(results=r)
    [own] = [json.loads(p.read_text()) for p in tmp_path.rglob("results_*.json")]
    assert set(own) <= set(rec.harness), sorted(set(own) - set(rec.harness))
    for k in ("chat_template", "chat_template_sha", "fewshot_as_multiturn", "system_instruction", "task_hashes"):
        assert rec.harness[k] == own[k], k
    assert (rec.harness["chat_template"] is not None) == chat and rec.harness["fewshot_as_multiturn"] == chat
    assert rec.results == json.loads(json.dumps(own["results"]))


def test_own_tokenizer_generation_stops_at_the_end_of_turn_as_nanochat():
    """snlp's own BPE (nanochat's format) has no EOS; nanochat's engine ends a reply at <|assistant_end|> or <|bos|>.
    generate_until stopped only at <|bos|>, so a chat model's answer ran on past its end of turn into a made-up next
    turn (special tokens dropped from the text: the answer and the next turn glued together, an exact_match lost).
    Reference: a naive greedy loop over the full forward that stops at either token. The head row of
    <|assistant_end|> is made twice the row of the model's first greedy token, so it wins the first step."""
    tok = Tokenizer.train(["the cat sat on the mat. a dog ran in the park. " * 4], 300)
    # seed 3: after <|assistant_end|> this model goes on with ordinary tokens (text the answer would have kept)
    model = make_model(seed=3, vocab_size=tok.vocab_size, n_layer=2, sequence_len=64, window_pattern="L")
    end, bos = tok.token_id("<|assistant_end|>"), tok.bos_id
    prompt = tok.render_chat([{"role": "user", "content": "the cat"}], add_generation_prompt=True)[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt]))[0, -1]
        first = int(logits.argmax())
        assert logits[first] > 0  # doubling the row doubles a positive logit: <|assistant_end|> becomes the argmax
        model.lm_head.weight[end] = 2 * model.lm_head.weight[first]

    def naive(ids, n):
        out = []
        for _ in range(n):
            with torch.no_grad():
                t = int(model(torch.tensor([ids + out]))[0, -1].argmax())
            out.append(t)
            if t in (end, bos):
                break
        return tok.tok.decode(out, skip_special_tokens=True)

    lm = SNLPLM(pretrained=model, tokenizer=tok, dtype="float64", batch_size=2)
    chats = [tok.render_chat([{"role": "user", "content": c}], add_generation_prompt=True)[0]
             for c in ("the cat", "a dog ran in the park")]
    reqs = [Instance(request_type="generate_until", doc={}, idx=0,
                     arguments=(tok.decode(ids), {"until": ["\n\n"], "max_gen_toks": 6})) for ids in chats]
    got = lm.generate_until(reqs)
    assert got == [naive(ids, 6) for ids in chats]
    assert got[0] == ""  # the reply ended at once


@pytest.mark.parametrize("decode, says", [(None, "2xF1-h0-K1 by SNLP decoding (the plan's own answers"),
                                          ("speculative", "2xF1-h0-K1 by speculative decoding (the model verifies "
                                                          "every token: the model's own answers)")])
def test_the_table_says_how_a_plans_generation_rows_were_decoded(tasks, tmp_path, capsys, decode, says):
    """A plan's column is named by the plan alone, but its generate_until rows are either the plan's own SNLP
    decoding or, with --harness-decode speculative, the model's own answers (then equal to the sequential column):
    table.md and the printed caption did not say which, so exact generation rows read as the plan's. Now a line
    names each plan column's decoding whenever a task generates (and only then)."""
    from snlp.io.checkpoint import save_checkpoint

    tok = Tokenizer.train(["Question: which cat sat on the mat? Answer: the cat. a dog ran in the park. " * 4], 300)
    ckpt = save_checkpoint(tmp_path / "tiny", make_model(vocab_size=tok.vocab_size, n_layer=2, dtype=torch.float32,
                                                         sequence_len=256), tokenizer=tok)
    for task, out in (("snlp_arc_tiny,snlp_gen_tiny", tmp_path / "gen"), ("snlp_arc_tiny", tmp_path / "mc")):
        assert main(["eval", str(ckpt), "--harness", task, "--harness-include", str(tasks), "--limit", "1",
                     "--num-fewshot", "0", "--plans", "2xF1-h0-K1", "--harness-out", str(out), "--device", "cpu",
                     "--bootstrap-iters", "0", *(["--harness-decode", decode] if decode else [])]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    gen, mc = ((tmp_path / d / "table.md").read_text() for d in ("gen", "mc"))
    assert f"generate_until rows: {says}" in gen and "generate_until rows" not in mc
    assert f"generate_until rows: {says}" in printed and printed.count("generate_until rows") == 1


def test_the_title_names_the_limit_that_runs(tasks, tmp_path, capsys):
    """--limit 2.5 runs the first 2 documents (lm-eval reads a limit >= 1 as int(limit)), and the run records
    limit 2, but the table's title said "limit 2.5"."""
    from snlp.io.checkpoint import save_checkpoint

    tok = Tokenizer.train(["Question: which cat sat on the mat? Answer: the cat. a dog ran in the park. " * 4], 300)
    ckpt = save_checkpoint(tmp_path / "tiny", make_model(vocab_size=tok.vocab_size, n_layer=2, dtype=torch.float32,
                                                         sequence_len=256), tokenizer=tok)
    out = tmp_path / "out"
    assert main(["eval", str(ckpt), "--harness", "snlp_arc_tiny", "--harness-include", str(tasks), "--limit", "2.5",
                 "--num-fewshot", "0", "--harness-out", str(out), "--device", "cpu", "--bootstrap-iters", "0"]) == 0
    title = (out / "table.md").read_text().splitlines()[0]
    assert ", limit 2 |" in title, title
    assert json.loads((out / "sequential.json").read_text())["config"]["limit"] == 2


def test_the_caption_promises_a_stderr_only_where_a_cell_has_one(tasks, tmp_path, capsys):
    """With --bootstrap-iters 0 the harness gives no stderr (its JSON: "N/A"), every cell is a bare value, and the
    printed caption said "value ± the harness's stderr" beside them; it now says the cells hold no stderr."""
    from snlp.io.checkpoint import save_checkpoint

    tok = Tokenizer.train(["Question: which cat sat on the mat? Answer: the cat. a dog ran in the park. " * 4], 300)
    ckpt = save_checkpoint(tmp_path / "tiny", make_model(vocab_size=tok.vocab_size, n_layer=2, dtype=torch.float32,
                                                         sequence_len=256), tokenizer=tok)
    out = tmp_path / "out"
    assert main(["eval", str(ckpt), "--harness", "snlp_arc_tiny", "--harness-include", str(tasks), "--limit", "2",
                 "--num-fewshot", "0", "--harness-out", str(out), "--device", "cpu", "--bootstrap-iters", "0"]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    res = json.loads((out / "sequential.json").read_text())["results"]["snlp_arc_tiny"]
    assert res["acc_stderr,none"] == "N/A" and " ± " not in (out / "table.md").read_text()
    assert "± the harness's stderr" not in printed and "the harness gave no stderr" in printed, printed
    from snlp.eval.harness import HarnessRecord, value_caption

    with_se = HarnessRecord("sequential", {"t": {"acc,none": 0.5, "acc_stderr,none": 0.1}})
    assert value_caption([with_se]) == "value ± the harness's stderr"


@pytest.mark.parametrize("kw", [dict(), dict(plan=APPROX), dict(plan=APPROX, decode="speculative", block=3),
                                dict(plan="4xF1-h0-K1-diag")])  # DiagN: one prompt at a time
def test_generation_stops_decoding_at_a_stop_string(base, monkeypatch, kw):
    """A row whose answer holds a stop string was decoded on to max_gen_toks and cut afterwards (lm-eval's hf model
    stops generating there): the answers were right, the tail's decode steps paid for nothing. Now a row stops at
    its stop string; the answers equal the free answers cut at the stop (lm-eval's postprocessing), and no row
    decodes past the stop by more than a speculative round."""
    model, tok = base
    prompts = ["The capital of France is", "Once upon a time, there", "My favourite food is"]
    lm = SNLPLM(pretrained=model, tokenizer=tok, batch_size=4, **kw)
    decoded = []
    inner = lm._generate
    monkeypatch.setattr(lm, "_generate", lambda *a, **k: decoded.append(inner(*a, **k)) or decoded[-1])

    def ask(until):
        return lm.generate_until([Instance("generate_until", {}, (p, {"until": u, "max_gen_toks": 24}), 0)
                                  for p, u in zip(prompts, until)])

    free = ask([[]] * 3)
    assert all(len(t) == 24 for t in decoded[0])  # no EOS inside: every row ran to max_gen_toks
    stops = [f[8:11] for f in free]  # text from early in each answer
    assert all(s.strip() for s in stops)
    got = ask([[s] for s in stops])
    assert got == [f.split(s)[0] for f, s in zip(free, stops)]
    lengths = [len(t) for t in decoded[1]]
    assert max(lengths) <= 15, lengths  # 11 ASCII characters are at most 11 tokens, plus a round of 3 drafts


@pytest.mark.parametrize("kw,greedy,refused", [
    ({"penalty_alpha": 0.6}, True, ["penalty_alpha"]),  # contrastive search (top_k defaults to 50 > 1)
    ({"penalty_alpha": 0.6, "temperature": 1.0}, False, []),  # do_sample: generate() samples, penalty_alpha unread
    ({"penalty_alpha": 0.0}, True, []), ({"penalty_alpha": None}, True, []),  # off / unset: greedy
    ({"dola_layers": "high"}, True, ["dola_layers"]), ({"dola_layers": None}, True, []),
    ({"force_words_ids": [[5]]}, False, ["force_words_ids"]), ({"constraints": None}, True, []),
    ({"num_beams": 4}, True, ["num_beams"])])
def test_generation_modes_the_harness_model_cannot_run_are_refused_and_their_off_values_accepted(kw, greedy, refused):
    """A task's penalty_alpha=0 / dola_layers=None (transformers' generate() stays greedy) was refused as an unknown
    option, and penalty_alpha under do_sample (generate() samples, ignoring it) too; set values that change the mode
    (contrastive search, DoLa, constrained beams, beams) stay refused."""
    from snlp.eval.harness import refused_gen_kwargs

    assert refused_gen_kwargs(kw, greedy) == refused
