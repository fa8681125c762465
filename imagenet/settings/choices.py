"""Which values of -a and --log-to exist on this machine: torchvision's architectures and timm's
(``timm/NAME``, with timm installed), and the experiment trackers whose packages are installed.
Checked when the flags are parsed, before anything starts; nothing heavy is imported for a
value that does not need it.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
from types import ModuleType

from imagenet.errors import UsageError

TIMM_PREFIX = "timm/"  # -a timm/NAME: a timm model
INSTALL = "pip install 'imagenet-trainer[timm]' (or pip install timm)"
TRACKERS = ("tensorboard", "mlflow", "wandb")


def available_archs() -> list[str]:
    """Real classification architectures (not helpers like get_model)."""
    import torchvision

    return torchvision.models.list_models(module=torchvision.models)


def check_arch(arch: str, weights: str | None = None, pretrained: bool = False) -> None:
    """Raise UsageError for an unknown architecture, suggesting close names."""
    if arch.startswith(TIMM_PREFIX):
        check_timm_arch(arch, weights, pretrained)
        return
    names = available_archs()
    if arch not in names:
        close = difflib.get_close_matches(arch, names, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise UsageError(f"-a/--arch: unknown architecture '{arch}'{hint} "
                         f"(choose from torchvision.models.list_models(), e.g. resnet18, "
                         f"resnet50, vit_b_16)")


def import_timm(arch: str) -> ModuleType:
    """timm, or the one line that says how to install it."""
    try:
        import timm
    except ImportError:
        raise UsageError(f"-a {arch} needs timm, which is not installed: {INSTALL}") from None
    return timm


def timm_name(arch: str) -> str:
    """'timm/resnet50.a1_in1k' -> 'resnet50.a1_in1k'."""
    return arch[len(TIMM_PREFIX):]


def check_timm_arch(arch: str, weights: str | None, pretrained: bool = False) -> None:
    """A timm model name (and weight tag) that exists; close names when it does not."""
    timm = import_timm(arch)
    name = timm_name(arch)
    base, _, tag = name.partition(".")
    if weights:
        raise UsageError(f"--weights names torchvision weights; for timm's, put the tag in the "
                         f"name and add --pretrained: -a timm/{base}.TAG --pretrained (tags: "
                         f"timm.list_pretrained('{base}.*'))")
    if not timm.is_model(base):
        close = difflib.get_close_matches(base, timm.list_models(), n=3)
        hint = f"; did you mean {', '.join(f'timm/{c}' for c in close)}?" if close else ""
        raise UsageError(f"-a/--arch: timm has no model '{base}'{hint} (choose from "
                         "timm.list_models())")
    tags = timm.list_pretrained(f"{base}.*")
    if pretrained and not tags:
        raise UsageError(f"-a {arch} --pretrained: timm has no pretrained weights for {base} "
                         "(drop --pretrained to train it from scratch)")
    if tag and name not in tags:
        known = f"; it has {', '.join(tags[:6])}" if tags else " (it has no pretrained weights)"
        raise UsageError(f"-a {arch}: timm has no weights tagged '{tag}' for {base}{known}")


def parse_log_to(text: str) -> str:
    """--log-to's value: known tracker names, comma-separated, without repeats; or 'none'."""
    names = [n.strip().lower() for n in text.split(",") if n.strip()]
    if names == ["none"]:
        return "none"
    unknown = [n for n in names if n not in TRACKERS] or ([] if names else [text])
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown tracker '{unknown[0]}': give a comma-separated list of "
            f"{', '.join(TRACKERS)}, or none")
    return ",".join(dict.fromkeys(names))


def tracker_names(log_to: str) -> list[str]:
    """The trackers of a --log-to value."""
    return [] if log_to == "none" else log_to.split(",")


def install_hint(name: str) -> str:
    """The one line for a tracker whose package is missing."""
    return (f"--log-to {name}: the {name} package is not installed; pip install "
            f"'imagenet-trainer[{name}]' (or pip install {name})")


def check_trackers_installed(log_to: str) -> None:
    """Refuse, before anything starts, a tracker whose package is missing (nothing imported)."""
    for name in tracker_names(log_to):
        if importlib.util.find_spec(name) is None:
            raise UsageError(install_hint(name))
