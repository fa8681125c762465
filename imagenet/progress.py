"""The human-readable progress lines (rank 0 only; callers decide)."""

from __future__ import annotations

import datetime
import logging

log = logging.getLogger(__name__)


def _duration(seconds: float) -> str:
    return str(datetime.timedelta(seconds=int(max(seconds, 0))))


def print_train_progress(r: dict) -> None:
    """One line like the classic's, plus lr, throughput, data wait and ETAs."""
    width = len(str(r["steps"]))
    mem = f"  mem {r['max_mem_gb']:.1f}G" if "max_mem_gb" in r else ""
    log.info("Epoch: [%d][%*d/%d]  Time %6.3f  Data %6.3f  Loss %.4e (%.4e)  Acc@1 %6.2f  "
             "Acc@5 %6.2f  LR %.3g  %.1f img/s  data-wait %3.0f%%  ETA %s (run %s)%s",
             r["epoch"], width, r["step"], r["steps"], r["batch_time"], r["data_time"],
             r["loss"], r["loss_avg"], r["acc1"], r["acc5"], r["lr"], r["images_per_sec"],
             100 * min(r["data_wait"], 1.0), _duration(r["eta_epoch"]), _duration(r["eta_run"]),
             mem)


def print_val_progress(r: dict) -> None:
    """The classic's 'Test:' line (this rank's shard so far)."""
    width = len(str(r["batches"]))
    log.info("Test: [%*d/%d]  Time %6.3f  Acc@1 %6.2f  Acc@5 %6.2f", width, r["batch"],
             r["batches"], r["batch_time"], r["acc1"], r["acc5"])
