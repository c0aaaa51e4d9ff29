"""``dlrm-app train``: the training run in torchtitan's shape.

- ``config``: ``TrainConfig``, the run's config (its sections; every flag generated from it).
- ``trainer``: ``Trainer`` (setup, the step loop, the end of a run) and ``train``.
- ``build``: the sharded DLRM and its optimizers from the config and the dataset.
- ``components/``: the parts that decide their own "when" (metrics log, validator,
  checkpointer, preemption) and ``TrainState``.
- ``resume``: everything ``--resume`` / a requeued run / a torchrun restart decides.
- ``run_dir``, ``checkpoint``: the run directory and its atomic checkpoints.
- ``runtime``, ``resources``, ``pipeline``: process group, memory and planning, staged batches.
- ``evaluate``: metrics of a model or a saved checkpoint on a split.

Importing this package imports nothing heavy (the command line parses with its config).
"""
