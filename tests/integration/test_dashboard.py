"""deploy/grafana-dashboard.json queries only series that the running service really exports."""

from __future__ import annotations

import json
import re
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.faces_dev import REPO_ROOT, FacesDev
from tests.integration.api_client import (
    age_estimation,
    auth,
    face_search_multipart,
    reference_of,
    wait_result,
)
from tests.service_harness import RunningService

pytestmark = pytest.mark.service

DASHBOARD = REPO_ROOT / "deploy" / "grafana-dashboard.json"
OPERATIONS = REPO_ROOT / "docs" / "operations.md"

# Words of PromQL that look like identifiers but name no series.
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring"}
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_MATCHERS = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)?\s*\{([^}]*)\}")
_MATCHER = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
_IDENTIFIER = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_LABEL_VALUES = re.compile(r"label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*,\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)")


@dataclass
class QueryUse:
    """What one PromQL expression needs from the endpoint."""

    metrics: set[str] = field(default_factory=set)
    grouping_labels: set[str] = field(default_factory=set)
    # metric -> (label, exact value or None for a regex / negative / templated matcher)
    matchers: dict[str, set[tuple[str, str | None]]] = field(default_factory=lambda: defaultdict(set))


def parse_query(expr: str) -> QueryUse:
    use = QueryUse()
    for metric, body in _MATCHERS.findall(expr):
        for label, operator, value in _MATCHER.findall(body):
            exact = value if operator == "=" and "$" not in value else None
            use.matchers[metric].add((label, exact))
    for labels in _GROUPING.findall(expr):
        use.grouping_labels |= {label.strip() for label in labels.split(",") if label.strip()}
    bare = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    bare = re.sub(r"\{[^}]*\}", "", bare)
    bare = re.sub(r"\[[^\]]*\]", "", bare)  # range selectors and $__rate_interval
    bare = re.sub(r"\boffset\s+[0-9smhdwy]+", "", bare)  # offset durations (alert rules)
    bare = _GROUPING.sub("", bare)
    for match in _IDENTIFIER.finditer(bare):
        followed_by_call = bare[match.end() :].lstrip().startswith("(")
        if not followed_by_call and match.group() not in _KEYWORDS:
            use.metrics.add(match.group())
    return use


def dashboard_queries(dashboard: dict[str, Any]) -> Iterator[tuple[str, QueryUse]]:
    """(where, what it needs) for every panel target and every query variable."""

    def walk(panels: list[dict[str, Any]]) -> Iterator[tuple[str, QueryUse]]:
        for panel in panels:
            yield from walk(panel.get("panels", []))
            for target in panel.get("targets", []):
                yield f"panel {panel['title']!r} {target['refId']}", parse_query(target["expr"])

    yield from walk(dashboard["panels"])
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
        found = _LABEL_VALUES.fullmatch(query.strip())
        assert found, f"variable {variable['name']}: only label_values(metric, label) is understood"
        use = QueryUse(metrics={found.group(1)})
        use.matchers[found.group(1)].add((found.group(2), None))
        yield f"variable {variable['name']!r}", use


def test_query_parser_reads_names_labels_and_matchers() -> None:
    """The extraction the dashboard test relies on, on expressions shaped like the dashboard's."""
    use = parse_query(
        "histogram_quantile(0.95, sum by (le, route) (rate(ray_serve_http_request_latency_ms_bucket"
        '{application=~"$application",status_code="200"}[$__rate_interval]))) / on (route) '
        "max(ray_facesearch_queue_depth) and ray_serve_deployment_replica_healthy"
    )
    assert use.metrics == {
        "ray_serve_http_request_latency_ms_bucket",
        "ray_facesearch_queue_depth",
        "ray_serve_deployment_replica_healthy",
    }
    assert use.grouping_labels == {"le", "route"}
    assert use.matchers["ray_serve_http_request_latency_ms_bucket"] == {
        ("application", None),
        ("status_code", "200"),
    }


def scrape_series(metrics_url: str) -> dict[str, list[dict[str, str]]]:
    """Sample name (suffixes such as _bucket and _total included) -> label sets of its samples."""
    series: dict[str, list[dict[str, str]]] = defaultdict(list)
    for family in text_string_to_metric_families(httpx.get(metrics_url, timeout=10).text):
        for sample in family.samples:
            series[sample.name].append(dict(sample.labels))
    return series


