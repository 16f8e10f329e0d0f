"""The mixture-of-experts section of the report: total and active parameters, and what a decode step reads.

A step reads every weight outside the routed experts once, and of the routed experts those some token of the
batch chose: at batch 1 exactly top_k per sparse layer, at batch B the expected union of B independent top-k
choices (`shapes.expected_experts_hit`, routing taken as uniform; trained routers are balanced towards it by
their auxiliary loss, and a skewed router hits fewer).

On several GPUs the section adds what expert parallelism (`--enable-expert-parallel`) sends per step: each GPU
routes its slice of the batch, sends each token's top_k rows to the GPUs holding their experts and takes the
results back (the all-to-all), then the layer's output slices are gathered to every GPU.
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
    if inputs.num_gpus > 1 and (arch := model.architecture) is not None:
        gpus, activation_bytes = inputs.num_gpus, max(2.0, f.dtype_bytes(inputs.dtype))
        for batch in sorted({*SHOWN_BATCHES, inputs.batch}):
            all_to_all = experts.num_sparse_layers * f.ep_all_to_all_bytes(batch, experts.top_k, arch.hidden_size,
                                                                            activation_bytes, gpus)
            gather = experts.num_sparse_layers * f.ep_all_gather_bytes(batch, arch.hidden_size, activation_bytes, gpus)
            s.add(f"ep_all_to_all_bytes_batch_{batch}", f"expert-parallel all-to-all per step, batch {batch}",
                  all_to_all, "bytes", "sent per GPU: dispatch + combine, uniform routing")
            s.add(f"ep_all_gather_bytes_batch_{batch}", f"expert-parallel output all-gather per step, batch {batch}",
                  gather, "bytes", "sent per GPU")
    return s
