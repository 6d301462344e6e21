"""The harness's own hellaswag preprocessing (lm_eval/tasks/hellaswag/utils.py), imported, not copied, for the
HellaSwag-style task of this folder (hellaswag_style_tiny.yaml: `process_docs: !function hellaswag_style_utils.process_docs`)."""

from lm_eval.tasks.hellaswag.utils import preprocess, process_docs

__all__ = ["preprocess", "process_docs"]  # what the task YAML's !function names
