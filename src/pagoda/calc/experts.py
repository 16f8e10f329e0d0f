"""The mixture-of-experts section of the report: total and active parameters, and what a decode step reads.

A step reads every weight outside the routed experts once, and of the routed experts those some token of the
batch chose: at batch 1 exactly top_k per sparse layer, at batch B the expected union of B independent top-k
choices (`shapes.expected_experts_hit`, routing taken as uniform; trained routers are balanced towards it by
their auxiliary loss, and a skewed router hits fewer).
"""

from __future__ import annotations

from pagoda.calc import formulas as f
from pagoda.calc.deployment import Deployment
from pagoda.calc.render import Section
from pagoda.calc.shapes import ExpertShape, expected_experts_hit

# The batches whose bytes read per step the section shows beside --batch.
SHOWN_BATCHES = (1, 32)


def experts_section(d: Deployment, experts: ExpertShape) -> Section:
    inputs, model = d.inputs, d.inputs.model
    s = Section("experts", "Mixture of experts")
    s.add("num_experts", "routed experts", f"{experts.num_experts} per layer, top {experts.top_k}, "
                                            f"{experts.num_sparse_layers} sparse layers")
    inactive = experts.routed_params(experts.num_experts - experts.top_k)
    s.add("total_params", "total parameters", model.num_params)
    s.add("active_params", "active parameters per token", model.num_params - inactive,
          note="total less the experts a token does not use")
    s.add("expert_bytes", f"one expert ({inputs.dtype})", f.weight_bytes(experts.expert_params, inputs.dtype), "bytes")
    for batch in sorted({*SHOWN_BATCHES, inputs.batch}):
        hit = expected_experts_hit(experts.num_experts, experts.top_k, batch)
        s.add(f"experts_hit_batch_{batch}", f"experts run per layer, batch {batch}", round(hit, 2),
              note="expected union of top-k choices" if batch > 1 else "")
        s.add(f"weights_read_bytes_batch_{batch}", f"weights read per step, batch {batch}",
              d.weights_read_at(batch), "bytes", "per GPU")
    return s
