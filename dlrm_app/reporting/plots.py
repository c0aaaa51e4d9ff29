"""The PNG plots of a run's report (``dlrm_app.reporting.report.write_report`` calls ``write_plots``)."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from dlrm_app.reporting.values import column as _column
from dlrm_app.reporting.values import fmt as _fmt

if TYPE_CHECKING:  # the report imports this module
    from dlrm_app.reporting.report import Run


def write_plots(run: Run) -> dict[str, Path]:
    """PNGs under RUN/plots/ for whatever the run has logged; {title: path}."""
    # Imported here: matplotlib takes ~1 s to import, and every `dlrm-app` command imports
    # this module. Figure without pyplot: Agg, no global state.
    from matplotlib.figure import Figure

    out = run.path / "plots"
    out.mkdir(exist_ok=True)
    plots: dict[str, Path] = {}

    def save(fig: Figure, title: str, name: str) -> None:
        fig.tight_layout()
        path = out / name
        tmp = path.with_name(f".{name}.tmp")
        fig.savefig(tmp, format="png", dpi=100)
        os.replace(tmp, path)
        plots[title] = path

    steps, loss = _column(run.train, "loss")
    if np.isfinite(loss).any():
        fig = Figure(figsize=(8, 4))
        ax = fig.add_subplot()
        ax.plot(steps, loss, lw=0.8, alpha=0.35, color="C0", label="logged (window mean)")
        ax.plot(steps, _smooth(loss), lw=1.8, color="C0", label="smoothed")
        ax.set(xlabel="step", ylabel="train log loss", title="Train loss")
        ax.grid(alpha=0.3)
        ax.legend()
        save(fig, "Train loss", "train_loss.png")

    vsteps, auc = _column(run.validation, "auc")
    if np.isfinite(auc).any():
        fig = Figure(figsize=(8, 5.5))
        ax_auc, ax_ne = fig.subplots(2, 1, sharex=True)
        ax_auc.plot(vsteps, auc, "o-", ms=3, color="C2", label="validation AUC")
        ax_ne.plot(*_column(run.validation, "ne"), "o-", ms=3, color="C3", label="validation NE")
        teacher = run.teacher_auc("validation")
        if teacher is not None:
            ax_auc.axhline(teacher, ls="--", color="gray", label=f"teacher {teacher:.4f}")
        best = run.best()
        if best is not None:
            step, value, source = best
            label = "best" if source == "best event" else "highest"
            for ax in (ax_auc, ax_ne):
                ax.axvline(step, ls=":", color="black", lw=1)
            ax_auc.plot([step], [value], "*", ms=14, color="gold", mec="black",
                        label=f"{label}: {value:.4f} @ step {step}")
        ax_auc.set(ylabel="AUC", title="Validation")
        ax_ne.set(xlabel="step", ylabel="NE (lower is better)")
        for ax in (ax_auc, ax_ne):
            ax.grid(alpha=0.3)
            ax.legend(loc="best", fontsize=8)
        save(fig, "Validation AUC and NE", "validation.png")

    rate = _column(run.train, "samples_per_s")[1]
    if np.isfinite(rate).any():
        fig = Figure(figsize=(8, 3.5))
        ax = fig.add_subplot()
        ax.plot(steps, rate, lw=1, color="C1")
        ax.axhline(np.nanmedian(rate), ls="--", color="gray",
                   label=f"median {np.nanmedian(rate):,.0f}")
        ax.set(xlabel="step", ylabel="samples/s", title="Training throughput (all ranks)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
        save(fig, "Throughput", "throughput.png")

    for name, evaluation in run.evaluations.items():
        roc = evaluation.get("roc") or {}
        if roc.get("fpr"):
            fig = Figure(figsize=(4.8, 4.8))
            ax = fig.add_subplot()
            auc_value = _fmt((evaluation.get("metrics") or {}).get("auc"))
            ax.plot(roc["fpr"], roc["tpr"], color="C0", label=f"model (AUC {auc_value})")
            ax.plot([0, 1], [0, 1], ls="--", color="gray", label="chance")
            ax.set(xlabel="false positive rate", ylabel="true positive rate", xlim=(0, 1),
                   ylim=(0, 1), title=f"ROC: {name}", aspect="equal")
            ax.grid(alpha=0.3)
            ax.legend(loc="lower right")
            save(fig, f"ROC: {name}", f"roc_{name}.png")
        calibration = evaluation.get("calibration") or {}
        if calibration.get("counts"):
            fig = Figure(figsize=(4.8, 6))
            ax, ax_count = fig.subplots(2, 1, sharex=True, height_ratios=[3, 1])
            ax.plot([0, 1], [0, 1], ls="--", color="gray", label="perfectly calibrated")
            ax.plot(calibration["mean_predicted"], calibration["observed_rate"], "o-",
                    color="C0", label="model")
            ax.set(ylabel="observed positive rate", xlim=(0, 1), ylim=(0, 1),
                   title=f"Calibration: {name}")
            ax.grid(alpha=0.3)
            ax.legend(loc="upper left")
            width = 1 / max(int(calibration.get("bins") or 10), 1)
            ax_count.bar(calibration["mean_predicted"], calibration["counts"], width=width * 0.8,
                         color="C0", alpha=0.6, log=True)
            ax_count.tick_params(axis="y", which="minor", labelleft=False)
            ax_count.set(xlabel="mean predicted probability (per bin)", ylabel="rows")
            save(fig, f"Calibration: {name}", f"calibration_{name}.png")

    curve = run.learning_curve
    if curve is not None:
        rows = [int(p["rows"]) for p in curve]
        fig = Figure(figsize=(7, 4))
        ax = fig.add_subplot()
        ax.plot(rows, [p["test_auc"] for p in curve], "o-", color="C0", label="default DLRM")
        form = [(r, p["teacher_form_auc"]) for r, p in zip(rows, curve, strict=True)
                if "teacher_form_auc" in p]
        if form:
            ax.plot(*zip(*form, strict=True), "s:", color="C1",
                    label="teacher's form, fitted to the same rows")
        ax.plot(rows, [p["teacher_auc"] for p in curve], "--", color="C2",
                label="teacher (best achievable)")
        ax.set(xscale="log", xlabel="generated rows", ylabel="test AUC",
               title="Learning curve (bench/learning_curve.py)")
        ax.grid(alpha=0.3)
        ax.legend()
        save(fig, "Learning curve", "learning_curve.png")
    return plots


def _smooth(values: np.ndarray) -> np.ndarray:
    """Debiased exponential moving average (TensorBoard's), its weight set by the length."""
    weight = min(max(1 - 10 / max(values.size, 1), 0.0), 0.98)
    out, mean, total = np.empty_like(values), 0.0, 0.0
    for i, value in enumerate(values):
        if math.isfinite(value):
            mean, total = weight * mean + (1 - weight) * value, weight * total + (1 - weight)
        out[i] = mean / total if total else math.nan
    return out


