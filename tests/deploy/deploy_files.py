"""Readers for the files under deploy/, shared by the deployment tests.

Small on purpose: YAML and TOML loading, a Dockerfile instruction parser (continuation lines
joined, ``ARG`` defaults substituted in ``FROM``), the Compose short-syntax volume splitter, and
a kustomize assembly for the kustomization fields deploy/k8s uses (``kustomize_build``).
"""

from __future__ import annotations

import copy
import json
import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
COMPOSE = DEPLOY / "compose.yaml"
DOCKERFILE = DEPLOY / "Dockerfile"
DASHBOARD = DEPLOY / "grafana" / "prefixgate.json"


# libyaml's loader when PyYAML was built with it (safe either way, much faster).
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_yaml(path: Path) -> Any:
    return yaml.load(path.read_text(), Loader=_Loader)


def load_yaml_docs(path: Path) -> list[dict[str, Any]]:
    """Every non-empty document of a multi-document YAML file."""
    return [d for d in yaml.load_all(path.read_text(), Loader=_Loader) if d is not None]


def load_json(path: Path) -> Any:
    return json.loads(path.read_text())


def load_toml_text(text: str) -> dict[str, Any]:
    return tomllib.loads(text)


@dataclass(frozen=True, slots=True)
class Instruction:
    """One Dockerfile instruction: its keyword (upper case) and the rest of the line."""

    keyword: str
    args: str

    def exec_form(self) -> list[str] | None:
        """The JSON array of an exec-form instruction (after any ``--flag=`` options), else None."""
        text = self.args
        while text.startswith("--"):
            text = text.split(None, 1)[1] if " " in text else ""
        if not text.startswith("["):
            return None
        value = json.loads(text)
        assert isinstance(value, list) and all(isinstance(v, str) for v in value)
        return value


def dockerfile_instructions(path: Path = DOCKERFILE) -> list[Instruction]:
    """Instructions in order; comments dropped, ``\\`` continuations joined."""
    out: list[Instruction] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # comment lines inside a continuation are ignored by Docker too
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        full = (pending + line).strip()
        pending = ""
        keyword, _, rest = full.partition(" ")
        out.append(Instruction(keyword.upper(), rest.strip()))
    assert not pending, "Dockerfile ends inside a continuation"
    return out


def stages(instructions: list[Instruction]) -> list[list[Instruction]]:
    """Instructions grouped by build stage (each group starts with its FROM)."""
    groups: list[list[Instruction]] = []
    for ins in instructions:
        if ins.keyword == "FROM":
            groups.append([])
        if groups:
            groups[-1].append(ins)
    return groups


def arg_defaults(instructions: list[Instruction]) -> dict[str, str]:
    """``ARG NAME=value`` declared before the first FROM."""
    out: dict[str, str] = {}
    for ins in instructions:
        if ins.keyword == "FROM":
            break
        if ins.keyword == "ARG" and "=" in ins.args:
            name, _, value = ins.args.partition("=")
            out[name.strip()] = value.strip()
    return out


def expand(text: str, values: dict[str, str]) -> str:
    return re.sub(r"\$\{?(\w+)\}?", lambda m: values.get(m.group(1), m.group(0)), text)


def env_of(instructions: list[Instruction]) -> dict[str, str]:
    """``ENV a=1 b=2`` pairs of one stage."""
    out: dict[str, str] = {}
    for ins in instructions:
        if ins.keyword == "ENV":
            for word in shlex.split(ins.args):
                name, _, value = word.partition("=")
                out[name] = value
    return out


@dataclass(frozen=True, slots=True)
class Mount:
    """A Compose short-syntax volume: ``source:target[:mode]``."""

    source: str
    target: str
    read_only: bool

    @property
    def is_bind(self) -> bool:
        return self.source.startswith((".", "/", "~"))


