"""Evaluation: the recipe's sampling settings for it, the accumulator the validation loop feeds, the files it
saves and the tables it prints.

``EvalSettings`` (``settings.py``) is ``model.evaluation`` in a recipe: how many responses to sample per prompt and
how, separately from training's sampling. ``EvalAccumulator`` (``accumulate.py``) collects every scored response of
a validation epoch and computes avg@k, pass@k and maj@k with standard errors, overall and per ``data_source``, with
the estimators of ``rllight.algorithms.evaluation``; ``write`` saves every number and every response
(``files.py``), so that two runs can be compared prompt by prompt (join the row files on ``source``), and
``read_evaluation`` reads them back. ``evaluation_table`` and ``before_after`` (``tables.py``) print one
evaluation, or two of the same rows side by side.

``Evaluator`` (``evaluator.py``) runs a validation's passes with them (the module's ``validation_step`` and
``on_validation_epoch_end`` call ``Evaluator.run`` and ``Evaluator.finish``)::

    run:     acc.update_rollout(rows, settings.n, rollout)     # rows kept, in order
             acc.drop(dropped_rows)                           # prompts too long to ask
    finish:  acc.merge(Ranks(trainer).gather_objects(acc.state()))   # under DDP only
             acc.compute(settings.ks); acc.write(log_dir, settings.ks); acc.reset()
"""

from rllight.evaluation.accumulate import EvalAccumulator, extract_answer, read_evaluation
from rllight.evaluation.evaluator import Evaluator
from rllight.evaluation.settings import EvalSettings
from rllight.evaluation.tables import before_after, column_notes, evaluation_table, paired_se

__all__ = [
    "EvalAccumulator",
    "EvalSettings",
    "Evaluator",
    "before_after",
    "column_notes",
    "evaluation_table",
    "extract_answer",
    "paired_se",
    "read_evaluation",
]
