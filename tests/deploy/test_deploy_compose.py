"""deploy/compose.yaml: valid against the Compose Specification, and its pieces point at each other.

No Docker engine runs in CI, so the stack is not started here. The file is validated against the
Compose Specification's JSON schema (vendored in deploy/schemas/), then every reference a running
stack would follow is checked: mounted files exist, depends_on names services, the proxy's TOML
resolves with the proxy's own settings code and names the compose services, Prometheus scrapes
the proxy's port, Grafana's provisioning finds the mounted dashboard.
"""

from __future__ import annotations

import copy
import posixpath
import re
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import pytest
from deploy_files import (
    COMPOSE,
    DEPLOY,
    DOCKERFILE,
    K8S,
    ROOT,
    Mount,
    compose_mounts,
    dockerfile_instructions,
    load_json,
    load_yaml,
    stages,
)

from proxy.app import build_canonicalizer
from proxy.config import OPTIONS, resolve

SCHEMA = DEPLOY / "schemas" / "compose-spec.json"


def compose() -> dict[str, Any]:
    data = load_yaml(COMPOSE)
    assert isinstance(data, dict)
    return data


def services() -> dict[str, dict[str, Any]]:
    return dict(compose()["services"])


def schema_errors(data: Any) -> list[str]:
    validator = jsonschema.Draft201909Validator(load_json(SCHEMA))
    return [f"{list(e.path)}: {e.message}" for e in validator.iter_errors(data)]


def local_path(mount: Mount) -> Path:
    return (COMPOSE.parent / mount.source).resolve()


def mount_for(service: str, target: str) -> Mount:
    """The mount of ``service`` that provides ``target`` (the target itself or a folder above)."""
    for m in compose_mounts(services()[service]):
        if target == m.target or target.startswith(m.target.rstrip("/") + "/"):
            return m
    raise AssertionError(f"{service} mounts nothing at {target}")


def host_file(service: str, target: str) -> Path:
    """The file on the host that ``service`` sees at ``target``."""
    m = mount_for(service, target)
    assert m.is_bind, f"{target} in {service} is not a bind mount"
    return local_path(m) / posixpath.relpath(target, m.target)


def admin_port() -> int:
    """The proxy's admin port inside the network: the second port the image EXPOSEs."""
    expose = [i for i in stages(dockerfile_instructions())[-1] if i.keyword == "EXPOSE"]
    return int(expose[0].args.split()[1])


def service_port(name: str) -> int:
    """The port a service listens on inside the network (from its flags or the image's EXPOSE)."""
    svc = services()[name]
    args = [str(a) for a in svc.get("command", [])]
    if "--port" in args:
        return int(args[args.index("--port") + 1])
    if name == "prefixgate":
        expose = [i for i in stages(dockerfile_instructions())[-1] if i.keyword == "EXPOSE"]
        return int(expose[0].args.split()[0])
    return {"redis": 6379, "prometheus": 9090, "grafana": 3000}[name]


def test_valid_against_the_compose_specification() -> None:
    """The file validates against the vendored Compose Specification schema."""
    assert schema_errors(compose()) == []


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d["services"]["prefixgate"].update(restrat="always"),
        lambda d: d["services"]["redis"].update(healthcheck={"test": 1}),
        lambda d: d.update(servces={}),
    ],
    ids=["unknown-key", "wrong-type", "unknown-top-level"],
)
def test_schema_rejects_a_broken_file(mutate: Any) -> None:
    """The schema check is live: typical mistakes are caught."""
    broken = copy.deepcopy(compose())
    mutate(broken)
    assert schema_errors(broken)


def test_depends_on_names_existing_services() -> None:
    """Every depends_on entry is a service of this file, never the service itself."""
    names = set(services())
    for name, svc in services().items():
        deps = svc.get("depends_on", [])
        for dep in deps if isinstance(deps, list) else deps.keys():
            assert dep in names and dep != name, f"{name} depends on {dep}"


def test_mounted_files_exist_and_named_volumes_are_declared() -> None:
    """Bind mounts point at files in the repository; named volumes are declared."""
    declared = set(compose().get("volumes", {}))
    bind_count = 0
    for name, svc in services().items():
        for m in compose_mounts(svc):
            if m.is_bind:
                bind_count += 1
                assert local_path(m).exists(), f"{name}: {m.source} does not exist"
                assert local_path(m).is_relative_to(DEPLOY), f"{name}: {m.source} leaves deploy/"
                assert m.read_only, f"{name}: mount {m.source} read-only"
            else:
                assert m.source in declared, f"{name}: volume {m.source} is not declared"
    assert bind_count >= 4


