"""This library's own sharding search (``EmbeddingShardingPlanner`` without TorchRec
components): table specs, candidate layouts (``enumerate``), their cost (``cost``), one greedy
placement with local search (``placement``), the plan (``plan_builder``), the per-rank summary
(``stats``) and the messages when nothing fits (``shortfall``); ``search.plan_tables`` runs them.

It imports only ``recsys_core.plan``, ``recsys_core.modules``, ``recsys_core.kernels`` and the
planner's floor (``topology``, ``storage``, ``constraints``, ``errors``, ``units`` and what they
stand on: ``constants``, ``comms``, ``context_hash``), never TorchRec's
pipeline modules of the planner.
"""
