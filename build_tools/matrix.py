"""Prints views of wheels.toml for CI: the GitHub Actions matrix, the toolkits to install, and
the environment that points the build at them.

    python build_tools/matrix.py github            # JSON for strategy.matrix (one entry per platform)
    python build_tools/matrix.py toolkits          # "<name> <major.minor> <full version>" per line
    python build_tools/matrix.py env linux|windows # WLLM_CUDA_HOME_<NAME>=<install dir> per line
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_build import load_matrix  # noqa: E402


def toolkit_home(system: str, cuda: str) -> str:
    """Where the CUDA installers put a toolkit of version major.minor."""
    if system == "windows":
        return rf"C:\Program Files\NVIDIA GPU Computing Toolkit\CUDA\v{cuda}"
    return f"/usr/local/cuda-{cuda}"


def github_matrix() -> dict:
    matrix = load_matrix()
    return {"include": [
        {"platform": p["name"], "runner": p["runner"], "cibw_build": p["cibw_build"], "cibw_archs": p["cibw_archs"]}
        for p in matrix.platforms
    ]}


def main(argv: list[str]) -> int:
    matrix = load_matrix()
    if argv[:1] == ["github"]:
        print(json.dumps(github_matrix()))
    elif argv[:1] == ["toolkits"]:
        for t in matrix.toolkits:
            print(t.name, t.cuda, t.full_version)
    elif argv[:1] == ["env"] and len(argv) == 2:
        for t in matrix.toolkits:
            print(f"WLLM_CUDA_HOME_{t.name.upper()}={toolkit_home(argv[1], t.cuda)}")
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
