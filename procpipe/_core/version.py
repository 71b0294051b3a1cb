"""procpipe's version, in one place: ``procpipe.__version__`` and the package metadata both read it.

pyproject.toml's ``[tool.setuptools.dynamic]`` takes it from here by reading this file (a literal,
no import), so building a wheel never imports procpipe. Keep it a plain string literal, and import
nothing here.
"""

__version__ = "0.1.0"