def compose_mounts(service: dict[str, Any]) -> list[Mount]:
    mounts = []
    for spec in service.get("volumes", []):
        assert isinstance(spec, str), f"use the short volume syntax: {spec!r}"
        parts = spec.split(":")
        mounts.append(Mount(parts[0], parts[1], len(parts) > 2 and "ro" in parts[2].split(",")))
    return mounts


# -- kustomize, for the features deploy/k8s uses --------------------------------------------------

# The kustomization fields ``kustomize_build`` applies; any other one is an error (teach it first).
KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "namespace", "resources", "images"}
IMAGE_ENTRY_FIELDS = {"name", "newName", "newTag", "digest"}
# Kinds kustomize's namespace transformer leaves without a namespace.
CLUSTER_SCOPED = {
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "CustomResourceDefinition",
    "PersistentVolume",
    "StorageClass",
    "PriorityClass",
    "IngressClass",
    "RuntimeClass",
}
# Kinds whose references to other namespaces the transformer also rewrites (not modelled here).
NAMESPACE_REFERRERS = {
    "RoleBinding",
    "ClusterRoleBinding",
    "ValidatingWebhookConfiguration",
    "MutatingWebhookConfiguration",
    "APIService",
}


def split_image(image: str) -> tuple[str, str | None, str | None]:
    """``[registry[:port]/]path[:tag][@digest]`` as (name, tag, digest), as kustomize reads it."""
    rest, _, digest = image.partition("@")
    slash = rest.rfind("/")
    colon = rest.rfind(":")
    if colon > slash:
        return rest[:colon], rest[colon + 1 :], digest or None
    return rest, None, digest or None


def set_image(image: str, entry: dict[str, str]) -> str:
    """``image`` after one ``images:`` entry (unchanged unless the entry's name is its name)."""
    name, tag, digest = split_image(image)
    if name != entry["name"]:
        return image
    name = entry.get("newName", name)
    if "digest" in entry:
        return f"{name}@{entry['digest']}"
    if "newTag" in entry:
        return f"{name}:{entry['newTag']}"
    return name + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")


def _rewrite_images(node: Any, entries: list[dict[str, str]]) -> None:
    """Every ``containers`` / ``initContainers`` image anywhere below ``node``."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                for c in value:
                    if isinstance(c, dict) and isinstance(c.get("image"), str):
                        for entry in entries:
                            c["image"] = set_image(c["image"], entry)
            _rewrite_images(value, entries)
    elif isinstance(node, list):
        for item in node:
            _rewrite_images(item, entries)


def kustomize_build(folder: Path = K8S) -> list[dict[str, Any]]:
    """The objects ``kubectl kustomize folder`` prints, for the fields this base uses.

    ``resources`` (files of the folder, in order), then ``namespace`` (set on every namespaced
    object), then ``images`` (each container image whose name matches an entry gets the entry's
    ``newName`` and ``newTag`` or ``digest``). A field, resource or kind beyond that is an error
    rather than silently ignored. Kustomize's output order (by kind) is not reproduced.
    """
    kustomization = load_yaml(folder / "kustomization.yaml")
    unknown = set(kustomization) - KUSTOMIZATION_FIELDS
    assert not unknown, f"kustomize_build does not model {sorted(unknown)} yet"
    assert kustomization["kind"] == "Kustomization"
    objects: list[dict[str, Any]] = []
    for resource in kustomization.get("resources", []):
        path = folder / resource
        assert path.is_file() and path.parent == folder, f"not a file of {folder}: {resource}"
        objects.extend(copy.deepcopy(load_yaml_docs(path)))
    namespace = kustomization.get("namespace")
    for obj in objects:
        assert obj["kind"] not in NAMESPACE_REFERRERS, f"{obj['kind']}: not modelled"
        if namespace and obj["kind"] not in CLUSTER_SCOPED:
            obj["metadata"]["namespace"] = namespace
    entries = kustomization.get("images", [])
    for entry in entries:
        assert set(entry) <= IMAGE_ENTRY_FIELDS and "name" in entry, entry
    _rewrite_images(objects, entries)
    return objects
