"""Anomaly mode: a cheap per-step non-finite check, and the op-level search that names the
first module, aten op and user frame of a NaN/Inf.
"""
