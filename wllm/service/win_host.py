"""The program of the Windows service: `<base python.exe> -S win_host.py --site DIR ... --config FILE`.

It runs as a script under the base interpreter with no site processing (-S), so it first makes the
virtual environment importable: each --site folder goes first on sys.path through site.addsitedir, which
also runs its .pth files (pywin32's adds the folder of pywintypes3X.dll to the DLL search path; an
editable install's points at the source tree). Then wllm.service.windows.host_main takes over.
"""

import os
import site
import sys


def _bootstrap(argv: list[str]) -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    # This script's folder is sys.path[0]; its modules must not shadow top-level ones.
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    before = list(sys.path)
    for i, arg in enumerate(argv):
        if arg == "--site" and i + 1 < len(argv):
            site.addsitedir(argv[i + 1])
    added = [p for p in sys.path if p not in before]
    sys.path[:] = added + before


if __name__ == "__main__":
    _bootstrap(sys.argv[1:])
    from wllm.service.windows import host_main

    sys.exit(host_main(sys.argv[1:]))
