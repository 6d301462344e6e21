"""Fixtures and helpers shared by the lm-evaluation-harness tests (tests/eval/test_harness*.py): offline mode, the
shipped task folder with its data paths made absolute, the harness's `hf` model and snlp's on the one cut SmolLM2
(tests/conftest.py: smol_cut_hf), and readers of the harness's logged samples. Import the fixtures by name."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before datasets / huggingface_hub read them
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")

import lm_eval  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "data" / "harness"


@pytest.fixture(scope="module", autouse=True)
def offline():
    """Offline even when datasets / huggingface_hub were imported before the env vars were set."""
    import datasets
    import huggingface_hub.constants as hub

    old = datasets.config.HF_DATASETS_OFFLINE, hub.HF_HUB_OFFLINE
    datasets.config.HF_DATASETS_OFFLINE, hub.HF_HUB_OFFLINE = True, True
    yield
    datasets.config.HF_DATASETS_OFFLINE, hub.HF_HUB_OFFLINE = old


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    """The shipped task folder (YAML files, `_..._yaml` templates, their Python helpers and data) with the YAMLs'
    data_files made absolute (they name them relative to the repository root)."""
    d = tmp_path_factory.mktemp("tasks") / "harness"
    shutil.copytree(DATA, d, ignore=shutil.ignore_patterns("__pycache__"))
    for f in d.iterdir():
        if f.name.endswith("yaml"):
            f.write_text(f.read_text().replace("tests/data/harness/", f"{DATA}/"))
    return d


@pytest.fixture(scope="module")
def base(smol_cut_hf):
    from snlp.eval.harness import load_any

    model, tok, _ = load_any(str(smol_cut_hf))
    return model, tok


@pytest.fixture(scope="module")
def hf(smol_cut_hf):
    from lm_eval.models.huggingface import HFLM

    return HFLM(pretrained=str(smol_cut_hf), device="cpu", batch_size=1, dtype="float32")


def run(lm, tm, task, shots):
    return lm_eval.simple_evaluate(model=lm, tasks=[task], num_fewshot=shots, task_manager=tm, log_samples=True,
                                   bootstrap_iters=10, fewshot_random_seed=1234)


def samples(result, task):
    return sorted(result["samples"][task], key=lambda s: s["doc_id"])


def lls(result, task) -> list[float]:
    return [r[0][0] if isinstance(r[0], (list, tuple)) else r[0] for s in samples(result, task) for r in s["resps"]]


def requests(result, task, kind) -> list[Instance]:
    return [Instance(request_type=kind, doc=s["doc"], arguments=tuple(a), idx=i)
            for s in samples(result, task) for i, a in enumerate(s["arguments"])]
