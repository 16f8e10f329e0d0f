"""The engine's pure core: requests, their queues, the scheduler and its step budget, the KV manager and the
speculation bookkeeping. Python over integers: nothing here imports torch or the model, so it runs (and is
tested) without either; the tensors it plans for live in the runner, outside this package."""
