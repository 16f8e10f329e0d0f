"""The engine's pure core: requests, their queues, the scheduler and its step budget, the KV manager, the
speculation bookkeeping, and what a step of the runner gives back (runner_output.py). Python over integers:
nothing here imports torch or the model, so it runs (and is tested) without either; the tensors it plans
for live in the runner, outside this package."""
