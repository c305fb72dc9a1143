"""Scaling the transaction workers on the work queue's backlog.

Serve's default policy scales a deployment on the requests its replicas are handling, but a transaction
worker receives no requests: it pulls its work from the Redis stream. In the one-machine topology the worker
also owns the models, so its replicas are the service's whole analysis capacity; they are scaled on the work
that waits for them instead. Every worker replica reports `backlog`, the transactions queued or in flight
(the stream's unacknowledged entries, one number for the whole service), through Serve's custom autoscaling
metrics (TransactionWorker.record_autoscaling_stats), and QueueBacklogPolicy asks for one replica per
`target_backlog_per_replica` of it. Serve applies min_replicas, max_replicas and the up/downscale delays
around the policy (config/serve.yaml shows the configuration).

Serve pickles this module by value into its controller: it imports nothing beyond the standard library.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray.serve.config import AutoscalingContext

BACKLOG_METRIC = "backlog"


class QueueBacklogPolicy:
    """`policy_function` of a worker's autoscaling_config; `policy_kwargs` set the target."""

    def __init__(self, target_backlog_per_replica: float = 32) -> None:
        if target_backlog_per_replica <= 0:
            raise ValueError("target_backlog_per_replica must be positive")
        self.target_backlog_per_replica = target_backlog_per_replica

    def __call__(self, ctx: AutoscalingContext) -> tuple[int, dict[str, Any]]:
        reported = (ctx.aggregated_metrics or {}).get(BACKLOG_METRIC) or {}
        if not reported:
            return ctx.target_num_replicas, {}  # nothing reported yet (replicas starting): keep the target
        # Every replica reports the same queue; the highest report is the most recent view of a growing one.
        backlog = max(reported.values())
        # Never below one: a worker that does not run consumes nothing, and reports no backlog to scale on.
        return max(1, math.ceil(backlog / self.target_backlog_per_replica)), {}
