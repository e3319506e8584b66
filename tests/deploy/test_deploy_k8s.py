"""deploy/k8s: every object valid against the Kubernetes schemas, and the objects agree.

Schemas: the ones shipped in the ``kubernetes-validate`` package (offline), in strict mode (an
unknown field is an error), for the oldest and the newest Kubernetes version the manifests
target. Then the references a cluster would follow: the kustomization lists every manifest;
Services, the PodDisruptionBudget and the NetworkPolicy select the pods they mean; ports line up;
ConfigMaps and Secrets referenced exist with the keys used; the proxy's TOML resolves with the
proxy's own settings code and names the backend pods and Redis by their Kubernetes names.

Then what ``kubectl apply -k deploy/k8s`` would send: the kustomization assembled in Python
(``deploy_files.kustomize_build``: resources, namespace, images) and checked again as a whole.
No test runs ``kubectl``; its ``kubectl kustomize deploy/k8s`` gave the same objects by hand.
"""

from __future__ import annotations

import functools
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
from deploy_files import (
    CLUSTER_SCOPED,
    K8S,
    ROOT,
    dockerfile_instructions,
    kustomize_build,
    load_toml_text,
    load_yaml,
    load_yaml_docs,
    set_image,
    split_image,
    stages,
)

from proxy.app import build_canonicalizer
from proxy.auth import parse_keys_file
from proxy.config import OPTIONS, resolve

K8S_VERSIONS = ("1.30.0", "1.37.0")
WORKLOAD_KINDS = {"Deployment", "StatefulSet"}


def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


@functools.cache
def _objects() -> tuple[dict[str, Any], ...]:
    return tuple(doc for path in manifest_files() for doc in load_yaml_docs(path))


def objects() -> list[dict[str, Any]]:
    """Every object of every manifest (parsed once; callers do not modify them)."""
    return list(_objects())


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [o for o in objects() if o["kind"] == kind]


def one(kind: str, name: str) -> dict[str, Any]:
    found = [o for o in of_kind(kind) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def workloads() -> list[dict[str, Any]]:
    return [o for o in objects() if o["kind"] in WORKLOAD_KINDS]


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = workload["spec"]["template"]["spec"]
    return spec


def containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    return list(pod_spec(workload)["containers"])


def selected(selector: dict[str, str]) -> list[dict[str, Any]]:
    """Workloads whose pod template labels match ``selector``."""
    return [
        w
        for w in workloads()
        if selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
    ]


def proxy() -> dict[str, Any]:
    return one("Deployment", "prefixgate")


def proxy_container() -> dict[str, Any]:
    (c,) = containers(proxy())
    return c


def env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def kind_name(obj: dict[str, Any]) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


def each_object() -> Iterator[Any]:
    for path in manifest_files():
        for doc in load_yaml_docs(path):
            yield pytest.param(doc, id=f"{path.name}:{kind_name(doc)}")


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("obj", list(each_object()))
def test_object_valid_against_kubernetes_schema(obj: dict[str, Any], version: str) -> None:
    """Each object validates (strict: no unknown fields) against the Kubernetes API schema."""
    kubernetes_validate.validate(obj, version, strict=True)


def test_schema_check_is_live() -> None:
    """A misspelled field fails strict validation, so the check above can fail."""
    broken = load_yaml(K8S / "proxy-deployment.yaml")
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[0], strict=True)


def test_kustomization_lists_every_manifest() -> None:
    """kustomization.yaml lists exactly the manifest files of the folder, each once."""
    kustomization = load_yaml(K8S / "kustomization.yaml")
    assert kustomization["kind"] == "Kustomization"
    resources = kustomization["resources"]
    assert len(resources) == len(set(resources))
    assert sorted(resources) == [p.name for p in manifest_files()]
    namespace = one("Namespace", kustomization["namespace"])
    assert namespace["metadata"]["name"] == kustomization["namespace"]


def test_names_are_unique_and_labelled() -> None:
    """No two objects share kind and name; every object is labelled as part of prefixgate."""
    seen = [kind_name(o) for o in objects()]
    assert len(seen) == len(set(seen))
    for o in objects():
        assert o["metadata"]["labels"]["app.kubernetes.io/part-of"] == "prefixgate", kind_name(o)


def test_workload_selectors_match_their_pods() -> None:
    """Each workload's selector matches its own pod template (the API server requires it)."""
    for w in workloads():
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert w["spec"]["selector"]["matchLabels"].items() <= labels.items(), kind_name(w)


