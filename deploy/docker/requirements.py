"""Print the requirement lines of pyproject.toml for the given extras, one per line.

Used by the Dockerfiles to install the dependencies in a layer of their own (cached while
pyproject.toml does not change) before the project's sources are copied in:

    python3 requirements.py pyproject.toml onnx,torch
"""

import re
import sys
import tomllib


def main() -> None:
    path, extras = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else ""
    with open(path, "rb") as f:
        project = tomllib.load(f)["project"]
    lines = list(project["dependencies"])
    optional = project.get("optional-dependencies", {})
    for extra in filter(None, (e.strip() for e in extras.split(","))):
        if extra not in optional:
            sys.exit(f"unknown extra {extra!r}; pyproject.toml has: {', '.join(sorted(optional))}")
        lines += optional[extra]
    groups = {"onnxruntime": [], "onnxruntime-gpu": []}
    for line in lines:
        name = re.match(r"\s*([A-Za-z0-9._-]+)", line).group(1).lower()
        if name in groups:
            groups[name].append(line)
    if groups["onnxruntime"] and groups["onnxruntime-gpu"]:
        sys.exit("extras 'onnx' and 'onnx-gpu' exclude each other: onnxruntime and "
                 "onnxruntime-gpu install the same module")
    seen = set()
    for line in lines:
        if line not in seen:
            seen.add(line)
            print(line)


if __name__ == "__main__":
    main()
