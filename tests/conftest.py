"""Fixtures; the helpers they use are in helpers.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import write_image_folder


@pytest.fixture(scope="module", autouse=True)
def module_folders_are_removed_if_it_passed(request, tmp_path_factory):
    """The folders a module's fixtures made with ``tmp_path_factory.mktemp`` go when its last test
    ends without a failure; a failing module keeps them to look at.

    Checkpoints make a test's folder hundreds of MB: kept all at once the suite needed ~15 GB
    and a CI machine with less free disk failed two thirds of the way through. (Each test's
    own ``tmp_path`` goes when it passes: ``tmp_path_retention_policy`` in pyproject.toml.)
    """
    base = tmp_path_factory.getbasetemp()
    before, failed = set(base.iterdir()), request.session.testsfailed
    yield
    if request.session.testsfailed == failed:
        for folder in set(base.iterdir()) - before:
            shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def image_folder(tmp_path: Path) -> Path:
    """A 3-class JPEG ImageFolder: 24 train and 9 val images."""
    return write_image_folder(tmp_path / "data")
