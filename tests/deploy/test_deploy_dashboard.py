"""deploy/grafana/prefixgate.json: a dashboard whose queries only use metrics the proxy exports.

The metric names and labels below mirror the proxy's /metrics contract. They are also read from
what a running proxy actually exposes, so a metric renamed in the code fails here rather than as
an empty Grafana panel.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from deploy_files import DASHBOARD, load_json
from fakes import LlamaFake, MakeProxy

# name -> labels, exactly as the contract lists them.
COUNTERS: dict[str, set[str]] = {
    "prefixgate_requests_total": {"model", "backend", "status"},
    "prefixgate_prompt_tokens_total": {"model", "backend"},
    "prefixgate_cached_tokens_total": {"model", "backend"},
    "prefixgate_cached_reported_prompt_tokens_total": {"model", "backend"},
    "prefixgate_predicted_cached_tokens_total": {"model", "backend"},
    "prefixgate_completion_tokens_total": {"model", "backend"},
    "prefixgate_slo_met_total": {"model", "backend"},
    "prefixgate_slo_evaluated_total": {"model", "backend"},
    "prefixgate_saved_prefill_seconds_total": {"model", "backend"},
    "prefixgate_saved_usd_total": {"model", "backend"},
    "prefixgate_canonical_rule_fired_total": {"rule"},
    "prefixgate_uncached_tokens_total": {"model", "backend", "cause"},
    "prefixgate_breaker_tokens_total": {"rule"},
    "prefixgate_route_decisions_total": {"backend", "reason"},
    "prefixgate_schedule_decisions_total": {"backend", "reason"},
    "prefixgate_store_failures_total": set(),
    # The control group (--control-share): exported with no samples when it is off.
    "prefixgate_control_group_requests_total": {"group"},
    "prefixgate_control_group_prompt_tokens_total": {"group"},
    "prefixgate_control_group_cached_tokens_total": {"group"},
    "prefixgate_control_group_slo_met_total": {"group"},
    "prefixgate_control_group_slo_evaluated_total": {"group"},
}
HISTOGRAMS: dict[str, set[str]] = {
    "prefixgate_time_to_first_token_seconds": {"model", "backend"},
    "prefixgate_time_to_first_visible_token_seconds": {"model", "backend"},
    "prefixgate_time_per_output_token_seconds": {"model", "backend"},
    "prefixgate_request_duration_seconds": {"model", "backend"},
    "prefixgate_proxy_overhead_seconds": set(),
    "prefixgate_held_seconds": {"backend"},
    "prefixgate_gen_ai_token_usage": {"token_type", "model"},
    "prefixgate_control_group_time_to_first_token_seconds": {"group"},
}
GAUGES: dict[str, set[str]] = {
    "prefixgate_store_degraded": set(),
    "prefixgate_backend_in_flight": {"backend"},
    "prefixgate_backend_healthy": {"backend"},
}

# PromQL words the dashboard may use besides metric names (extend when a panel needs more).
PROMQL_WORDS = {
    "sum",
    "max",
    "min",
    "avg",
    "rate",
    "increase",
    "histogram_quantile",
    "by",
    "without",
    "or",
    "and",
    "label_values",
}


def sample_names(
    counters: dict[str, set[str]],
    histograms: dict[str, set[str]],
    gauges: dict[str, set[str]],
) -> dict[str, set[str]]:
    """Series names PromQL can select, with their labels (histograms: _bucket, _sum, _count)."""
    names = {**counters, **gauges}
    for name, labels in histograms.items():
        names[f"{name}_bucket"] = labels | {"le"}
        names[f"{name}_sum"] = labels
        names[f"{name}_count"] = labels
    return names


CONTRACT = sample_names(COUNTERS, HISTOGRAMS, GAUGES)


def dashboard() -> dict[str, Any]:
    data = load_json(DASHBOARD)
    assert isinstance(data, dict)
    return data


def panels() -> list[dict[str, Any]]:
    return [p for p in dashboard()["panels"] if p["type"] != "row"]


def exprs() -> Iterator[tuple[str, str]]:
    """(panel title, PromQL) for every query of every panel."""
    for p in panels():
        for t in p["targets"]:
            yield p["title"], t["expr"]


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}")
_LABEL_MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(by|without)\s*\(([^)]*)\)")
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression (label names, strings, ranges and numbers removed)."""
    text = _GROUPING.sub(r"\1", _SELECTOR.sub(r"\1", expr))
    text = re.sub(r"\[[^\]]*\]", "", text)
    text = _STRING.sub("", text)
    return {w for w in _IDENT.findall(text) if w not in PROMQL_WORDS}


def selector_labels(expr: str) -> Iterator[tuple[str, set[str]]]:
    """(metric, label names its selector matches on) for every ``metric{...}`` in ``expr``."""
    for metric, body in _SELECTOR.findall(expr):
        yield metric, set(_LABEL_MATCHER.findall(_STRING.sub('""', body)))


def grouping_labels(expr: str) -> set[str]:
    return {
        label.strip()
        for _, labels in _GROUPING.findall(expr)
        for label in labels.split(",")
        if label.strip()
    }


