"""Render a kustomization the way ``kubectl apply -k`` does, for the subset of kustomize rollmesh's manifests use.

No kustomize binary can be installed here, so the manifests keep to fields
whose meaning is simple and documented, and anything else is refused (so a
manifest cannot silently grow past what this renders faithfully):
``resources`` (files and directories with their own kustomization),
``namespace``, ``configMapGenerator`` (``files``, ``behavior`` create /
merge / replace) with ``generatorOptions.disableNameSuffixHash: true``, and
``patches`` given inline as JSON 6902 operations with a ``kind``/``name``
target (applied with the ``jsonpatch`` library).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import jsonpatch
import yaml

SUPPORTED = {"apiVersion", "kind", "resources", "namespace", "configMapGenerator", "generatorOptions", "patches"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "RuntimeClass", "PersistentVolume"}


class Unsupported(ValueError):
    pass


def render(directory: Path) -> list[dict[str, Any]]:
    """The objects ``kubectl apply -k directory`` would create."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    extra = set(kustomization) - SUPPORTED
    if extra:
        raise Unsupported(f"{directory}: kustomization fields {sorted(extra)} are beyond what the tests render")
    objects: list[dict[str, Any]] = []
    for resource in kustomization.get("resources", []):
        path = (directory / resource).resolve()
        if path.is_dir():
            objects += render(path)
        else:
            objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    generators = kustomization.get("configMapGenerator", [])
    if generators and not (kustomization.get("generatorOptions") or {}).get("disableNameSuffixHash"):
        raise Unsupported(f"{directory}: configMapGenerator needs generatorOptions.disableNameSuffixHash: true")
    for generator in generators:
        _generate(directory, generator, objects)
    for patch in kustomization.get("patches", []):
        _patch(directory, patch, objects)
    namespace = kustomization.get("namespace")
    if namespace:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj.setdefault("metadata", {})["namespace"] = namespace
    return objects


def _generate(directory: Path, generator: dict[str, Any], objects: list[dict[str, Any]]) -> None:
    if set(generator) - {"name", "files", "behavior"}:
        raise Unsupported(f"{directory}: configMapGenerator fields {sorted(set(generator))}")
    data = {}
    for entry in generator.get("files", []):
        key, _, source = entry.rpartition("=") if "=" in entry else (Path(entry).name, "", entry)
        data[key] = (directory / source).read_text()
    behavior = generator.get("behavior", "create")
    existing = next((o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"] == generator["name"]),
                    None)
    if behavior == "create":
        if existing is not None:
            raise Unsupported(f"{directory}: ConfigMap {generator['name']} exists; use behavior merge or replace")
        objects.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": generator["name"]},
                        "data": data})
    elif existing is None:
        raise Unsupported(f"{directory}: behavior {behavior} needs an existing ConfigMap {generator['name']}")
    elif behavior == "merge":
        existing["data"] = {**existing.get("data", {}), **data}
    elif behavior == "replace":
        existing["data"] = data
    else:
        raise Unsupported(f"{directory}: unknown configMapGenerator behavior {behavior!r}")


def _patch(directory: Path, patch: dict[str, Any], objects: list[dict[str, Any]]) -> None:
    target = patch.get("target", {})
    if set(patch) - {"target", "patch"} or set(target) - {"kind", "name"} or "patch" not in patch:
        raise Unsupported(f"{directory}: patches must be inline JSON 6902 with a kind/name target, got {patch}")
    operations = jsonpatch.JsonPatch(yaml.safe_load(patch["patch"]))
    matched = [i for i, o in enumerate(objects) if o["kind"] == target.get("kind", o["kind"])
               and o["metadata"]["name"] == target.get("name", o["metadata"]["name"])]
    if not matched:
        raise Unsupported(f"{directory}: patch target {target} matches nothing")
    for index in matched:
        objects[index] = operations.apply(copy.deepcopy(objects[index]))
