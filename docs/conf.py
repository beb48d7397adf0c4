"""Sphinx configuration of mpigossip's documentation: the guide pages in docs/ (Markdown, through
MyST) and an API reference from the docstrings. Build: ``python -m sphinx -W -b html docs OUT``."""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))

import mpigossip  # noqa: E402

project = "mpigossip"
author = "the mpigossip developers"
copyright = "2026, the mpigossip developers"
release = version = mpigossip.__version__

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["reproduce/*", "_build"]
myst_heading_anchors = 3
# Guide pages link to files of the repository outside docs/ (benchmarks/results/..., the
# scripts): fine on GitHub, not documents of this site.
suppress_warnings = ["myst.xref_missing"]
autodoc_member_order = "bysource"
autodoc_mock_imports = ["torch", "cupy"]
napoleon_google_docstring = True
napoleon_numpy_docstring = False
html_theme = "alabaster"
