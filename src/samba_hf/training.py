"""Fine-tuning helpers: the recommended LoRA targets for Samba and the Mamba-2 layouts.

    from peft import get_peft_model
    from samba_hf.training import lora_config
    model = get_peft_model(model, lora_config(r=16))

Every projection of every mixer and MLP is called as a module (`self.dt_proj(...)`, never `dt_proj.weight @ x`),
so an adapter on any of them takes effect on every path: training, evaluation, cached decoding, and the CUDA kernel
paths (the kernels only see the projections' outputs). The depthwise conv of the Mamba mixer takes no LoRA: each
of its channels has `mamba_d_conv` (4) weights, and PEFT only adapts a grouped conv whose rank is a multiple of
its d_inner groups; train it in full with `modules_to_save=["conv1d"]` if it must change.
"""

# attention q/k/v/o, SwiGLU gate/up/down (a plain MLP: up/down), Mamba in/x/dt/out projections (Mamba-2: in/out)
LORA_TARGET_MODULES = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "in_proj",
    "x_proj",
    "dt_proj",
    "out_proj",
]


def lora_config(r: int = 8, lora_alpha: int | None = None, lora_dropout: float = 0.0, target_modules=None, **kwargs):
    """A `peft.LoraConfig` for causal LM fine-tuning of Samba (targets: `LORA_TARGET_MODULES` unless given;
    `"all-linear"` works too). Refuses the Mamba conv with a message that says what to do instead."""
    from peft import LoraConfig

    targets = LORA_TARGET_MODULES if target_modules is None else target_modules
    names = [targets] if isinstance(targets, str) else list(targets)
    if any(name == "conv1d" or name.endswith(".conv1d") for name in names):
        raise ValueError(
            "LoRA on the Mamba depthwise conv (`conv1d`) is not supported: it has 4 weights per channel, and PEFT "
            "adapts grouped convs only when the rank is a multiple of d_inner. Leave it out of target_modules, or "
            "train it in full with modules_to_save=['conv1d']."
        )
    return LoraConfig(
        r=r,
        lora_alpha=2 * r if lora_alpha is None else lora_alpha,
        lora_dropout=lora_dropout,
        target_modules=targets,
        task_type="CAUSAL_LM",
        **kwargs,
    )


__all__ = ["LORA_TARGET_MODULES", "lora_config"]
