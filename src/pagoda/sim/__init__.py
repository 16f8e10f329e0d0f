"""`pagoda sim`: a fleet simulator. The real router policies and the real scheduler and KV manager of each
replica, with the forward pass replaced by a step-cost model, replaying a multi-turn trace in simulated time
(docs/sim.md). Torch-free."""
