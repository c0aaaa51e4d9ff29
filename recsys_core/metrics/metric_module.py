"""``RecMetricModule`` (TorchRec's ``torchrec.metrics.metric_module`` shape): the one object a
training loop updates with each batch's model output and asks for metric values.

Example::

    tasks = [RecTaskInfo(name="DefaultTask")]
    module = RecMetricModule(
        batch_size=B, world_size=1,
        rec_tasks=tasks,
        rec_metrics=RecMetricList([NEMetric(1, 0, B, tasks), AUCMetric(1, 0, B, tasks)]),
    )
    module.update({"prediction": probs, "label": labels, "weight": ones})
    module.compute()  # {"ne-DefaultTask|lifetime_ne": ..., "auc-DefaultTask|window_auc": ...}
"""

import torch
from torch import nn

from recsys_core.metrics.rec_metric import RecMetricList, RecTaskInfo

MetricState = torch.Tensor | list[torch.Tensor]
"""One metric state (TorchRec 1.9's alias): a tensor, or a list of them for window states."""
PreComputeStates = dict[str, dict[str, dict[str, MetricState]]]
"""TorchRec 1.9's alias for its pre-compute states: metric -> task -> state name -> state."""


class RecMetricModule(nn.Module):
    """Updates every metric with the tasks' entries of a model output dict.

    Args:
        batch_size: samples per batch (per rank).
        world_size: ranks that hold a share of every batch (states are all-reduced in
            ``compute`` when a process group is initialized).
        rec_tasks: the tasks; each names its prediction, label and weight keys in the output.
        rec_metrics: the metrics to maintain.
    """

    def __init__(
        self,
        batch_size: int,
        world_size: int,
        rec_tasks: list[RecTaskInfo] | None = None,
        rec_metrics: RecMetricList | None = None,
    ) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.world_size = world_size
        self.rec_tasks = list(rec_tasks or [])
        self.rec_metrics = rec_metrics if rec_metrics is not None else RecMetricList([])

    def update(self, model_out: dict[str, torch.Tensor]) -> None:
        """``model_out`` holds, per task, its prediction, label and (optional) weight keys."""
        predictions, labels, weights = {}, {}, {}
        for task in self.rec_tasks:
            for key in (task.prediction_name, task.label_name):
                if key not in model_out:
                    raise KeyError(
                        f"RecMetricModule: task {task.name!r} needs {key!r} in the model output "
                        f"(it has {sorted(model_out)})"
                    )
            predictions[task.name] = model_out[task.prediction_name]
            labels[task.name] = model_out[task.label_name]
            if task.weight_name in model_out:
                weights[task.name] = model_out[task.weight_name]
        self.rec_metrics.update(predictions=predictions, labels=labels, weights=weights)

    def compute(self) -> dict[str, torch.Tensor]:
        return self.rec_metrics.compute()

    def reset(self) -> None:
        self.rec_metrics.reset()


__all__ = ["RecMetricModule"]
