"""The training batches that load while the model is built (what each start-up stage costs is
timed by ``reporting.stages.StartClock``).

``EarlyBatches``: once the data set is listed, the training loader's workers start and fetch the
first batches of the position the resume will continue (read from the checkpoint's small
entries, without its tensors), while the model is built, the checkpoint loaded and the output
folder checked. The batches are only used when the resume then puts the data exactly there
(same order seed, augmentation seed, epoch and images already trained); otherwise the workers
are stopped and the loader starts again, as it would have without them: a guess never changes
what is trained.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader

from imagenet.checkpoint.states import data_resume_point
from imagenet.data.folder import Data, FolderTrain, stop_workers
from imagenet.reporting.stages import FirstBatch
from imagenet.settings.plan import Plan

log = logging.getLogger(__name__)

Key = tuple[int, int, int, int]  # order seed, augmentation seed, epoch, images already trained


class EarlyBatches:
    """Training batches started before the resume (see the module docstring)."""

    def __init__(self, loader: DataLoader, key: Key, batches: Iterator) -> None:
        self.loader, self.key, self.batches = loader, key, batches
        self.outcome = "started early"

    def take(self, key: Key) -> Iterator | None:
        """The started batches when the data continues at ``key``; None (and the workers
        stopped) otherwise, or once taken."""
        batches, self.batches = self.batches, None
        if batches is None:
            return None
        if key == self.key:
            self.outcome = "loaded during the start"
            return batches
        log.debug("the training batches started early were for %s, the resume continues at "
                  "%s: started again", self.key, key)
        self.outcome = "started early for another position: started again"
        stop_workers(self.loader)
        return None


def start_early(plan: Plan, data: Data, ckpt: dict[str, Any] | None) -> EarlyBatches | None:
    """Start the training loader's workers on the batches the resume of ``ckpt`` (the
    checkpoint decided and read once; None: a fresh start) is expected to continue with
    (``expected_start``); None without loader workers, or when it cannot tell. The data's
    seeds are left as they were: the resume sets them."""
    train = data.train
    if plan.layout.workers == 0 or not isinstance(train, FolderTrain):
        return None
    try:
        key = expected_start(plan, train, ckpt)
    except Exception as exc:  # the resume itself reports what is wrong with the checkpoint
        log.debug("no early start of the training loader: %s", exc)
        return None
    if key is None:
        return None
    seeds = train.order_seed, train.aug_seed
    order_seed, aug_seed, epoch, images = key
    train.reseed(order_seed, aug_seed)
    train.continue_after(epoch, images)
    batches = iter(FirstBatch(train.loader, plan.layout.workers, "training"))
    train.reseed(*seeds)  # the workers hold their copy; the resume decides the run's
    return EarlyBatches(train.loader, key, batches)


def expected_start(plan: Plan, train: FolderTrain, ckpt: dict[str, Any] | None) -> Key | None:
    """Where ``resume`` will put the training data - (order seed, augmentation seed, epoch,
    images already trained) - by the same rule (``data_resume_point``) from the checkpoint it
    resumes, ``ckpt``, before the model exists; None when there is nothing to train first or it
    cannot tell. A guess to start the loader early (``run.startup``): the trainer uses those
    batches only if the resume agrees."""
    cfg, layout = plan.cfg, plan.layout
    if cfg.evaluate:
        return None
    if ckpt is None:
        return train.order_seed, train.aug_seed, cfg.start_epoch, 0
    steps = layout.optimizer_steps(train.batches)
    point = data_resume_point(ckpt, cfg, layout, steps, train)
    order_seed = int(ckpt["sampler"]["seed"]) if ckpt.get("sampler") else train.order_seed
    aug_seed = int(ckpt.get("aug_seed", train.aug_seed))
    if point.step_in_epoch < steps:
        return order_seed, aug_seed, point.epoch, min(point.images, train.images)
    if point.epoch + 1 < cfg.epochs:  # only the validation is left: then the next epoch
        return order_seed, aug_seed, point.epoch + 1, 0
    return None
