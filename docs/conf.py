"""Sphinx configuration: autodoc + napoleon (numpy style) for the API, MyST for the prose pages."""

import os
import sys

sys.path.insert(0, os.path.abspath(".."))
sys.path.insert(0, os.path.abspath("_scripts"))

project = "dp-randomized-clipping"
author = "the dp-randomized-clipping developers"
copyright = "2026, " + author
release = "0.1.0"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "myst_parser",
]
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_rtype = False
napoleon_use_ivar = True
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": True}
autodoc_typehints = "description"
autosummary_generate = False
myst_enable_extensions = ["dollarmath", "amsmath"]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build", "_generated"]
html_theme = "alabaster"
html_static_path = ["_static"]
nitpicky = False


def setup(app):
    import benchmark_tables
    import make_figures
    import support_table
    import utility_tables

    make_figures.main(os.path.join(os.path.dirname(__file__), "_static", "generated"))
    benchmark_tables.main(os.path.join(os.path.dirname(__file__), "_generated"))
    support_table.main(os.path.join(os.path.dirname(__file__), "_generated"))
    utility_tables.main(os.path.join(os.path.dirname(__file__), "_generated"),
                        os.path.join(os.path.dirname(__file__), "_static", "generated"))
