"""A small stand-in for `kustomize build`, for the tests of deploy/k8s (no kustomize binary
on the test machines).

It supports exactly the kustomize features those manifests use and raises KustomizeError on
anything else, so a new feature in a kustomization fails the tests instead of being skipped:

- `resources:` files (one or more YAML documents) and directories (built recursively);
- `images:` with name and newName / newTag / digest, applied to every `containers` and
  `initContainers` image, after the patches as kustomize does;
- `patches:` entries with a `path` only (no `target`, no inline `patch`), each a strategic
  merge patch addressed by apiVersion, kind and metadata.name: maps merge, `null` deletes a
  key, the list fields in MERGE_KEYS merge their items by key, the ones in ATOMIC_LISTS are
  replaced, any other list is an error; `$patch: delete` at a patch's top deletes the
  resource, any other `$patch` directive is an error.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "images", "patches"}
IMAGE_KEYS = {"name", "newName", "newTag", "digest"}

# Kubernetes' patchMergeKey of the list fields the patches touch (strategic merge patch).
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "env": "name",
}
# List fields without a merge strategy: a patch replaces them whole.
ATOMIC_LISTS = {"tolerations", "command", "args", "drop", "add"}


class KustomizeError(Exception):
    pass


Obj = dict[str, Any]


def build(directory: Path) -> list[Obj]:
    """The objects `kustomize build <directory>` would print (in resource order)."""
    directory = Path(directory)
    path = directory / "kustomization.yaml"
    if not path.is_file():
        raise KustomizeError(f"{directory}: no kustomization.yaml")
    k = yaml.safe_load(path.read_text())
    unknown = set(k) - KUSTOMIZATION_KEYS
    if unknown:
        raise KustomizeError(f"{path}: fields this renderer does not support: {sorted(unknown)}")
    if (k.get("apiVersion"), k.get("kind")) != ("kustomize.config.k8s.io/v1beta1", "Kustomization"):
        raise KustomizeError(f"{path}: not a kustomize.config.k8s.io/v1beta1 Kustomization")

    objs: list[Obj] = []
    for entry in k.get("resources", []):
        target = (directory / entry).resolve()
        if target.is_dir():
            added = build(target)
        elif target.is_file():
            added = load_documents(target)
        else:
            raise KustomizeError(f"{path}: resource {entry} does not exist")
        for obj in added:
            if any(_id(o) == _id(obj) for o in objs):
                raise KustomizeError(f"{path}: resource {_id(obj)} added twice")
            objs.append(obj)

    for entry in k.get("patches", []):
        if set(entry) != {"path"}:
            raise KustomizeError(f"{path}: patch entry {entry}: only `path` is supported")
        for patch in load_documents(directory / entry["path"]):
            objs = apply_patch(objs, patch)

    for image in k.get("images", []):
        if "name" not in image or set(image) - IMAGE_KEYS:
            raise KustomizeError(f"{path}: images entry {image}: supported keys {sorted(IMAGE_KEYS)}")
        if not set(image) & {"newName", "newTag", "digest"}:
            raise KustomizeError(f"{path}: images entry {image} changes nothing")
        for obj in objs:
            _set_images(obj, image)
    return objs


def load_documents(path: Path) -> list[Obj]:
    docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if d is not None]
    for d in docs:
        if not isinstance(d, dict) or not {"apiVersion", "kind", "metadata"} <= set(d):
            raise KustomizeError(f"{path}: a document is not a Kubernetes object")
    return docs


def _id(obj: Obj) -> tuple[str, str, str]:
    group = obj["apiVersion"].rpartition("/")[0]
    return group, obj["kind"], obj["metadata"]["name"]


def apply_patch(objs: list[Obj], patch: Obj) -> list[Obj]:
    matches = [i for i, o in enumerate(objs) if _id(o) == _id(patch)]
    if len(matches) != 1:
        raise KustomizeError(f"patch {_id(patch)} matches {len(matches)} resources, not one")
    (i,) = matches
    patch = copy.deepcopy(patch)
    directive = patch.pop("$patch", None)
    if directive == "delete":
        return objs[:i] + objs[i + 1:]
    if directive is not None:
        raise KustomizeError(f"patch {_id(patch)}: unsupported directive $patch: {directive}")
    out = list(objs)
    out[i] = merge(objs[i], patch, "")
    return out


def merge(base: Any, patch: Any, where: str) -> Any:
    """Strategic merge of ``patch`` into a copy of ``base`` (see the module's docstring)."""
    if not isinstance(patch, dict) or not isinstance(base, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(base)
    for key, value in patch.items():
        at = f"{where}.{key}"
        if key.startswith("$"):
            raise KustomizeError(f"{at}: unsupported directive")
        if value is None:
            out.pop(key, None)
        elif isinstance(value, list):
            out[key] = _merge_list(key, out.get(key), value, at)
        elif isinstance(value, dict):
            out[key] = merge(out[key] if isinstance(out.get(key), dict) else {}, value, at)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _merge_list(field: str, base: list | None, patch: list, where: str) -> list:
    if field in ATOMIC_LISTS or base is None:
        if field not in ATOMIC_LISTS and field not in MERGE_KEYS:
            raise KustomizeError(f"{where}: list field with a merge strategy this renderer does not know")
        return copy.deepcopy(patch)
    if field not in MERGE_KEYS:
        raise KustomizeError(f"{where}: list field with a merge strategy this renderer does not know")
    key = MERGE_KEYS[field]
    out = copy.deepcopy(base)
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            raise KustomizeError(f"{where}: every item needs its merge key {key!r}")
        if any(k.startswith("$") for k in item):
            raise KustomizeError(f"{where}: unsupported directive in a list item")
        found = [j for j, b in enumerate(out) if b.get(key) == item[key]]
        if found:
            out[found[0]] = merge(out[found[0]], item, f"{where}[{item[key]}]")
        else:
            out.append(copy.deepcopy(item))
    return out


def _split_image(ref: str) -> tuple[str, str, str]:
    """name, ':tag' or '', '@digest' or ''."""
    name, _, digest = ref.partition("@")
    slash = name.rfind("/")
    colon = name.rfind(":")
    tag = ""
    if colon > slash:
        name, tag = name[:colon], name[colon:]
    return name, tag, f"@{digest}" if digest else ""


def _set_images(node: Any, image: dict[str, str]) -> None:
    if isinstance(node, list):
        for item in node:
            _set_images(item, image)
        return
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        if key in ("containers", "initContainers") and isinstance(value, list):
            for c in value:
                name, tag, digest = _split_image(c["image"])
                if name != image["name"]:
                    continue
                if "newName" in image:
                    name = image["newName"]
                if "newTag" in image:
                    tag, digest = f":{image['newTag']}", ""
                if "digest" in image:
                    tag, digest = "", f"@{image['digest']}"
                c["image"] = name + tag + digest
        else:
            _set_images(value, image)
