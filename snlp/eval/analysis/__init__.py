"""The paper's layer-parallelism diagnostics and inference ablations on a checkpoint (`snlp analyze`,
snlp.apps.analyze). One module per section, each a function (AnalysisConfig in, result dataclass out):

  common       AnalysisConfig, PPL over validation windows, markdown cells
  jacobian     per-layer sigma_max / Hutchinson ||J||_F / amplification / substitution errors
  ordering     IDN correction orders: Seq-Perm, IDN and no-correction PPL, AR-ness
  propagation  the correction-propagation staircase
  earlyexit    K = 0 PPL with the last N layers skipped
  elk          ELK a x init sweep and preheat calibrations (the only module that touches preheat)
  jacobi       Jacobi decoding x SNLP coupling
  tables, plots, report   markdown tables, PNG plots, `analyze` (all sections) and `write`

This package re-exports the public names, so `snlp.eval.analysis.X` works for each; code inside snlp
imports from the concrete module instead."""

from snlp.eval.analysis.common import (DIV, SECTIONS, AnalysisConfig, add_nll, fmt, md_table, plan_ppl,
                                       sequential_ppl, window_ppl)
from snlp.eval.analysis.earlyexit import ExitRow, early_exit
from snlp.eval.analysis.elk import (ElkResult, ElkRow, PreheatResult, PreheatRow, chunkings, elk_sweep,
                                    preheat_calibrations, preheat_ppls)
from snlp.eval.analysis.jacobi import JacobiResult, JacobiRow, jacobi_coupling
from snlp.eval.analysis.jacobian import (JacobianResult, LayerDiag, amplification, branch, hutchinson_frob2,
                                         jacobian_diagnostics, power_sigma, residual_input, substitution_errors)
from snlp.eval.analysis.ordering import (IdnSummary, OrderingResult, OrderingSummary, OrderingTable, OrderRow,
                                         ar_ness, correction_ordering, orders_for)
from snlp.eval.analysis.propagation import PropagationResult, correction_propagation
from snlp.eval.analysis.report import (AnalysisResult, Environment, analyze, environment, report_section,
                                       to_markdown, write, write_plots)
from snlp.eval.analysis.tables import (early_exit_table, elk_table, jacobi_table, jacobian_table, ordering_summary,
                                       ordering_tables, preheat_table, propagation_table)

__all__ = ["DIV", "SECTIONS", "AnalysisConfig", "add_nll", "fmt", "md_table", "plan_ppl", "sequential_ppl",
           "window_ppl", "ExitRow", "early_exit", "ElkResult", "ElkRow", "PreheatResult", "PreheatRow", "chunkings",
           "elk_sweep", "preheat_calibrations", "preheat_ppls", "JacobiResult", "JacobiRow", "jacobi_coupling",
           "JacobianResult", "LayerDiag", "amplification", "branch", "hutchinson_frob2", "jacobian_diagnostics",
           "power_sigma", "residual_input", "substitution_errors", "IdnSummary", "OrderingResult", "OrderingSummary",
           "OrderingTable", "OrderRow", "ar_ness", "correction_ordering", "orders_for", "PropagationResult",
           "correction_propagation", "AnalysisResult", "Environment", "analyze", "environment", "report_section",
           "to_markdown", "write", "write_plots", "early_exit_table", "elk_table", "jacobi_table", "jacobian_table",
           "ordering_summary", "ordering_tables", "preheat_table", "propagation_table"]