def test_services_select_one_workload_and_target_its_ports() -> None:
    """Each Service selects exactly one workload and targets a port its containers open."""
    for svc in of_kind("Service"):
        (target,) = selected(svc["spec"]["selector"])
        ports = [p for c in containers(target) for p in c.get("ports", [])]
        by_name = {p["name"]: p["containerPort"] for p in ports if "name" in p}
        numbers = {p["containerPort"] for p in ports}
        for port in svc["spec"]["ports"]:
            want = port.get("targetPort", port["port"])
            if isinstance(want, str):
                assert want in by_name, f"{kind_name(svc)} targets unknown port {want}"
            else:
                assert want in numbers, f"{kind_name(svc)} targets unopened port {want}"


def test_statefulsets_name_a_headless_governing_service() -> None:
    """Each StatefulSet's serviceName is a Service selecting it (stable pod DNS names)."""
    for sts in of_kind("StatefulSet"):
        svc = one("Service", sts["spec"]["serviceName"])
        assert selected(svc["spec"]["selector"]) == [sts]
    assert one("Service", "llama")["spec"]["clusterIP"] == "None"


def test_pdb_and_hpa_target_the_proxies() -> None:
    """The PodDisruptionBudget selects the proxy pods; the HPA scales the proxy Deployment."""
    (pdb,) = of_kind("PodDisruptionBudget")
    assert selected(pdb["spec"]["selector"]["matchLabels"]) == [proxy()]
    (hpa,) = of_kind("HorizontalPodAutoscaler")
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"], ref["name"]) == ("apps/v1", "Deployment", "prefixgate")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert 2 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    assert "replicas" not in proxy()["spec"], "the HPA owns the proxy's replica count"


def test_network_policy_lets_only_proxies_reach_redis() -> None:
    """Redis's NetworkPolicy selects the Redis pods and admits the proxy pods on its port."""
    (policy,) = of_kind("NetworkPolicy")
    assert selected(policy["spec"]["podSelector"]["matchLabels"]) == [one("StatefulSet", "redis")]
    (rule,) = policy["spec"]["ingress"]
    (peer,) = rule["from"]
    assert selected(peer["podSelector"]["matchLabels"]) == [proxy()]
    assert [p["port"] for p in rule["ports"]] == [6379]


def test_referenced_configmaps_and_secrets_exist_with_their_keys() -> None:
    """Every ConfigMap / Secret a pod uses (volume, env, envFrom) exists, with the key used."""
    configmaps = {c["metadata"]["name"]: set(c.get("data", {})) for c in of_kind("ConfigMap")}
    secrets = {
        s["metadata"]["name"]: set(s.get("stringData", {})) | set(s.get("data", {}))
        for s in of_kind("Secret")
    }
    refs = 0
    for w in workloads():
        for vol in pod_spec(w).get("volumes", []):
            for source, name_field, known in (
                (vol.get("configMap"), "name", configmaps),
                (vol.get("secret"), "secretName", secrets),
            ):
                if source is None:
                    continue
                refs += 1
                name = source[name_field]
                assert name in known, f"{kind_name(w)}: {name} does not exist"
                for item in source.get("items", []):
                    assert item["key"] in known[name], f"{kind_name(w)}: {name} {item}"
        for c in containers(w):
            for e in c.get("env", []):
                source = e.get("valueFrom", {})
                for key, known in (("configMapKeyRef", configmaps), ("secretKeyRef", secrets)):
                    if key in source:
                        refs += 1
                        ref = source[key]
                        assert ref["key"] in known.get(ref["name"], set()), f"{e['name']}: {ref}"
            for src in c.get("envFrom", []):
                refs += 1
                if "configMapRef" in src:
                    assert src["configMapRef"]["name"] in configmaps
                if "secretRef" in src:
                    assert src["secretRef"]["name"] in secrets
    assert refs >= 3


def test_secret_values_are_marked_placeholders() -> None:
    """The committed Secret holds only clearly marked placeholders, never a real-looking key."""
    for secret in of_kind("Secret"):
        values = secret.get("stringData", {})
        assert values and "data" not in secret
        for key, value in values.items():
            assert value.startswith("CHANGE-ME"), f"{key} is not a marked placeholder"