def check_against(known: dict[str, set[str]]) -> list[str]:
    """Problems with the dashboard's queries against ``known`` series names and labels."""
    problems = []
    for title, expr in exprs():
        names = metric_names(expr)
        if not names:
            problems.append(f"{title}: no metric in {expr!r}")
        for name in names - set(known):
            problems.append(f"{title}: unknown metric {name}")
        for metric, labels in selector_labels(expr):
            for label in labels - known.get(metric, labels):
                problems.append(f"{title}: {metric} has no label {label}")
        usable = set().union(*(known.get(n, set()) for n in names)) if names else set()
        for label in grouping_labels(expr) - usable:
            problems.append(f"{title}: grouping by {label}, which none of {sorted(names)} has")
    for var in dashboard()["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", var["definition"])
            assert m, var["definition"]
            if m.group(1) not in known or m.group(2) not in known[m.group(1)]:
                problems.append(f"variable {var['name']}: {var['definition']}")
    return problems


def test_dashboard_is_well_formed() -> None:
    """Valid JSON; unique panel ids; each panel queries the datasource variable; balanced PromQL."""
    d = dashboard()
    assert d["uid"] == "prefixgate" and d["schemaVersion"] >= 36
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    for p in panels():
        assert p["targets"], p["title"]
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        pos = p["gridPos"]
        assert pos["x"] + pos["w"] <= 24, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
    for title, expr in exprs():
        for open_, close in ("()", "{}", "[]"):
            assert expr.count(open_) == expr.count(close), f"{title}: unbalanced {open_}{close}"


def test_queries_use_only_contract_metrics_and_labels() -> None:
    """Every metric and label in every query is one the /metrics contract defines."""
    assert check_against(CONTRACT) == []


def test_checker_catches_unknown_names() -> None:
    """The name check is live: a misspelled metric or a wrong label is reported."""
    assert metric_names('sum(rate(prefixgate_cached_token_total{model=~"$m"}[5m]))') == {
        "prefixgate_cached_token_total"
    }
    assert dict(selector_labels('x{token_type="input", model=~"a,b"}')) == {
        "x": {"token_type", "model"}
    }
    assert grouping_labels("sum by (le, backend) (rate(a[5m]))") == {"le", "backend"}


def test_dashboard_covers_the_operating_questions() -> None:
    """Hit rate (measured and predicted), TTFT/TPOT percentiles, goodput, savings, per-backend
    load and hit rate, requests by status, and store degradation each have a query."""
    all_exprs = [e for _, e in exprs()]

    def some(*needles: str) -> bool:
        return any(all(n in e for n in needles) for e in all_exprs)

    assert some("prefixgate_cached_tokens_total", "prefixgate_cached_reported_prompt_tokens_total")
    assert some("prefixgate_predicted_cached_tokens_total", "prefixgate_prompt_tokens_total")
    assert some("histogram_quantile", "prefixgate_time_to_first_token_seconds_bucket")
    assert some("histogram_quantile", "prefixgate_time_per_output_token_seconds_bucket")
    assert some("prefixgate_slo_met_total", "prefixgate_slo_evaluated_total")
    assert some("prefixgate_saved_prefill_seconds_total")
    assert some("prefixgate_saved_usd_total")
    assert some("by (backend)", "prefixgate_backend_in_flight")
    assert some("by (backend)", "prefixgate_cached_tokens_total")
    assert some("by (status)", "prefixgate_requests_total")
    assert some("prefixgate_store_degraded")


def exposed_names(text: str) -> dict[str, set[str]]:
    """Series names from Prometheus text exposition ``# TYPE`` lines (labels unknown: empty)."""
    counters: dict[str, set[str]] = {}
    histograms: dict[str, set[str]] = {}
    gauges: dict[str, set[str]] = {}
    for line in text.splitlines():
        m = re.match(r"# TYPE (\S+) (\S+)", line)
        if not m:
            continue
        name, kind = m.groups()
        if kind == "counter":
            counters[name] = set()  # prometheus-client writes counters' TYPE with _total
        elif kind == "histogram":
            histograms[name] = set()
        else:
            gauges[name] = set()
    return sample_names(counters, histograms, gauges)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\} ")


def exposed_labels(text: str) -> dict[str, set[str]]:
    """Label names seen on each series' samples in Prometheus text exposition."""
    seen: dict[str, set[str]] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            labels = set(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', m.group(2)))
            seen.setdefault(m.group(1), set()).update(labels)
    return seen


async def test_contract_matches_what_the_proxy_exports(
    llama_fake: LlamaFake, make_proxy: MakeProxy
) -> None:
    """The contract and the dashboard match the proxy's own /metrics: every contract series is
    exported, with the contract's labels, every exported series is in the contract, and every
    dashboard query uses exported series only."""
    client, records, _ = await make_proxy(llama_fake.url)
    chat = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}
    async with client.post("/v1/chat/completions", json=chat) as resp:
        assert resp.status == 200
    await records.wait()
    async with client.admin.get("/metrics") as resp:
        assert resp.status == 200
        text = await resp.text()
    # prometheus-client adds a ``<name>_created`` timestamp beside every counter and histogram.
    real = {n: v for n, v in exposed_names(text).items() if not n.endswith("_created")}
    missing, extra = sorted(set(CONTRACT) - set(real)), sorted(set(real) - set(CONTRACT))
    assert (missing, extra) == ([], []), "contract and /metrics differ (missing, not in contract)"
    assert all(n.startswith("prefixgate_") for n in real), sorted(real)
    names = {n for _, e in exprs() for n in metric_names(e)}
    assert names <= set(real), sorted(names - set(real))
    labelled = exposed_labels(text)
    checked = [n for n in CONTRACT if labelled.get(n)]
    assert len(checked) >= 10, checked  # one request gives most series a sample
    for name in checked:
        assert labelled[name] == CONTRACT[name], (name, labelled[name], CONTRACT[name])
