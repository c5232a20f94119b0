"""dmltrain: distributed large-batch deep metric learning with listwise ranking losses."""

__version__ = "0.1.0"
