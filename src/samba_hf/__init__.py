"""samba-hf: the Samba language model (Mamba + sliding-window attention) for Hugging Face transformers.

Importing the package registers the "samba" model type with `AutoConfig`, `AutoModel` and `AutoModelForCausalLM`,
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
AutoConfig.register("samba", SambaConfig, exist_ok=True)
AutoModel.register(SambaConfig, SambaModel, exist_ok=True)
AutoModelForCausalLM.register(SambaConfig, SambaForCausalLM, exist_ok=True)

SambaConfig.register_for_auto_class()
SambaModel.register_for_auto_class("AutoModel")
SambaForCausalLM.register_for_auto_class("AutoModelForCausalLM")

# SambaY under the released model_type, so microsoft/Phi-4-mini-flash-reasoning's folder loads without its remote code.
AutoConfig.register("phi4flash", SambaYConfig, exist_ok=True)
AutoModel.register(SambaYConfig, SambaYModel, exist_ok=True)
AutoModelForCausalLM.register(SambaYConfig, SambaYForCausalLM, exist_ok=True)
SambaYConfig.register_for_auto_class()
SambaYModel.register_for_auto_class("AutoModel")
SambaYForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = ["SambaConfig", "SambaForCausalLM", "SambaModel", "SambaPreTrainedModel", "SambaYConfig",
           "SambaYForCausalLM", "SambaYModel", "SambaYPreTrainedModel", "__version__"]
