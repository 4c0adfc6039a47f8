"""Stage 2, on-device stats: per-tensor summaries kept on the device, and the step buffer
that packs them for the step's one host copy.
"""
