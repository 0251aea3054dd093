"""The local tasks' preprocessing: the harness's own, so that scores compare with published ones."""

from lm_eval.tasks.hellaswag.utils import process_docs  # noqa: F401
