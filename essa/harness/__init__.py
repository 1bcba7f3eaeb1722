"""The run harness every recipe runs in: what a run does around its algorithm.

A recipe supplies its state, its step and its checkpoint contents; the harness owns the rest:

* the resolved config, written atomically at the start of a fresh run (``config.yaml``);
* the metrics log (``metrics.jsonl``, rank 0 only) and its truncation on resume;
* the step loop: SIGINT/SIGTERM finish the current step, checkpoint it and exit 130/143; the
  wall-clock budget ``run.max_wall_seconds`` stops the loop before a step that is forecast to
  end past it (the median of the last five steps), agreed across ranks before anyone stops;
* the checkpoint cadence (every ``checkpoint_every`` steps, and always before stopping) with a
  storage fault turned into one line that says what was kept;
* progress phases (model load, SFT, held-out passes, each generation or step, export): one rich
  progress line per phase on a terminal, plain progress lines at least every 30 s elsewhere (a
  pipe or a file: Slurm, nohup, CI), the same format for every recipe, and one record per phase
  in ``phases.jsonl`` (``"event": "phase"``, start time, seconds, items done, the process's peak
  RSS so far) besides its ``"event": "progress"`` records;
* the held-out metric (``evaluation.metric``, :meth:`Harness.score`) and, at the baseline,
  every ``evaluation.every`` steps and the final evaluation, a few samples to read
  (``samples.jsonl``, truncated on resume like the metrics, and a compact console table);
* the trackers of ``run.report_to``: every metrics record (:meth:`Harness.log`), the samples,
  the resolved config and the summary; ``with harness:`` closes them whatever happens;
* the summary: ``summary.json`` (atomic, naming ``heldout_metric``) and the closing line.

``phases.jsonl`` is a file of its own rather than more lines in ``metrics.jsonl``: readers of
metrics.jsonl (essa compare, bench/, tests) take every line as a generation or baseline record.

The modules, by concern: ``run`` (:class:`Harness`, the run, and :class:`Step`, its step loop),
``interrupt`` (the signals), ``progress`` (:class:`Phase`, :class:`Reporter`: the progress
phases and lines), ``heldout`` (heldout_scores.jsonl's records), ``checkpoint`` (the JSON
checkpoint). The names below are the package's public API.
"""

from essa.harness.checkpoint import read_json_checkpoint, write_json_checkpoint
from essa.harness.heldout import HELDOUT_RECORD_KEYS, HELDOUT_SCORES_NAME, heldout_record
from essa.harness.interrupt import Interrupt
from essa.harness.progress import (
    FIRST_LINE_SECONDS,
    PROGRESS_ENV,
    PROGRESS_SECONDS,
    Phase,
    Reporter,
    format_value,
    progress_interval,
)
from essa.harness.run import Harness, Step

__all__ = [
    "FIRST_LINE_SECONDS",
    "HELDOUT_RECORD_KEYS",
    "HELDOUT_SCORES_NAME",
    "PROGRESS_ENV",
    "PROGRESS_SECONDS",
    "Harness",
    "Interrupt",
    "Phase",
    "Reporter",
    "Step",
    "format_value",
    "heldout_record",
    "progress_interval",
    "read_json_checkpoint",
    "write_json_checkpoint",
]
