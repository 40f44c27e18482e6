"""Build script: ahead-of-time C++/CUDA extension when torch is importable, else sources only.

With torch visible at build time (`pip install --no-build-isolation .`), offload_ext._C is compiled
now, with its CUDA parts when torch is a CUDA build and a CUDA toolkit is found. Without torch
(a plain isolated `pip install .`), the sources ship inside the package and offload_ext builds
them just-in-time on first import.
"""
import importlib.util
import os
import sys

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
PKG_DIR = os.path.join(HERE, "python", "offload_ext")


def _load(name: str, filename: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(PKG_DIR, filename))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def _say(msg: str) -> None:
    print(f"offload_ext setup: {msg}", file=sys.stderr, flush=True)


def extension_build():
    """(ext_modules, cmdclass) for an ahead-of-time build, or empty ones when torch is absent."""
    try:
        import torch
    except ImportError:
        _say("torch is not importable at build time (isolated build?): packaging the C++ sources only; "
             "the extension will be built just-in-time on first import. For an ahead-of-time build: "
             "pip install --no-build-isolation .")
        return [], {}
    build = _load("offload_ext_build", "_build.py")
    plan = build.plan_build(torch.version.cuda)
    if plan.with_cuda:
        os.environ["CUDA_HOME"] = plan.cuda_home  # read by torch.utils.cpp_extension at import
    from torch.utils import cpp_extension

    if plan.with_cuda:
        cpp_extension.CUDA_HOME = plan.cuda_home
        archs = build.choose_arch_list(torch.cuda.device_count() > 0, torch.cuda.get_arch_list(), plan.cuda_home)
        _say(f"building offload_ext._C WITH CUDA ({plan.reason}); {archs}")
        ext_cls = cpp_extension.CUDAExtension
    else:
        _say(f"building offload_ext._C CPU-only: {plan.reason}")
        ext_cls = cpp_extension.CppExtension
    rel_sources = [os.path.relpath(s, HERE) for s in plan.sources]
    ext = ext_cls(build.EXT_NAME, rel_sources, extra_compile_args={"cxx": plan.cxx_flags, "nvcc": ["-O3"]})
    return [ext], {"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = extension_build()

setup(
    packages=find_packages("python"),
    package_dir={"": "python"},
    package_data={"offload_ext": ["csrc/**/*.h", "csrc/**/*.cpp", "csrc/**/*.cu"]},
    include_package_data=True,
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
