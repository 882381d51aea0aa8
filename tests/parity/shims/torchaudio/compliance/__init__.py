"""Import shim for the reference environment; see _unavailable.py."""
import sys

from _unavailable import UnavailableModule

sys.modules[__name__].__class__ = UnavailableModule
