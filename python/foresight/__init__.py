"""foresight: a plan-driven data engine for large training jobs."""
__version__ = "0.1.0"
