"""LoRA adapters for the tests, made with PEFT on the tiny checkpoints, and PEFT's greedy output as the reference.

Adapters are made with `init_lora_weights=False` (PEFT's default leaves B = 0, which an engine that ignores
adapters would pass), and saved with `save_pretrained` (safetensors), as users save theirs.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from conftest import Reference


def make_adapter(base_dir: Path, out_dir: Path, *, r: int, alpha: float, targets: Sequence[str],
                 rslora: bool = False, seed: int = 0, scale: float = 1.0, **config_fields) -> Path:
    """A seeded PEFT LoRA adapter of `base_dir`'s model, saved to out_dir. `scale` multiplies B, so that the
    adapter's effect on greedy output is decisive."""
    import peft
    import transformers

    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False,
                             use_rslora=rslora, lora_dropout=0.0, **config_fields)
    peft_model = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(scale)
    peft_model.save_pretrained(str(out_dir))
    return out_dir


_models: dict[tuple[str, str | None], torch.nn.Module] = {}
_cache: dict[tuple, Reference] = {}


def peft_reference(base_dir: Path, adapter_dir: Path | None, prompt_ids: Sequence[int],
                   max_new_tokens: int, dtype: torch.dtype = torch.float32) -> Reference:
    """transformers + PEFT greedy generation of one unpadded prompt (adapter None: the base model alone)."""
    import peft
    import transformers

    key = (str(base_dir), None if adapter_dir is None else str(adapter_dir), str(dtype))
    full_key = (*key, tuple(prompt_ids), max_new_tokens)
    if full_key in _cache:
        return _cache[full_key]
    if key not in _models:
        transformers.logging.set_verbosity_error()
        model = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=dtype)
        if adapter_dir is not None:
            model = peft.PeftModel.from_pretrained(model, str(adapter_dir), autocast_adapter_dtype=False)
        _models[key] = model.eval()
    model = _models[key]
    input_ids = torch.tensor([list(prompt_ids)], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                             max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=2,
                             output_logits=True, return_dict_in_generate=True)
    token_ids = out.sequences[0, input_ids.shape[1]:].tolist()
    assert len(token_ids) == max_new_tokens
    _cache[full_key] = Reference(token_ids, torch.cat([step.float() for step in out.logits], dim=0))
    return _cache[full_key]
