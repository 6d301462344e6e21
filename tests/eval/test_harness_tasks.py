"""The offline harness tasks of tests/data/harness/ for ARC-Challenge, MMLU-style and HellaSwag-style data.

Each is checked against two outside references:
  - the harness's OWN task definition (its installed arc_challenge / mmlu / hellaswag YAML, its hellaswag
    preprocessing) run over the same rows put in the hub's schema: the two tasks build the same requests (contexts,
    continuations, targets), 0-shot and 1-shot, i.e. our YAML over local files is the harness's task;
  - the harness's own `hf` model on the one cut SmolLM2 (tests/conftest.py: smol_cut_hf): SNLPLM gives per-request
    log-likelihoods within 1e-4 and identical acc / acc_norm, per question and in the aggregate.
The fixtures are rebuilt by their recipe (build_tasks.py) and must come out byte for byte as shipped.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before datasets / huggingface_hub read them
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

from harness_fixtures import DATA, base, hf, lls, offline, run, samples, tasks  # noqa: E402,F401
import lm_eval  # noqa: E402
from datasets import Dataset, DatasetDict  # noqa: E402
from lm_eval.api.task import ConfigurableTask  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from lm_eval.tasks._yaml_loader import load_yaml  # noqa: E402

from snlp.eval.harness import SNLPLM  # noqa: E402

FIXTURES = (base, hf, offline, tasks)  # pytest finds these fixtures by their names in this module (offline is autouse)

pytestmark = pytest.mark.usefixtures("one_thread")

HARNESS_TASKS = Path(lm_eval.__file__).parent / "tasks"
SUBJECTS = ("abstract_algebra", "anatomy")


def _builder():
    spec = importlib.util.spec_from_file_location("build_tasks", DATA / "build_tasks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_fixtures_are_rebuilt_unchanged(monkeypatch):
    """The shipped HellaSwag-style rows and MMLU-style YAMLs are what their recipe (the module docstring of
    build_tasks.py) makes: reproducible, seeded."""
    b = _builder()
    monkeypatch.chdir(DATA.parents[2])  # the recipe runs from the repository root
    val, train = b.hellaswag_style(Path("tests/data/tinyshakespeare-head.txt").read_text(encoding="utf-8"), 6, 4, 0)
    for name, rows in (("validation", val), ("train", train)):
        shipped = [json.loads(line) for line in (DATA / f"hellaswag_style_tiny_{name}.jsonl").read_text().splitlines()]
        assert shipped == rows, name
    assert len({r["source_id"] for r in val + train}) == 10  # 10 distinct lines
    for r in val + train:
        assert len(r["endings"]) == 4 == len(set(r["endings"])) and r["label"] in "0123"
    for f, text in b.mmlu_files("tests/data/harness/mmlu_tiny", "snlp_mmlu_tiny").items():
        assert (DATA / f).read_text() == text, f
    assert sorted(f.name for f in DATA.glob("snlp_mmlu_tiny_*.yaml")) == [f"snlp_mmlu_tiny_{s}.yaml" for s in SUBJECTS]


# ----- the harness's own task definitions over the same rows -----
def _own(path: Path, splits: dict[str, list[dict]], **over) -> ConfigurableTask:
    """The harness's installed task YAML (with its includes and !function helpers), its hub dataset replaced by
    `splits` in the hub's schema."""
    cfg = load_yaml(path)
    for key in ("tag", "group", "dataset_path", "dataset_name", "dataset_kwargs"):
        cfg.pop(key, None)
    data = DatasetDict({k: Dataset.from_list(v) for k, v in splits.items()})
    return ConfigurableTask(config=dict(cfg, custom_dataset=lambda **_: data, **over))


def _ai2_to_hub(row: dict) -> dict:
    """An AI2 ARC JSONL row in the hub's allenai/ai2_arc schema."""
    ch = row["question"]["choices"]
    return {"id": row["id"], "question": row["question"]["stem"], "answerKey": row["answerKey"],
            "choices": {"text": [c["text"] for c in ch], "label": [c["label"] for c in ch]}}


def _csv_to_hub(path: Path, subject: str) -> list[dict]:
    """MMLU CSV rows (read as text by Python's csv module) in the hub's cais/mmlu schema."""
    rows = list(csv.reader(path.open(newline="", encoding="utf-8")))
    return [{"question": r[0], "subject": subject, "choices": r[1:5], "answer": "ABCD".index(r[5])} for r in rows]


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _requests(task, k: int) -> list[tuple]:
    task.set_config(key="num_fewshot", value=k)
    task.set_fewshot_seed(seed=1234)
    task.build_all_requests(rank=0, world_size=1)
    return [(i.doc_id, i.idx, tuple(i.arguments), task.doc_to_target(i.doc)) for i in task.instances]


