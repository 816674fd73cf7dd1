"""The one namespace ``pdserve.*`` lives in the folder ``pdserve/`` (docs/design.md §1).

The package used to be the repository root itself, which made ``shared``, ``services``, ``kernels`` and
``loadtest`` importable as top-level modules from any process whose ``sys.path`` starts at the root (``python -m``,
``python -c``, pytest, a notebook): transformers 5.25 imports Hugging Face's ``kernels`` distribution at start-up
and found ours instead. Under ``pdserve/`` nothing but ``pdserve`` itself is a top-level name.
"""
from setuptools import find_packages, setup

setup(
    packages=find_packages(".", include=["pdserve", "pdserve.*"]),
    package_data={"pdserve.loadtest": ["*.json", "*.sh"], "pdserve.kernels": ["*.c", "*.h"],
                  "pdserve.services.router": ["templates/*.jinja"]},
)
