"""--distill-teacher: the teacher as the trainer builds it (distill.build_teacher) from a file,
inside the trainer's own training step (engine.train_one_epoch).

Whole runs (its record in the checkpoint, a bitwise mid-epoch resume, a resume with another
teacher refused) are in test_lamb_lars_distill_runs.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torchvision
from helpers import SMALL_ARCH, tiny_engine, tiny_net, uint8_batches

from imagenet.checkpoint.teacher import build_teacher
from imagenet.data.transforms import normalize
from imagenet.errors import UsageError
from imagenet.settings.flags import parse_config
from imagenet.training.distill import Teacher, check_resumed
from imagenet.training.engine import Step, train_one_epoch

CLASSES = ["a", "b", "c"]


def saved_model(path: Path, classes: int = 3, seed: int = 1) -> Path:
    """A torchvision model's plain state dict (as torchvision's .pth files are)."""
    torch.manual_seed(seed)
    torch.save(torchvision.models.get_model(SMALL_ARCH, num_classes=classes).state_dict(), path)
    return path


def teacher_from(path: Path, *flags: str) -> Teacher:
    cfg = parse_config(["data", "-a", SMALL_ARCH, "--distill-teacher", str(path), *flags])
    teacher = build_teacher(cfg, CLASSES, torch.device("cpu"))
    assert teacher is not None
    return teacher


def test_the_teacher_sees_the_students_mixed_batch_in_eval_mode_without_gradients(tmp_path):
    teacher = teacher_from(saved_model(tmp_path / "t.pth"))
    seen: dict[str, list] = {"student": [], "teacher": []}

    def record(who: str):
        def hook(module, args, output):
            seen[who].append((args[0].detach().clone(), module.training,
                              torch.is_grad_enabled(), output.requires_grad))
        return hook

    student = tiny_net(bn=True)  # any model: the teacher is the subject
    student.register_forward_hook(record("student"))
    teacher.model.register_forward_hook(record("teacher"))
    weights = {k: v.clone() for k, v in teacher.model.state_dict().items()}  # BN stats too
    engine = tiny_engine(student, "--mixup-alpha", "0.4", "--cutmix-alpha", "1.0", "--opt",
                         "lars", steps=2)
    engine.parts.teacher = teacher
    batches = uint8_batches(2, 4, size=32)
    train_one_epoch(engine, batches, Step())
    assert len(seen["teacher"]) == len(seen["student"]) == 2
    raw = [images for images, _ in batches]
    for (s_in, s_train, s_grad, _), (t_in, t_train, t_grad, t_out_grad), r in zip(
            seen["student"], seen["teacher"], raw):
        assert torch.equal(t_in, s_in)  # the very batch the student trained on...
        assert not torch.equal(t_in, normalize(r))  # ...after MixUp/CutMix
        assert s_train and s_grad
        assert not t_train and not t_grad and not t_out_grad
    assert all(torch.equal(v, teacher.model.state_dict()[k]) for k, v in weights.items())
    assert all(p.grad is None and not p.requires_grad for p in teacher.model.parameters())


def test_soft_and_hard_distillation_losses(tmp_path):
    path = saved_model(tmp_path / "t.pth")
    student = torch.tensor([[2.0, 0.0, -1.0], [0.5, 1.5, 0.0]])
    teacher = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 3.0]])
    label_loss = torch.tensor(0.7)
    soft = teacher_from(path, "--distill-alpha", "0.25", "--distill-temperature", "2")
    p_t = torch.softmax(teacher / 2, 1)
    kl = (p_t * (p_t.log() - torch.log_softmax(student / 2, 1))).sum(1).mean() * 4
    assert torch.allclose(soft.loss(label_loss, student, teacher), 0.75 * 0.7 + 0.25 * kl)
    hard = teacher_from(path, "--distill-type", "hard", "--distill-alpha", "1")
    ce = torch.nn.functional.cross_entropy(student, torch.tensor([0, 2]))  # teacher's argmax
    assert torch.allclose(hard.loss(label_loss, student, teacher), ce)


def test_a_teacher_of_other_classes_is_refused_in_one_line(tmp_path):
    with pytest.raises(UsageError) as err:
        teacher_from(saved_model(tmp_path / "five.pth", classes=5))
    assert str(err.value) == (f"--distill-teacher {tmp_path / 'five.pth'} scores 5 classes, "
                              "this run's data has 3: the teacher must be trained on the "
                              "student's classes")
    # an architecture's pretrained weights (ImageNet's 1,000 classes): refused before any
    # download
    cfg = parse_config(["data", "--distill-teacher", "resnet18"])
    with pytest.raises(UsageError, match="its pretrained weights score 1000 classes, this "
                                         "run's data has 3"):
        build_teacher(cfg, CLASSES, torch.device("cpu"))


def test_another_teacher_is_refused_on_resume(tmp_path):
    first = teacher_from(saved_model(tmp_path / "one.pth", seed=1))
    other = teacher_from(saved_model(tmp_path / "two.pth", seed=2))
    ckpt = {"distill_teacher": first.record()}
    check_resumed(ckpt, teacher_from(tmp_path / "one.pth"))  # the same weights: fine
    with pytest.raises(UsageError, match=r"^--distill-teacher .*two.pth \(sha256:\w{12}\) is "
                                         r"not the teacher the checkpoint was trained with"):
        check_resumed(ckpt, other)
    with pytest.raises(UsageError, match="give that teacher to resume it"):
        check_resumed(ckpt, None)
    with pytest.raises(UsageError, match="the checkpoint was trained without a teacher"):
        check_resumed({}, first)
    check_resumed({}, None)
