"""What every start checks and says before any data is read or process started, main.py's
(``cli``) and ``imagenet.train``'s (``api``) alike."""

from __future__ import annotations

import logging

from imagenet.settings.plan import Plan
from imagenet.training.models import check_crop_sizes

log = logging.getLogger(__name__)


def check_start(plan: Plan) -> None:
    """Say the plan's notes (warnings about the launch), then refuse crops the model cannot
    take (``UsageError``, found on the meta device). The plan itself refused the impossible
    launches (``settings.launch.plan_job``: the backend, --sync-bn's device)."""
    for note in plan.notes:
        log.warning("%s", note)
    check_crop_sizes(plan.cfg.arch, plan.crop_flags)
