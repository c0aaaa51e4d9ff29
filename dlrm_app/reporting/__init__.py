"""Reporting: a run directory -> ``report.md`` with its plots (``report``, ``plots``) and
TensorBoard event files."""
