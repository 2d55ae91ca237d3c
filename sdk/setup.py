"""Keeps the ``loramesh-client`` wheel to the SDK: of the ``loramesh`` package's own modules only
:data:`SDK_MODULES` are built (``loramesh.v1``, the generated stubs, goes in whole). Everything
else is in pyproject.toml."""

from setuptools import setup
from setuptools.command.build_py import build_py

SDK_MODULES = frozenset({"__init__", "client", "async_client", "errors", "stream_resume", "tls", "types"})
"""What ``from loramesh import Client, AsyncClient`` and the SDK's exceptions and types load."""


class BuildSdkModules(build_py):
    """``build_py`` that leaves out the non-SDK modules of the top package (the CLI is a
    subpackage, so it is left out by pyproject's package list)."""

    def find_package_modules(self, package, package_dir):
        modules = super().find_package_modules(package, package_dir)
        if package != "loramesh":
            return modules
        return [(pkg, module, path) for pkg, module, path in modules if module in SDK_MODULES]


setup(cmdclass={"build_py": BuildSdkModules})
