"""Evaluation (``validate``): the validation loop, every image once at any world size; --tta-flip,
each rank's per-image predictions gathered for the report (its files: ``reporting.results``); -e
on another ImageFolder. Imported at the first validation: nothing before the first step uses it.
"""
