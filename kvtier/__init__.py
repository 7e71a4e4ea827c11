"""kvtier: the command-line front end and the serving layer over engine, kvstore and connector."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("kvtier")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0.0.0+unknown"
