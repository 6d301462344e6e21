"""Every tensor a path creates lands on the model's device: an AST walk over snlp/ flags each torch factory call
(torch.tensor / as_tensor / arange / zeros / ones / full / empty / randn / rand / randint / linspace / eye /
Generator) made without device= (torch.Generator(dev): the device as its argument; a call with **kwargs is taken to
pass it). The fake-cuda tier (test_fake_cuda.py) finds such a tensor when a path runs; this finds it in code no test
runs. What stays on the CPU on purpose is listed in ALLOWED with the reason, per function."""

from __future__ import annotations

import ast
from pathlib import Path

import snlp

FACTORIES = {"tensor", "as_tensor", "arange", "zeros", "ones", "full", "empty", "randn", "rand", "randint",
             "linspace", "eye", "Generator"}
ROOT = Path(snlp.__file__).parent

_MODULE_INIT = "nn.Module constructor: parameters/buffers follow the default device (a torch.device('meta') or " \
               "'cuda' context), as nn.Linear's do; to_empty / .to move them"
_CPU_DRAW = "inputs drawn from a seeded CPU generator (the same tokens on every device), moved with .to(device) " \
            "before use, outside the timed / hot region"
_HOST = "host-side data (Python lists -> a CPU batch), moved with .to(device) once per batch"

ALLOWED: dict[tuple[str, str], str] = {
    ("decode/session.py", "as_ids_tensor"): "a numpy prompt as the host tensor it is: a prompt list is host data "
                                            "too, moved to the model's device with the rest of the ids",
    ("model/gpt.py", "__init__"): _MODULE_INIT,
    ("model/hc.py", "__init__"): _MODULE_INIT,
    ("model/ops.py", "rope_inv_freq"): "called by GPT.__init__ for the inv_freq buffer: default device, like the "
                                       "module's parameters",
    ("model/gpt.py", "init_weights"): "initialisation draws from one seeded CPU generator so a seed gives the same "
                                      "weights on every device; each draw is copied once into its parameter",
    ("model/gpt.py", "uniform_"): "init_weights' helper (same reason)",
    ("method/preheat.py", "fit"): _CPU_DRAW,
    ("method/preheat.py", "fit_states"): "the calibration's fp64 least squares runs on a CPU copy of the states "
                                         "(fit moves them with .cpu()), once per calibration",
    ("bench/breakdown.py", "forward_breakdown"): _CPU_DRAW,
    ("bench/decode.py", "decode_benchmark"): _CPU_DRAW,
    ("bench/budget.py", "probe"): _CPU_DRAW,
    ("bench/budget.py", "reference_work"): "a fixed CPU workload that measures the box (its speed and load) for the "
                                           "host-side costs it scales (GGUF conversion, tokenising); never a model "
                                           "path",
    ("bench/decode.py", "batch_decode_benchmark"): _CPU_DRAW,
    ("bench/forward.py", "benchmark"): _CPU_DRAW,
    ("bench/vs_paper.py", "_run_shape"): _CPU_DRAW,
    ("bench/vs_paper.py", "agreement"): _CPU_DRAW,
    ("bench/train.py", "run_variant"): _CPU_DRAW,
    ("bench/ssd_prediction.py", "step_times"): _CPU_DRAW,
    ("bench/decode_suite.py", "make_prompts"): _HOST,
    ("bench/decode_suite.py", "random_llama"): "the random model is built and perturbed on the CPU from a seed (the "
                                               "same weights on every device), then moved",
    ("bench/decode_suite.py", "hf_twin"): "a probe of the fp32 CPU model against its transformers twin, on the CPU "
                                          "before either is moved to the run's device",
    ("apps/speedrun/train.py", "make"): _CPU_DRAW,
    ("bench/ops.py", "op_benchmark"): _CPU_DRAW,
    ("eval/data.py", "sample_prompts"): _CPU_DRAW,
    ("bench/selfcheck.py", "_ids"): _CPU_DRAW,
    ("bench/selfcheck.py", "law_model"): "the law model is built and perturbed on the CPU from a seed (the same "
                                         "weights on every device), then moved with .to(device)",
    ("eval/analysis/jacobian.py", "power_sigma"): "power-iteration bookkeeping compared with .cpu() norms on the host",
    ("eval/analysis/jacobian.py", "jacobian_diagnostics"): _CPU_DRAW,
    ("eval/analysis/ordering.py", "orders_for"): "a CPU generator for random chunk orders (Python permutations)",
    ("eval/metrics.py", "cosine"): "metric on host vectors (embedding similarities), not a model path",
    ("io/chat.py", "collate"): _HOST,
    ("dist/load.py", "rows"): "an empty (0, ...) placeholder moved with .to(device) on the next line",
    ("dist/layer_parallel.py", "distributed_benchmark"): _CPU_DRAW,
    ("dist/layer_parallel.py", "_keep_value_embeds"): "host bookkeeping at start-up: the slot lookup table is read on "
                                                      "the host (int(lut[s])) and moved with .to(device) where it "
                                                      "indexes a device tensor",
    ("eval/mc.py", "pad_batch"): _HOST,
}


def _flagged() -> list[tuple[str, str, int, str]]:
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        out += _flag_tree(ast.parse(path.read_text()), path.relative_to(ROOT).as_posix())
    return out


def _flag_tree(tree: ast.AST, rel: str) -> list[tuple[str, str, int, str]]:
    """(file, function, line, call) of every factory call without device= in one module."""
    out = []
    owner: dict[int, str] = {}
    for fn in ast.walk(tree):  # innermost function wins: walk order visits outer functions first
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for sub in ast.walk(fn):
                owner[id(sub)] = fn.name
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                and node.func.attr in FACTORIES):
            continue
        kws = {k.arg for k in node.keywords}
        if "device" in kws or None in kws or (node.func.attr == "Generator" and node.args):
            continue
        out.append((rel, owner.get(id(node), "<module>"), node.lineno, f"torch.{node.func.attr}"))
    return out


def test_every_tensor_factory_names_its_device():
    bad = [f"snlp/{rel}:{line} in {fn}(): {call}(...) without device=" for rel, fn, line, call in _flagged()
           if (rel, fn) not in ALLOWED]
    assert not bad, "tensor factories without device= (pass device=, or allow-list with a reason):\n" + "\n".join(bad)


def test_allow_list_has_no_stale_entries():
    used = {(rel, fn) for rel, fn, _, _ in _flagged()}
    stale = sorted(set(ALLOWED) - used)
    assert not stale, f"allow-list entries that flag nothing any more (remove them): {stale}"


def test_the_walk_flags_a_cpu_tensor():
    """The detector itself: a factory without device= is found, one with it is not."""
    src = "import torch\ndef f(x, kw):\n    a = torch.arange(3)\n    b = torch.arange(3, device=x.device)\n" \
          "    g = torch.Generator()\n    h = torch.Generator(x.device)\n    z = torch.zeros(3, **kw)\n"
    assert _flag_tree(ast.parse(src), "m.py") == [("m.py", "f", 3, "torch.arange"), ("m.py", "f", 5, "torch.Generator")]
