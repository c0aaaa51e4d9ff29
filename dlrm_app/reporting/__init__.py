"""Reporting: a run directory -> ``report.md`` with its plots (``report``, ``plots``; the ROC
and calibration points from ``curves``) and TensorBoard event files."""
