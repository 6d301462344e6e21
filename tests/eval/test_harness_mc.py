"""snlp's own multiple-choice scoring (`--mc-scoring harness`, evaluate_mc) as a thin layer over lm-evaluation-harness
: with lm-eval installed, the questions become one harness task in the arc_easy format and each method is
run by the harness itself through SNLPLM (snlp.eval.harness_mc); snlp's hand copy of the protocol
(snlp.eval.mc_harness) is only the fallback without lm-eval.

References, on real ARC-Easy questions (the vendored tests/data/arc heads) and the one cut SmolLM2
(tests/conftest.py: smol_cut_hf):
  - the harness's own `hf` model on the same transformers checkpoint and the same task: per-choice log-likelihoods
    within 1e-4, the same picks, the same per-question acc / acc_norm (0-shot, 2-shot from the train split, 2-shot
    from the questions' own task);
  - the harness's own arc_easy YAML over the same rows: the same requests (the task really is arc_easy's format);
  - the previous hand implementation: the same log-likelihoods (1e-4) and per-question acc / acc_norm, and the same
    MCRecords for the sequential forward and a K = 1 plan; without lm-eval (a subprocess that blocks it) the fallback
    still scores, and says so in its caption.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before datasets / huggingface_hub read them
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

from harness_fixtures import base, hf, offline  # noqa: E402,F401
import lm_eval  # noqa: E402
from datasets import Dataset, DatasetDict  # noqa: E402
from lm_eval.api.task import ConfigurableTask  # noqa: E402
from lm_eval.tasks._yaml_loader import load_yaml  # noqa: E402

from snlp.eval.harness_mc import mc_samples, mc_task, run_task  # noqa: E402
from snlp.eval.mc import MCConfig, shot_layout  # noqa: E402
from snlp.eval.mc_eval import evaluate_mc  # noqa: E402
from snlp.eval.mc_harness import draw_shots, loglikelihoods, predictions  # noqa: E402
from snlp.io.mctasks import parse_file  # noqa: E402
from snlp.method.plan import Plan  # noqa: E402

FIXTURES = (base, hf, offline)  # pytest finds these fixtures by their names in this module (offline is autouse)

pytestmark = pytest.mark.usefixtures("one_thread")

ARC = Path(__file__).resolve().parents[1] / "data/arc"
ARC_TEST, ARC_TRAIN = ARC / "ARC-Easy-Test-head.jsonl", ARC / "ARC-Easy-Train-head.jsonl"
N, APPROX = 8, "4xF1-h0-K1"  # K = 1 over 4 of the 6 layers: really approximate
# (shots, where they come from): 0-shot; 2-shot from the train split; 2-shot from the test questions' own task
CASES = {"0-shot": (0, "none"), "2-shot-train": (2, "train"), "2-shot-own": (2, "own")}


@pytest.fixture(scope="module")
def arc():
    test, train = parse_file(ARC_TEST), parse_file(ARC_TRAIN)
    return test[:N], {"none": None, "train": train, "own": test}


def _picks(lls_, choices):
    acc = max(range(len(lls_)), key=lls_.__getitem__)
    norm = max(range(len(lls_)), key=lambda i: lls_[i] / len(choices[i]))
    return acc, norm


@pytest.fixture(scope="module")
def three_ways(hf, base, arc):
    """{case: (harness path through SNLPLM, the same task through the hf model, the hand copy's scores)}."""
    model, tok = base
    qs, pools = arc
    out = {}
    for case, (k, src) in CASES.items():
        pool = pools[src]
        ours = mc_samples(model, tok, qs, None, pool, k, batch=4)
        task, limit = mc_task(qs, pool, k)
        ref = run_task(hf, task, k, limit)
        hand = loglikelihoods(model, tok, qs, None, draw_shots(qs, pool or [], k), batch=4)
        out[case] = ours, ref, hand
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_harness_path_equals_the_hf_model_and_the_hand_copy(three_ways, arc, case):
    qs = arc[0]
    ours, ref, hand = three_ways[case]
    assert len(ours) == len(ref) == len(hand) == N
    f64 = torch.float64
    for q, a, r, h in zip(qs, ours, ref, hand):
        torch.testing.assert_close(torch.tensor(a.lls, dtype=f64), torch.tensor(r.lls, dtype=f64), atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.tensor(a.lls, dtype=f64), torch.tensor(h, dtype=f64), atol=1e-4, rtol=0)
        assert _picks(a.lls, q.choices) == _picks(r.lls, q.choices) == _picks(h, q.choices)
        assert (a.acc, a.acc_norm) == (r.acc, r.acc_norm)
        acc, norm = _picks(h, q.choices)
        assert (a.acc, a.acc_norm) == (acc == q.answer, norm == q.answer)  # the hand copy's acc / acc_norm
    picks, norm_picks = predictions(qs, hand)
    assert [p == q.answer for p, q in zip(picks, qs)] == [a.acc for a in ours]
    if case == "0-shot":  # acc and acc_norm really differ here: two metrics, not one
        assert [a.acc for a in ours] != [a.acc_norm for a in ours]


def test_the_task_is_the_harness_arc_easy(arc):
    """The in-memory task builds the requests of the harness's own arc_easy YAML over the same rows in the hub's
    schema (0-shot and 2-shot from train, same seed)."""
    qs, pools = arc
    rows = [json.loads(line) for line in ARC_TEST.read_text().splitlines()[:N]]
    train = [json.loads(line) for line in ARC_TRAIN.read_text().splitlines()]

    def hub(r):
        ch = r["question"]["choices"]
        return {"id": r["id"], "question": r["question"]["stem"], "answerKey": r["answerKey"],
                "choices": {"text": [c["text"] for c in ch], "label": [c["label"] for c in ch]}}

    data = DatasetDict({"test": Dataset.from_list([hub(r) for r in rows]),
                        "train": Dataset.from_list([hub(r) for r in train])})
    cfg = load_yaml(Path(lm_eval.__file__).parent / "tasks/arc/arc_easy.yaml")
    for key in ("tag", "dataset_path", "dataset_name"):
        cfg.pop(key, None)

    def requests(task, k):
        task.set_config(key="num_fewshot", value=k)
        task.set_fewshot_seed(seed=1234)
        task.build_all_requests(rank=0, world_size=1)
        return [(i.doc_id, tuple(i.arguments), task.doc_to_target(i.doc)) for i in task.instances]

    for k in (0, 2):
        own = ConfigurableTask(config=dict(cfg, validation_split=None, custom_dataset=lambda **_: data))
        ours, _ = mc_task(qs, pools["train"] if k else None, k)
        assert requests(ours, k) == requests(own, k)


@pytest.mark.slow
def test_records_equal_the_hand_copy_for_every_method(base, arc):
    """evaluate_mc through the harness and through the hand copy: the same records (acc and acc_norm counts) for the
    sequential forward and a K = 1 plan, 2-shot from the train split; the caption names the implementation."""
    model, tok = base
    qs, _ = arc
    cfg = dict(task="arc", plans=[APPROX], scoring="harness", shots=2, shot_task=f"mc:{ARC_TRAIN}", batch=4)
    via = evaluate_mc(model, tok, MCConfig(**cfg, implementation="lm_eval"), qs)
    hand = evaluate_mc(model, tok, MCConfig(**cfg, implementation="snlp"), qs)
    assert [r.method for r in via.records] == ["sequential", APPROX]
    assert [r.__dict__ for r in via.records] == [r.__dict__ for r in hand.records]
    assert "scored by lm-evaluation-harness" in via.protocol and "copy of the protocol" in hand.protocol
    # per question, for the plan: the harness path's scores are the hand copy's, and they are not the sequential ones
    pool, plan = arc[1]["train"], Plan.parse(APPROX)
    got = mc_samples(model, tok, qs, plan, pool, 2, batch=4)
    ref = loglikelihoods(model, tok, qs, plan, draw_shots(qs, pool, 2), batch=4)
    seq = mc_samples(model, tok, qs, None, pool, 2, batch=4)
    for q, a, h in zip(qs, got, ref):
        assert a.lls == pytest.approx(h, abs=1e-4)
        assert (a.acc, a.acc_norm) == tuple(p == q.answer for p in _picks(h, q.choices))
    assert max(abs(x - y) for a, b in zip(got, seq) for x, y in zip(a.lls, b.lls)) > 1e-2


def test_shots_the_harness_cannot_express_are_refused(arc):
    qs, pools = arc
    assert shot_layout(qs, pools["train"], 2) == (None, None)
    assert shot_layout(qs, pools["own"], 2) == ("test", N)  # fewshot_split == test_split, limit N
    with pytest.raises(ValueError, match="shares some of the questions"):
        shot_layout(qs, pools["own"][4:], 2)  # a pool holding only some of the questions
    with pytest.raises(ValueError, match="shot pool"):
        shot_layout(qs, pools["train"][:1], 2)
    with pytest.raises(ValueError, match="implementation must be auto, lm_eval or snlp"):
        MCConfig(task="x", scoring="harness", implementation="hf").check()
    with pytest.raises(ValueError, match="applies to the harness scoring only"):
        MCConfig(task="x", scoring="letter", implementation="snlp").check()


def test_without_lm_eval_the_copy_scores_as_the_harness_does():
    """lm-eval is optional: with it blocked, evaluate_mc's harness scoring falls back to the hand copy (its caption
    says so) and gives the records that the harness path gives with it, on a tiny fp64 model with snlp's own BPE
    (BOS before each document), a K = 1 plan and 1-shot from the questions' own task. Both runs are subprocesses
    built alike; only the one line that blocks lm_eval differs."""
    code = """
import json, sys
sys.path.insert(0, {tests!r})
BLOCK
from conftest import make_model
from snlp.io.tokenizer import Tokenizer
from snlp.eval.mc import MCConfig
from snlp.eval.mc_eval import evaluate_mc
tok = Tokenizer.train(["Question: which cat sat on the mat? Answer: the cat. a dog ran in the park. " * 4], 300)
model = make_model(vocab_size=tok.vocab_size, n_layer=4, sequence_len=256, window_pattern="L")
task = "mc:{arc}"
r = evaluate_mc(model, tok, MCConfig(task=task, plans=["2xF1-h0-K1"], scoring="harness", limit=6, shots=1,
                                     shot_task=task, batch=3))
print(json.dumps(r.to_dict()))
""".format(tests=str(Path(__file__).resolve().parents[1]), arc=ARC_TEST)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    runs = []
    for block in ("sys.modules['lm_eval'] = None", ""):
        p = subprocess.run([sys.executable, "-c", code.replace("BLOCK", block)], capture_output=True, text=True,
                           env=env, timeout=300)
        assert p.returncode == 0, p.stderr[-3000:]
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    blocked, harness = runs
    assert "lm-eval not installed" in blocked["protocol"] and "scored by lm-evaluation-harness" in harness["protocol"]
    assert blocked["records"] == harness["records"] and blocked["records"][0]["n"] == 6
    assert blocked["shots"] == harness["shots"] == 1


def test_the_copy_scores_a_bos_adding_tokenizer_as_the_harness(tmp_path):
    """A converted model whose tokenizer's post-processor adds BOS (Llama-2 / Mistral style): the harness's hf model
    (and SNLPLM) encodes with it, the copy of the protocol (implementation=snlp, or no lm-eval) encoded without
    special tokens, so every context lacked its BOS: other log-likelihoods (0.7 apart here) and other picks.
    Reference: the harness itself (mc_samples) on the same converted tiny random transformers Llama."""
    import transformers
    from tokenizers import processors

    from conftest import word_tokenizer
    from snlp.eval.harness import load_any
    from snlp.eval.mc_harness import loglikelihoods
    from snlp.io.mctasks import Question

    V = 64
    tok = word_tokenizer(V)
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", V - 3)])
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   bos_token_id=V - 3, eos_token_id=V - 2, tie_word_embeddings=False)
    hf_model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in hf_model.parameters():
            if p.dim() > 1:
                p.mul_(8.0)  # logits far from uniform: a missing BOS moves every score
    hf_model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    model, stok, _ = load_any(str(tmp_path))
    model = model.double()
    assert stok.tok.encode("t1 t2").ids[0] == V - 3  # the tokenizer really adds BOS
    qs = [Question(question="t1 t2 t3", choices=("t4", "t5 t6", "t7"), answer=1),
          Question(question="t9", choices=("t10 t11", "t12"), answer=0)]
    ref = [s.lls for s in mc_samples(model, stok, qs, None)]
    got = loglikelihoods(model, stok, qs, None)
    for r, g in zip(ref, got):
        torch.testing.assert_close(torch.tensor(g, dtype=torch.float64), torch.tensor(r, dtype=torch.float64),
                                   atol=1e-4, rtol=0)
