"""Stage 1, hooks: what amp-doctor attaches to the user's run (module and tensor hooks, the
process-wide AMP API patches, model discovery, compile awareness).
"""
