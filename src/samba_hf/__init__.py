"""samba-hf: the Samba language model (Mamba + sliding-window attention) for Hugging Face transformers.

Importing the package registers the "samba" model type (and SambaY's "phi4flash", the architecture of
microsoft/Phi-4-mini-flash-reasoning) with `AutoConfig`, `AutoModel` and `AutoModelForCausalLM`,
and marks the classes for `trust_remote_code` export, so `save_pretrained` writes a folder that loads without
this package installed.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_samba import SambaConfig
from .configuration_sambay import SambaYConfig
from .modeling_samba import SambaForCausalLM, SambaModel, SambaPreTrainedModel
from .modeling_sambay import SambaYForCausalLM, SambaYModel, SambaYPreTrainedModel

__version__ = "0.1.0"

# exist_ok: another library (flash-linear-attention) registers its own, different "samba"; ours wins once imported.
# SambaY goes under the released model_type, so Phi-4-mini-flash-reasoning's folder loads without its remote code.
for model_type, config_class, base_class, causal_lm_class in (
    ("samba", SambaConfig, SambaModel, SambaForCausalLM),
    ("phi4flash", SambaYConfig, SambaYModel, SambaYForCausalLM),
):
    AutoConfig.register(model_type, config_class, exist_ok=True)
    AutoModel.register(config_class, base_class, exist_ok=True)
    AutoModelForCausalLM.register(config_class, causal_lm_class, exist_ok=True)
    config_class.register_for_auto_class()
    base_class.register_for_auto_class("AutoModel")
    causal_lm_class.register_for_auto_class("AutoModelForCausalLM")
del model_type, config_class, base_class, causal_lm_class

__all__ = [
    "SambaConfig",
    "SambaForCausalLM",
    "SambaModel",
    "SambaPreTrainedModel",
    "SambaYConfig",
    "SambaYForCausalLM",
    "SambaYModel",
    "SambaYPreTrainedModel",
    "__version__",
]
