"""Glue for the training frameworks streamshard is used with (Lightning, Accelerate, DCP).

Only what a framework needs beyond the public API lives here; each module imports its framework lazily,
so streamshard never requires one.
"""
