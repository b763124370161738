"""Build hook: compiles csrc/ into wllm/_lib/ when nvcc is present (see build_tools/kernel_build.py).

Without nvcc (or with WLLM_NO_KERNELS=1) the package builds as pure Python and runs on the CPU.
With the library inside, the wheel is tagged py3-none-<platform>: the library has a C ABI, so
one wheel serves every Python 3.10+ and every PyTorch 2.4+.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "build_tools"))
import kernel_build  # noqa: E402

KERNEL_EXT = "wllm._lib.wllm_kernels"


class BuildKernels(build_ext):
    """Builds the kernel shared library instead of a CPython extension module."""

    def get_ext_filename(self, fullname: str) -> str:
        # setuptools asks with the full dotted name, or with the last part when building in place.
        if fullname == KERNEL_EXT:
            return str(Path("wllm", "_lib", kernel_build.LIB_NAME))
        if fullname == KERNEL_EXT.rsplit(".", 1)[1]:
            return kernel_build.LIB_NAME
        return super().get_ext_filename(fullname)

    def copy_extensions_to_source(self) -> None:
        # Editable installs: the library goes to the source tree; its build_info.json goes with it.
        super().copy_extensions_to_source()
        built = Path(self.build_lib) / "wllm" / "_lib" / "build_info.json"
        if built.is_file():
            (ROOT / "wllm" / "_lib" / "build_info.json").write_bytes(built.read_bytes())

    def build_extension(self, ext: Extension) -> None:
        if ext.name != KERNEL_EXT:
            return super().build_extension(ext)
        out_dir = Path(self.get_ext_fullpath(ext.name)).parent
        build_dir = Path(self.build_temp) / "kernels"
        try:
            kernel_build.build(out_dir, build_dir, verbose=bool(os.environ.get("WLLM_BUILD_VERBOSE")))
        except kernel_build.BuildError as exc:
            raise SystemExit(f"wllm: kernel build failed: {exc}\n"
                             "Set WLLM_NO_KERNELS=1 to install the CPU-only package instead.") from exc

    def get_outputs(self) -> list[str]:
        outputs = super().get_outputs()
        for ext in self.extensions:
            if ext.name == KERNEL_EXT:
                outputs.append(str(Path(self.get_ext_fullpath(ext.name)).parent / "build_info.json"))
        return outputs


class PlatformWheel(bdist_wheel):
    """py3-none-<platform>: platform-specific (it carries a native library), Python-agnostic."""

    def get_tag(self) -> tuple[str, str, str]:
        python, abi, plat = super().get_tag()
        if self.root_is_pure:
            return python, abi, plat
        return "py3", "none", plat


def kernel_extensions() -> list[Extension]:
    if os.environ.get("WLLM_NO_KERNELS", "") not in ("", "0"):
        print("wllm: WLLM_NO_KERNELS set: building the CPU-only package", file=sys.stderr)
        return []
    if kernel_build.find_nvcc(kernel_build.load_matrix().toolkits[0]) is None:
        print("wllm: nvcc not found: building the CPU-only package (no CUDA kernels). "
              "Install the CUDA toolkit or use a prebuilt wheel for GPU support.", file=sys.stderr)
        return []
    return [Extension(KERNEL_EXT, sources=[])]


setup(
    ext_modules=kernel_extensions(),
    cmdclass={"build_ext": BuildKernels, "bdist_wheel": PlatformWheel},
)
