"""Stage 4, analysis: detectors turn a Session into findings, folding keeps one error per
root cause, and advice tables say what to do.
"""