def test_build_uses_the_deploy_dockerfile() -> None:
    """The proxy is built from the repository root with deploy/Dockerfile."""
    build = services()["prefixgate"]["build"]
    context = (COMPOSE.parent / build["context"]).resolve()
    assert (context / build["dockerfile"]).resolve() == DOCKERFILE
    assert (context / "pyproject.toml").is_file()


# An image reference to the proxy's image in a command line: [registry/...]prefixgate[:tag].
PROXY_IMAGE = re.compile(r"(?:[\w.-]+(?::\d+)?/)*prefixgate(?::(?P<tag>[\w.-]+))?")
IMAGE_COMMAND = re.compile(r"\b(?:docker (?:build|run|tag|push)|image load|set image)\b")


def test_image_tag_is_the_project_version_everywhere() -> None:
    """compose.yaml builds ``prefixgate:<version of pyproject.toml>``; every command naming the
    proxy's image in deploy/README.md, the Dockerfile and the kustomization uses that tag, and
    the kustomization's images: entry deploys it (so a build, a push and the cluster agree)."""
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert services()["prefixgate"]["image"] == f"prefixgate:{version}"
    seen = 0
    for path in (DEPLOY / "README.md", DOCKERFILE, K8S / "kustomization.yaml"):
        for line in path.read_text().splitlines():
            if not IMAGE_COMMAND.search(line):
                continue
            for word in line.split():
                # kustomize edit set image NAME=NEWNAME:TAG: the image is after the "=".
                word = word.rpartition("=")[2].strip("()`'\",;")
                if m := PROXY_IMAGE.fullmatch(word):
                    seen += 1
                    assert m["tag"] == version, f"{path.name}: {line.strip()}"
    assert seen >= 8
    (entry,) = load_yaml(K8S / "kustomization.yaml")["images"]
    assert (entry["name"], str(entry["newTag"])) == ("prefixgate", version)


def test_published_host_ports_are_unique() -> None:
    """No two services publish the same host port."""
    published = [str(p).split(":")[0] for svc in services().values() for p in svc.get("ports", [])]
    assert published and len(published) == len(set(published))


def proxy_config_file() -> Path:
    env = services()["prefixgate"]["environment"]
    return host_file("prefixgate", env["PREFIXGATE_CONFIG"])


def test_proxy_settings_resolve_and_name_compose_services() -> None:
    """The mounted TOML uses real option names and points at the compose services."""
    path = proxy_config_file()
    table = tomllib.loads(path.read_text())
    known = {o.name for o in OPTIONS} | {"backends"}
    assert set(table["proxy"]) <= known, set(table["proxy"]) - known
    settings = resolve({"config": str(path)}, environ={})
    build_canonicalizer(settings)  # the [canonical] table is valid
    for backend in settings.backends:
        url = urlsplit(backend.url)
        assert url.hostname in services(), backend.url
        assert url.port == service_port(str(url.hostname)), backend.url
    assert settings.redis_url is not None
    redis = urlsplit(settings.redis_url)
    assert redis.hostname in services() and (redis.port or 6379) == service_port("redis")


def test_prometheus_scrapes_the_proxy() -> None:
    """Prometheus's mounted config scrapes /metrics on the proxy's admin port, by service name."""
    prom = services()["prometheus"]
    flag = next(a for a in prom["command"] if a.startswith("--config.file="))
    config = load_yaml(host_file("prometheus", flag.split("=", 1)[1]))
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    targets = [t for j in jobs.values() for sc in j["static_configs"] for t in sc["targets"]]
    for target in targets:
        host, port = target.split(":")
        listens = {service_port(host)} | ({admin_port()} if host == "prefixgate" else set())
        assert host in services() and int(port) in listens, target
    proxy_job = jobs["prefixgate"]
    assert proxy_job.get("metrics_path", "/metrics") == "/metrics"
    assert f"prefixgate:{admin_port()}" in proxy_job["static_configs"][0]["targets"]


def test_grafana_provisions_the_dashboard_over_prometheus() -> None:
    """Grafana's data source is the compose Prometheus; its provider loads the mounted JSON."""
    grafana = services()["grafana"]
    provisioning = host_file("grafana", "/etc/grafana/provisioning")
    sources = load_yaml(provisioning / "datasources" / "prometheus.yaml")["datasources"]
    assert [s["type"] for s in sources] == ["prometheus"]
    url = urlsplit(sources[0]["url"])
    assert url.hostname == "prometheus" and url.port == service_port("prometheus")
    providers = load_yaml(provisioning / "dashboards" / "prefixgate.yaml")["providers"]
    folder = providers[0]["options"]["path"]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert posixpath.dirname(home) == folder
    dashboard = host_file("grafana", home)
    assert dashboard == DEPLOY / "grafana" / "prefixgate.json"
    assert load_json(dashboard)["uid"] == "prefixgate"