def _ours(tasks, name):
    return TaskManager(include_path=str(tasks), include_defaults=False).load([name])["tasks"]


def own_tasks() -> dict[str, ConfigurableTask]:
    arc = {"train": [_ai2_to_hub(r) for r in _jsonl(DATA / "arc_challenge_tiny_train.jsonl")],
           "test": [_ai2_to_hub(r) for r in _jsonl(DATA / "arc_challenge_tiny_test.jsonl")]}
    # the hub's ARC has a validation split too; these rows have none (few-shot comes from train either way)
    out = {"snlp_arc_challenge_tiny": _own(HARNESS_TASKS / "arc/arc_challenge.yaml", arc, validation_split=None)}
    for s in SUBJECTS:
        mm = {split: _csv_to_hub(DATA / "mmlu_tiny" / split / f"{s}_{split}.csv", s) for split in ("test", "dev")}
        out[f"snlp_mmlu_tiny_{s}"] = _own(HARNESS_TASKS / f"mmlu/default/mmlu_{s}.yaml", mm)
    hs = {k: _jsonl(DATA / f"hellaswag_style_tiny_{k}.jsonl") for k in ("train", "validation")}
    out["snlp_hellaswag_style_tiny"] = _own(HARNESS_TASKS / "hellaswag/hellaswag.yaml", hs)
    return out


@pytest.mark.parametrize("k", [0, 1])
def test_tasks_build_the_harness_own_requests(tasks, k):
    """Our YAML over local files (AI2 JSONL, the original MMLU CSVs, HellaSwag-schema JSONL) and the harness's own
    arc_challenge / mmlu_<subject> / hellaswag over the same rows in the hub's schema: the same requests."""
    own = own_tasks()
    ours = {**_ours(tasks, "snlp_arc_challenge_tiny"), **_ours(tasks, "snlp_mmlu_tiny"),
            **_ours(tasks, "snlp_hellaswag_style_tiny")}
    assert sorted(ours) == sorted(own)
    for name, task in ours.items():
        a, b = _requests(task, k), _requests(own[name], k)
        assert a == b, name
        assert len(a) >= 12 and all(args[1].startswith(" ") for _, _, args, _ in a), name
        if k:
            assert "\n\n" in a[0][2][0], name  # really k-shot
    mm = _requests(ours["snlp_mmlu_tiny_abstract_algebra"], 0)
    assert mm[0][2][0].startswith("The following are multiple choice questions (with answers) about abstract algebra.")
    assert "\nA. 0\nB. 4\n" in mm[0][2][0]  # numeric choices stay text ("0", not 0 or 0.0)


# ----- SNLPLM against the harness's hf model on each new task -----
NEW = {"snlp_arc_challenge_tiny": 1, "snlp_mmlu_tiny": 1, "snlp_hellaswag_style_tiny": 1}


@pytest.fixture(scope="module")
def both_new(hf, base, tasks):
    tm = TaskManager(include_path=str(tasks), include_defaults=False)
    ours = SNLPLM(pretrained=base[0], tokenizer=base[1], batch_size=4)
    return {t: (run(hf, tm, t, k), run(ours, tm, t, k)) for t, k in NEW.items()}


@pytest.mark.parametrize("task", list(NEW))
def test_new_tasks_match_the_hf_model(both_new, task):
    ref, got = both_new[task]
    leaves = [t for t in ref["samples"]]
    assert leaves == [t for t in got["samples"]] and leaves
    for leaf in leaves:
        a, b = samples(ref, leaf), samples(got, leaf)
        assert [s["arguments"] for s in a] == [s["arguments"] for s in b], leaf
        torch.testing.assert_close(torch.tensor(lls(got, leaf)), torch.tensor(lls(ref, leaf)), atol=1e-4, rtol=0)
        metrics = [m for m in ("acc", "acc_norm") if m in a[0]]
        assert "acc" in metrics and (leaf.startswith("snlp_mmlu") or "acc_norm" in metrics), leaf
        for m in metrics:
            assert [s[m] for s in a] == [s[m] for s in b], (leaf, m)
    for name, d in ref["results"].items():
        for key, v in d.items():
            if key.split(",")[0] in ("acc", "acc_norm", "acc_stderr", "acc_norm_stderr"):
                assert got["results"][name][key] == v, (name, key)
    if task == "snlp_mmlu_tiny":
        assert ref["results"]["snlp_mmlu_tiny"]["acc,none"] == pytest.approx(
            sum(s["acc"] for leaf in leaves for s in samples(ref, leaf)) / 7)  # the group: acc weighted by size