def test_proxy_pods_are_hardened_and_probed() -> None:
    """Proxy pods: non-root, read-only root fs, no privilege escalation, /readyz, /healthz."""
    pod = pod_spec(proxy())
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] > 0
    c = proxy_container()
    ctx = c["securityContext"]
    assert ctx["readOnlyRootFilesystem"] is True
    assert ctx["allowPrivilegeEscalation"] is False
    assert ctx["capabilities"]["drop"] == ["ALL"]
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    port_names = {p["name"] for p in c["ports"]}
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["port"] in port_names


def test_every_container_has_requests_and_limits() -> None:
    """Every container declares CPU and memory requests and limits."""
    for w in workloads():
        for c in containers(w):
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][kind]), f"{kind_name(w)} {kind}"


def test_proxy_port_is_the_image_port() -> None:
    """The proxy container opens the ports the image listens on (Dockerfile EXPOSE): traffic
    (``http``) and admin (``admin``, where the probes and the Prometheus annotation point)."""
    expose = [i for i in stages(dockerfile_instructions())[-1] if i.keyword == "EXPOSE"]
    port, admin = proxy_container()["ports"]
    assert port["containerPort"] == int(expose[0].args.split()[0])
    assert admin["containerPort"] == int(expose[0].args.split()[1]) and admin["name"] == "admin"
    annotations = proxy()["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(admin["containerPort"])


def mounted_file(path: str) -> str:
    """The text the proxy container reads at ``path``, found through its mounts and volumes."""
    c = proxy_container()
    volumes = {v["name"]: v for v in pod_spec(proxy())["volumes"]}
    for mount in c["volumeMounts"]:
        folder = mount["mountPath"].rstrip("/") + "/"
        if not path.startswith(folder):
            continue
        name = path.removeprefix(folder)
        volume = volumes[mount["name"]]
        if "configMap" in volume:
            source, kind, ref = volume["configMap"], "ConfigMap", volume["configMap"]["name"]
            data = one(kind, ref)["data"]
        else:
            source, kind, ref = volume["secret"], "Secret", volume["secret"]["secretName"]
            data = one(kind, ref)["stringData"]
        items = {i["path"]: i["key"] for i in source.get("items", [])}
        key = items.get(name, name) if items else name
        assert key in data, f"{path}: {kind}/{ref} has no key {key}"
        return str(data[key])
    raise AssertionError(f"nothing mounted at {path}")


def proxy_toml() -> str:
    """The TOML text at the path PREFIXGATE_CONFIG names."""
    return mounted_file(env(proxy_container())["PREFIXGATE_CONFIG"]["value"])


def test_proxy_settings_resolve_with_real_option_names(tmp_path: Path) -> None:
    """The ConfigMap's TOML resolves with the proxy's settings code; every key is an option."""
    text = proxy_toml()
    table = load_toml_text(text)
    known = {o.name for o in OPTIONS} | {"backends"}
    assert set(table) <= {"proxy", "canonical"}
    assert set(table["proxy"]) <= known, set(table["proxy"]) - known
    path = tmp_path / "prefixgate.toml"
    path.write_text(text)
    settings = resolve({"config": str(path)}, environ={}, read_files=False)  # the pod's paths
    build_canonicalizer(settings)  # the [canonical] table is valid


def test_proxy_settings_name_backend_pods_and_redis(tmp_path: Path) -> None:
    """Backends are the llama pods' stable names and port; the Redis URL is the Redis Service."""
    text = proxy_toml()
    path = tmp_path / "prefixgate.toml"
    path.write_text(text)
    settings = resolve({"config": str(path)}, environ={}, read_files=False)  # the pod's paths
    llama = one("StatefulSet", "llama")
    (container,) = containers(llama)
    (port,) = container["ports"]
    expected = {
        f"http://{llama['metadata']['name']}-{i}.{llama['spec']['serviceName']}:"
        f"{port['containerPort']}"
        for i in range(llama["spec"]["replicas"])
    }
    assert {b.url for b in settings.backends} == expected
    assert settings.redis_url is not None
    redis = urlsplit(settings.redis_url)
    svc = one("Service", str(redis.hostname))
    assert (redis.port or 6379) in {p["port"] for p in svc["spec"]["ports"]}


def test_proxy_env_names_real_settings() -> None:
    """Every PREFIXGATE_* variable set on the proxy is a setting (or the config file)."""
    names = {o.env for o in OPTIONS} | {"PREFIXGATE_CONFIG"}
    for name in env(proxy_container()):
        assert re.fullmatch(r"PREFIXGATE_[A-Z_]+", name) and name in names, name


def test_client_keys_file_is_mounted_from_the_secret(tmp_path: Path) -> None:
    """The api_keys_file the settings name is the Secret's key file, in the format it expects."""
    path = tmp_path / "prefixgate.toml"
    path.write_text(proxy_toml())
    settings = resolve({"config": str(path)}, environ={}, read_files=False)  # the pod's paths
    assert settings.api_keys_file is not None
    keys = parse_keys_file(mounted_file(settings.api_keys_file))
    assert keys and all(key.startswith("CHANGE-ME") for key in keys)


# -- the kustomization, assembled ------------------------------------------------------------------


@functools.cache
def _assembled() -> tuple[dict[str, Any], ...]:
    return tuple(kustomize_build(K8S))


def assembled(kind: str | None = None) -> list[dict[str, Any]]:
    """The objects ``kubectl apply -k deploy/k8s`` would send (of ``kind``, if given)."""
    return [o for o in _assembled() if kind is None or o["kind"] == kind]


def assembled_one(kind: str, name: str) -> dict[str, Any]:
    found = [o for o in assembled(kind) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} assembled"
    return found[0]


def assembled_selected(selector: dict[str, str], namespace: str) -> list[dict[str, Any]]:
    """Assembled workloads in ``namespace`` whose pods carry the ``selector`` labels."""
    return [
        w
        for w in assembled()
        if w["kind"] in WORKLOAD_KINDS
        and w["metadata"]["namespace"] == namespace
        and selector.items() <= w["spec"]["template"]["metadata"]["labels"].items()
    ]


def kustomization() -> dict[str, Any]:
    value: dict[str, Any] = load_yaml(K8S / "kustomization.yaml")
    return value


def project_version() -> str:
    version: str = load_toml_text((ROOT / "pyproject.toml").read_text())["project"]["version"]
    return version


def each_assembled() -> Iterator[Any]:
    for obj in kustomize_build(K8S):
        yield pytest.param(obj, id=kind_name(obj))


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("obj", list(each_assembled()))
def test_assembled_object_valid_against_kubernetes_schema(
    obj: dict[str, Any], version: str
) -> None:
    """Each object of the assembled kustomization (namespace set, image rewritten) validates
    strictly against the Kubernetes API schema."""
    kubernetes_validate.validate(obj, version, strict=True)


def test_assembly_has_every_manifest_object_in_the_namespace() -> None:
    """The assembly holds each object of the manifests once; every namespaced object is in the
    kustomization's namespace, which the Namespace object creates."""
    namespace = kustomization()["namespace"]
    assert sorted(map(kind_name, assembled())) == sorted(map(kind_name, objects()))
    for o in assembled():
        if o["kind"] in CLUSTER_SCOPED:
            assert o["kind"] == "Namespace", kind_name(o)
            assert "namespace" not in o["metadata"]
        else:
            assert o["metadata"]["namespace"] == namespace, kind_name(o)
    assert assembled_one("Namespace", namespace)


def test_images_entry_points_the_proxy_at_a_registry() -> None:
    """The Deployment names its image ``prefixgate``; the kustomization's ``images:`` entry
    rewrites it to a registry path tagged with the project's version (a placeholder a user sets
    with ``kustomize edit set image``); no other image is touched."""
    (entry,) = kustomization()["images"]
    assert split_image(proxy_container()["image"]) == (entry["name"], None, None)
    assert entry["name"] == "prefixgate"
    assert "/" in entry["newName"] and str(entry["newTag"]) == project_version()
    deployment = assembled_one("Deployment", "prefixgate")
    (container,) = containers(deployment)
    assert container["image"] == f"{entry['newName']}:{entry['newTag']}"
    for w in assembled():
        if w["kind"] in WORKLOAD_KINDS and w is not deployment:
            raw = one(w["kind"], w["metadata"]["name"])
            assert [c["image"] for c in containers(w)] == [c["image"] for c in containers(raw)]
            assert all(split_image(c["image"])[1] for c in containers(w)), "pin a tag"


def test_assembled_services_select_pods_in_their_namespace() -> None:
    """Each assembled Service selects exactly one workload of its own namespace."""
    for svc in assembled("Service"):
        found = assembled_selected(svc["spec"]["selector"], svc["metadata"]["namespace"])
        assert len(found) == 1, kind_name(svc)


def test_assembled_pdb_hpa_and_policy_target_the_proxies() -> None:
    """In the assembly, the PDB selects the proxy pods, the HPA scales the proxy Deployment of
    the same namespace, and the NetworkPolicy admits those pods to Redis."""
    deployment = assembled_one("Deployment", "prefixgate")
    namespace = deployment["metadata"]["namespace"]
    (pdb,) = assembled("PodDisruptionBudget")
    assert pdb["metadata"]["namespace"] == namespace
    assert assembled_selected(pdb["spec"]["selector"]["matchLabels"], namespace) == [deployment]
    (hpa,) = assembled("HorizontalPodAutoscaler")
    assert hpa["metadata"]["namespace"] == namespace
    ref = hpa["spec"]["scaleTargetRef"]
    target = assembled_one(ref["kind"], ref["name"])
    assert target is deployment and ref["apiVersion"] == deployment["apiVersion"]
    (policy,) = assembled("NetworkPolicy")
    assert policy["metadata"]["namespace"] == namespace
    redis = assembled_one("StatefulSet", "redis")
    assert assembled_selected(policy["spec"]["podSelector"]["matchLabels"], namespace) == [redis]
    (rule,) = policy["spec"]["ingress"]
    (peer,) = rule["from"]
    assert assembled_selected(peer["podSelector"]["matchLabels"], namespace) == [deployment]


def test_assembled_config_and_secret_references_exist_in_the_namespace() -> None:
    """Every ConfigMap and Secret an assembled workload uses (volumes, env) is an assembled
    object of the workload's namespace."""
    refs = 0
    for w in assembled():
        if w["kind"] not in WORKLOAD_KINDS:
            continue
        namespace = w["metadata"]["namespace"]
        wanted: list[tuple[str, str]] = []
        for vol in pod_spec(w).get("volumes", []):
            if "configMap" in vol:
                wanted.append(("ConfigMap", vol["configMap"]["name"]))
            if "secret" in vol:
                wanted.append(("Secret", vol["secret"]["secretName"]))
        for c in containers(w):
            for e in c.get("env", []):
                source = e.get("valueFrom", {})
                if "configMapKeyRef" in source:
                    wanted.append(("ConfigMap", source["configMapKeyRef"]["name"]))
                if "secretKeyRef" in source:
                    wanted.append(("Secret", source["secretKeyRef"]["name"]))
        for kind, name in wanted:
            refs += 1
            assert assembled_one(kind, name)["metadata"]["namespace"] == namespace, (kind, name)
    assert refs >= 4


@pytest.mark.parametrize(
    ("image", "entry", "expected"),
    [
        ("prefixgate", {"name": "prefixgate", "newName": "r.io/p", "newTag": "1"}, "r.io/p:1"),
        ("prefixgate:0.0.9", {"name": "prefixgate", "newTag": "1"}, "prefixgate:1"),
        ("prefixgate:0.0.9", {"name": "prefixgate", "newName": "x"}, "x:0.0.9"),
        ("prefixgate@sha256:abc", {"name": "prefixgate", "newName": "x"}, "x@sha256:abc"),
        ("prefixgate@sha256:abc", {"name": "prefixgate", "newTag": "1"}, "prefixgate:1"),
        ("redis:7.4-alpine", {"name": "redis", "digest": "sha256:d"}, "redis@sha256:d"),
        ("localhost:5000/p:1", {"name": "localhost:5000/p", "newTag": "2"}, "localhost:5000/p:2"),
        ("other/prefixgate:1", {"name": "prefixgate", "newTag": "2"}, "other/prefixgate:1"),
        ("ghcr.io/ggml-org/llama.cpp:server", {"name": "llama.cpp", "newTag": "x"}, None),
    ],
)
def test_image_rewrite_follows_kustomize(
    image: str, entry: dict[str, str], expected: str | None
) -> None:
    """The ``images:`` rewrite gives what kustomize 5.5 (kubectl 1.32) gave for the same entry:
    the whole name must match; a new tag drops a digest; a name alone keeps tag or digest."""
    assert set_image(image, entry) == (expected or image)


def test_assembly_refuses_what_it_does_not_model(tmp_path: Path) -> None:
    """A kustomization field the assembly does not apply (here ``commonLabels``) fails it,
    rather than being ignored and the checks above passing on objects kustomize would change."""
    folder = tmp_path / "k8s"
    shutil.copytree(K8S, folder)
    path = folder / "kustomization.yaml"
    path.write_text(path.read_text() + "commonLabels:\n  team: a\n")
    with pytest.raises(AssertionError, match="commonLabels"):
        kustomize_build(folder)