def alert_queries(markdown: str) -> Iterator[tuple[str, QueryUse]]:
    """(where, what it needs) for every rule of the Prometheus alert rules documented in operations.md (the
    yaml block after the `alert-rules` marker)."""
    block = re.search(r"<!-- alert-rules[^>]*-->\s*```yaml\n(.*?)```", markdown, re.DOTALL)
    assert block, "no alert rules block in docs/operations.md"
    for group in yaml.safe_load(block.group(1))["groups"]:
        for rule in group["rules"]:
            yield f"alert {rule['alert']!r}", parse_query(rule["expr"])


def missing_series(
    dashboard: dict[str, Any], series: dict[str, list[dict[str, str]]], application: str
) -> list[str]:
    return missing_for(dashboard_queries(dashboard), series, application)


def missing_for(
    queries: Iterator[tuple[str, QueryUse]], series: dict[str, list[dict[str, str]]], application: str
) -> list[str]:
    problems = []
    for where, use in queries:
        for metric in sorted(use.metrics):
            samples = [
                labels
                for labels in series.get(metric, [])
                if labels.get("application") in (None, application)
            ]
            if not samples:
                problems.append(f"{where}: no series {metric}")
                continue
            for label, value in sorted(use.matchers.get(metric, set()), key=str):
                if not any(label in labels and value in (None, labels[label]) for labels in samples):
                    problems.append(f"{where}: {metric} has no label {label}={value or '*'}")
        for label in sorted(use.grouping_labels):
            if not any(label in labels for metric in use.metrics for labels in series.get(metric, [])):
                problems.append(f"{where}: none of {sorted(use.metrics)} has the label {label!r}")
    return problems


def search_result(body: dict[str, Any]) -> dict[str, Any]:
    result: dict[str, Any] = body["result"]["data"]["face_search_response"]["result"]
    return result


def test_every_dashboard_query_has_its_series(service: RunningService, faces_dev: FacesDev) -> None:
    dashboard = json.loads(Path(DASHBOARD).read_text())
    queries = list(dashboard_queries(dashboard))
    names = set().union(*(use.metrics for _, use in queries))
    # Serve's own series and the service's: a parser that found nothing would pass vacuously.
    assert {name for name in names if name.startswith("ray_serve_")}, names
    assert {name for name in names if name.startswith("ray_facesearch_")}, names
    assert all(name.startswith("ray_") for name in names), names
    datasource = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert datasource and datasource[0]["query"] == "prometheus"
    assert all(
        target["datasource"]["uid"] == "${datasource}"
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    )

    # Traffic that produces every series the dashboard reads: an enrolling face search (model batches,
    # Milvus, transactions) and a search that matches it (the match-score series), an age estimation, and
    # error answers (the HTTP error counters appear only after the first 4xx).
    client = service.new_client("dashboard")
    token = service.token_for(client)
    identity = next(iter(faces_dev.by_identity().values()))
    with service.http() as http:
        reference_id = reference_of(
            face_search_multipart(http, token, identity[0].path, client_reference="dashboard-ref")
        )
        wait_result(http, token, reference_id)
        mate = reference_of(face_search_multipart(http, token, identity[1].path, enroll_face=0))
        assert search_result(wait_result(http, token, mate))["matched_faces"]
        faceless = reference_of(face_search_multipart(http, token, faces_dev.of_kind("negative")[0].path))
        assert not search_result(wait_result(http, token, faceless))["is_face_found"]
        assert (
            age_estimation(http, token, faces_dev.of_kind("age")[0].path, wait_for_result="1").status_code
            == 200
        )
        assert http.post("/result", headers=auth("not-a-token"), json={}).status_code == 401
        assert http.get("/no-such-endpoint").status_code == 404

    # Ray's metrics agent exports every few seconds and Serve flushes cached counters on its own timer.
    deadline = time.monotonic() + 120
    while True:
        scraped = scrape_series(service.metrics_url)
        problems = missing_series(dashboard, scraped, "facesearch")
        problems += missing_for(alert_queries(OPERATIONS.read_text()), scraped, "facesearch")
        if not problems:
            break
        assert time.monotonic() < deadline, "\n".join(problems)
        time.sleep(3)
