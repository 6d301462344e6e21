"""The paper's evaluation: metrics, the evaluation protocol (EvalConfig -> evaluate -> EvalRecord) and its
validation data, EmbSim, multiple-choice tasks, presentation (tables, CSV, the frontier plot) and the analysis
suite (snlp.eval.analysis)."""

from snlp.runtime.lazy import lazy_exports

__all__ = ["EvalConfig", "EvalRecord", "evaluate", "MCConfig", "MCResult", "evaluate_mc"]
__getattr__, __dir__ = lazy_exports(globals(), {
    "snlp.eval.mc": "MCConfig MCResult",
    "snlp.eval.mc_eval": "evaluate_mc",
    "snlp.eval.protocol": "EvalConfig EvalRecord evaluate",
})
