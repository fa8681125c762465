"""Evaluation beyond top-1: --tta-flip, per-image predictions and the per-class report
(``report``), -e on another ImageFolder and the checks before any of it is written
(``eval_data``).
"""
