"""The kernel chain of a compiled batch-1 decode step on CPU inductor: the kernels inductor generates at the T = 1
compile (torch._inductor.metrics.generated_kernel_count) plus the extern GEMM and attention ops one call runs
(torch.profiler), for the sequential step and each drafter plan. A CPU's C++ kernels fuse as triton's do, not
identically: a cross-check of the eager counts of scripts/decode_ops.py, not a GPU measurement.

    PYTHONPATH=$PWD python3 scripts/decode_chain_compiled.py CKPT sequential 12xF1-h0-K1 16xF1-h0-K3
"""
import sys, torch
from torch.profiler import profile, ProfilerActivity
from torch._inductor import metrics
from snlp.io.checkpoint import load
from snlp.decode.steps import Step, sequential_fn, snlp_fn
from snlp.method.solver import bind

torch.set_num_threads(1)
model, _ = load(sys.argv[1], device="cpu")
model = model.eval()
EXTERN = ("aten::mm", "aten::bmm", "aten::addmm", "snlp::cpu_bmm", "aten::_scaled_dot_product", "aten::baddbmm")
for name in sys.argv[2:]:
    torch._dynamo.reset()
    fn = sequential_fn(model) if name == "sequential" else snlp_fn(bind(model, name, check_finite=False))
    step = Step(fn, "cpu", compile=True)
    cache = step.new_cache(model, 1, 64)
    with torch.inference_mode():
        step(torch.zeros(1, 16, dtype=torch.long), cache)  # prefill (its own graph)
        metrics.reset()
        step(torch.zeros(1, 1, dtype=torch.long), cache)  # compiles the T = 1 graph
        gen = metrics.generated_kernel_count
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step(torch.zeros(1, 1, dtype=torch.long), cache)
    ext = sum(e.count for e in prof.key_averages() if e.key.startswith(EXTERN) and not e.key.startswith("snlp::cpu_bmm"))
    print(f"{name}: generated {gen}, extern {ext}, chain {gen + ext}", flush=True)
