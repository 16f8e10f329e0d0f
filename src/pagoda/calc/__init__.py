"""Napkin math for LLM serving: memory, KV size, latency floors, roofline, $/M tokens.

Pure Python with no torch import, so `pagoda calc` starts instantly. Layout:
formulas (pure functions) -> shapes/presets (what a model and GPU are) -> deployment (per-GPU figures)
-> report (sections) -> render (table, JSON) -> cli (argparse). docs/calc.md states the formulas.
"""
