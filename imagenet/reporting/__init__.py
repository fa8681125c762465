"""Reporting: what a run writes for people besides checkpoints.

  logger    console logging, what a person reads before a run starts (--demo's settings,
            where outputs go) and progress lines, TensorBoard, metrics.jsonl, config.json
            (rank 0); start-up stages that take a while say so, and how long they took; the
            names of the files reporting writes.
  trackers  --log-to mlflow,wandb: the same scalars, flags and final metrics, continued across
            resumes (OUTPUT_DIR/trackers.json); imported only when --log-to names one.
  results   the files of a validation's report: predictions CSV, per-class CSV/JSON,
            confusion matrix (also a TensorBoard image), the worst classes (``ReportFiles``);
            imported when a report is written (-e, the last epoch) or --predictions checked.
"""
