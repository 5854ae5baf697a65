"""`--verify`: the converted folder against a reference forward of the source, on a few tokens."""

import torch

from ..configuration_samba import SambaConfig
from ..modeling_samba import SambaForCausalLM
from . import reference
from .checkpoint import Checkpoint, ConversionError

# Parameters up to which `--verify` runs unless told otherwise (it holds the source and the converted model at once).
AUTO_VERIFY_MAX_PARAMS = 1_000_000_000


def reference_logits(source: str, checkpoint: Checkpoint, config: SambaConfig, ids: torch.Tensor) -> torch.Tensor:
    if source == "lit-gpt":
        return reference.lit_gpt_logits(checkpoint, config, ids)
    if source == "fla":
        return reference.fla_logits(checkpoint, config, ids)
    if source == "megatron":
        return reference.megatron_logits(checkpoint, config, ids)
    from transformers import LlamaForCausalLM, MambaForCausalLM, MistralForCausalLM

    model_class = {"mamba": MambaForCausalLM, "mistral": MistralForCausalLM, "llama": LlamaForCausalLM}[source]
    model = model_class.from_pretrained(checkpoint.path, dtype=torch.float32)
    with torch.no_grad():
        return model(ids).logits.double()


def verify(
    source: str, checkpoint: Checkpoint, config: SambaConfig, folder, dtype: torch.dtype, num_tokens: int = 24
) -> tuple[float, str]:
    """Max |logit difference| between the converted model (loaded in float32) and the source's reference forward;
    raises when a conversion written in float32 (`dtype`) is off by more than 1e-3 of the logits' scale.
    Returns (difference, summary line)."""
    if config.mamba_version == 2 and "linear_attention" in config.layer_types:
        num_tokens = max(num_tokens, config.mamba2_chunk_size + 8)  # across an SSD chunk boundary
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (2, num_tokens), generator=generator)
    model = SambaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        ours = model(ids).logits.double()
    expected = reference_logits(source, checkpoint, config, ids)
    for name, logits in (("the converted model's", ours), ("the source's reference", expected)):
        if not bool(torch.isfinite(logits).all()):
            raise ConversionError(
                f"verification failed: {name} logits are not finite (NaN or inf) on 2 x {num_tokens} random tokens. "
                "Nothing was written."
            )
    difference = (ours - expected).abs().max().item()
    scale = max(1.0, expected.abs().max().item())
    kind = "transformers' own class" if source in ("mamba", "mistral", "llama") else "a float64 forward of the source"
    summary = (
        f"max |logit difference| {difference:.3g} (logits up to {scale:.3g}) on 2 x {num_tokens} random tokens, "
        f"converted model in float32 against {kind}"
    )
    if dtype == torch.float32 and difference > 1e-3 * scale:
        raise ConversionError(f"verification failed: {summary}. Nothing was written.")
    return difference, summary
