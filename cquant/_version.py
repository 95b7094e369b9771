# Hand-written (no notebook exports this file): the package version, in a module of its own so that any cquant module
# can import it without importing the package, and pyproject.toml reads it (`[tool.setuptools.dynamic]`).
__version__ = "0.1.0"
