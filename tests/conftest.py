"""Fixtures; the helpers they use are in helpers.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import write_image_folder


@pytest.fixture
def image_folder(tmp_path: Path) -> Path:
    """A 3-class JPEG ImageFolder: 24 train and 9 val images."""
    return write_image_folder(tmp_path / "data")
