"""Maps the one namespace ``pdserve.*`` onto the repository's top-level folders (docs/design.md §1).

``pdserve`` itself is the repository root (its ``__init__.py``); ``pdserve.shared``,
``pdserve.services``, ``pdserve.kernels`` and ``pdserve.loadtest`` are the folders of those names.
"""
from setuptools import find_packages, setup
from setuptools.command.build_py import build_py


class BuildPy(build_py):
    """The root package is the repository root: leave this build script out of it."""

    def find_package_modules(self, package, package_dir):
        modules = super().find_package_modules(package, package_dir)
        return [m for m in modules if not (package == "pdserve" and m[1] == "setup")]


TOP = ["shared", "services", "kernels", "loadtest"]
subpackages = [p for p in find_packages(".") if p.split(".")[0] in TOP]

setup(
    packages=["pdserve"] + [f"pdserve.{p}" for p in subpackages],
    package_dir={"pdserve": "."},
    package_data={"pdserve.loadtest": ["*.json"], "pdserve.kernels": ["*.c", "*.h"]},
    cmdclass={"build_py": BuildPy},
)
