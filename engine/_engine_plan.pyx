# cython: language_level=3
"""Plan construction loops (placeholder, replaced by the plan layer)."""
def version():
    return 1
