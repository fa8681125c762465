"""Evaluation (``validate``): the validation loop, every image once at any world size; --tta-flip,
per-image predictions and the per-class report; -e on another ImageFolder and the checks before
any of it is written.
"""
