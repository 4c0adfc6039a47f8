"""Stage 3, step records: the step boundary, the GradScaler mirror and its timeline, misuse
checks, and the folder that turns a host copy into a StepRecord.
"""
