"""The workers' autoscaling policy: one replica per target backlog, never none (serve_app/deployments/
autoscaling.py), and the default config that names it."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from serve_app.deployments.autoscaling import BACKLOG_METRIC, QueueBacklogPolicy
from serve_app.launch.deploy_config import load_serve_config

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Context:
    """The part of Serve's AutoscalingContext the policy reads."""

    target_num_replicas: int = 1
    aggregated_metrics: dict[str, dict[str, float]] | None = field(default_factory=dict)


def decide(policy: QueueBacklogPolicy, context: Context) -> int:
    replicas, state = policy(context)  # type: ignore[arg-type]  # duck-typed AutoscalingContext
    assert state == {}
    return replicas


@pytest.mark.parametrize(
    ("backlog", "replicas"), [(0, 1), (1, 1), (48, 1), (49, 2), (96, 2), (97, 3), (1000, 21)]
)
def test_one_replica_per_target_backlog_and_never_none(backlog: float, replicas: int) -> None:
    policy = QueueBacklogPolicy(target_backlog_per_replica=48)
    assert decide(policy, Context(aggregated_metrics={BACKLOG_METRIC: {"r1": backlog}})) == replicas


def test_the_highest_report_counts_and_no_report_keeps_the_target() -> None:
    policy = QueueBacklogPolicy(target_backlog_per_replica=10)
    reports = {BACKLOG_METRIC: {"r1": 5.0, "r2": 31.0}}
    assert decide(policy, Context(target_num_replicas=2, aggregated_metrics=reports)) == 4
    nothing_reported: list[dict[str, dict[str, float]] | None] = [
        None,
        {},
        {BACKLOG_METRIC: {}},
        {"other": {"r1": 99.0}},
    ]
    for nothing in nothing_reported:
        assert decide(policy, Context(target_num_replicas=3, aggregated_metrics=nothing)) == 3


def test_a_target_must_be_positive() -> None:
    for target in (0, -1):
        with pytest.raises(ValueError, match="positive"):
            QueueBacklogPolicy(target_backlog_per_replica=target)


def test_the_default_config_names_the_policy_with_valid_arguments() -> None:
    args, http, *_ = load_serve_config(ROOT / "config/serve.yaml")
    assert args.topology == "in_process" and http["host"] == "127.0.0.1"
    worker: dict[str, Any] = args.deployment_options["TransactionWorker"]
    policy = worker["autoscaling_config"]["policy"]
    module_name, _, attribute = policy["policy_function"].partition(":")
    policy_class = getattr(importlib.import_module(module_name), attribute)
    assert policy_class is QueueBacklogPolicy
    built = policy_class(**policy["policy_kwargs"])
    assert built.target_backlog_per_replica == 48
    assert worker["autoscaling_config"]["min_replicas"] >= 1  # a worker that does not run reports nothing
