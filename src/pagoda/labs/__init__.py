"""`pagoda lab NAME`: one knob of a real engine swept, with the calculator's prediction beside each measurement.

Each lab is a module with a NAME, a QUESTION, `run(model, quick) -> LabResult` and `plot(result, axes)`; the
registry (labs/registry.py) lists them. A lab asserts its lesson on counted quantities (tokens, blocks,
requests), never on timings, so that `--quick` in the tests checks what the lab teaches.
"""
