"""SambaY configuration: the architecture of microsoft/Phi-4-mini-flash-reasoning (model_type "phi4flash").

SambaY (Ren et al., "Decoder-Hybrid-Decoder Architecture for Efficient Reasoning with Long Generation", 2025) is a
Samba self-decoder followed by a YOCO cross-decoder. With L = num_hidden_layers (a multiple of 4), layer i is:

    i < L/2, even       Mamba                                   ("linear_attention" for the cache)
    i < L/2, odd        differential attention, sliding window  ("sliding_attention")
    i = L/2             Mamba whose pre-gate scan output is the memory the GMU layers read
    i = L/2 + 1         differential attention over every position; its keys/values are the one cache that every
                        cross-attention layer reads (YOCO)           ("full_attention")
    i > L/2 + 1, even   GMU: a gate on the memory of layer L/2       (no cache)
    i > L/2 + 1, odd    differential cross-attention on layer L/2 + 1's keys/values (no cache)

Every layer also has a SwiGLU MLP; norms are LayerNorms with bias; there are no positional encodings (NoPE).
The field names and defaults are those of the released config.json, which loads unchanged.

This file is also the remote code of a saved model: it imports only torch/transformers.
"""

import math

from .configuration_samba import SambaMixerConfig, check_field_types

BLOCK_TYPES = ("mamba", "sliding_attention", "memory", "full_attention", "gmu", "cross_attention")


def fail(message: str):
    raise ValueError(f"SambaYConfig: {message}")


class SambaYConfig(SambaMixerConfig):
    r"""
    Configuration of a [`SambaYForCausalLM`]. The defaults are those of Phi-4-mini-flash-reasoning (3.85B).

    Args:
        vocab_size (`int`, defaults to 200064): embedding rows (the tokenizer uses at most 200029).
        hidden_size (`int`, defaults to 2560): width of the residual stream.
        intermediate_size (`int`, defaults to 10240): width of the SwiGLU MLP of every layer.
        num_hidden_layers (`int`, defaults to 32): a multiple of 4 (the YOCO split is at L/2).
        num_attention_heads (`int`, defaults to 40): query heads; head_dim = hidden_size / num_attention_heads.
        num_key_value_heads (`int`, defaults to 20): key/value heads, even (differential attention pairs them).
        hidden_act (`str`, defaults to `"silu"`): activation of the MLP gate and of the Mamba / GMU gates.
        max_position_embeddings (`int`, defaults to 262144): the released value; nothing in the math reads it
            (NoPE), it tells tools how long an input may be.
        layer_norm_eps (`float`, defaults to 1e-5): epsilon of every LayerNorm.
        sliding_window (`int`, defaults to 512): keys visible to a sliding layer's query, the query included.
        mb_per_layer (`int`, defaults to 2): Mamba on every second layer of the self-decoder (the only value the
            release builds).
        mamba_d_state / mamba_d_conv / mamba_expand / mamba_dt_rank: the Mamba sizes (16 / 4 / 2 / ceil(H/16)); these
            and the other `mamba_*` fields, `inference_chunk_size` and `kernel_implementation` as
            [`SambaMixerConfig`] describes them.
        tie_word_embeddings (`bool`, defaults to `True`): the head is the embedding matrix.
        embd_pdrop, resid_pdrop, mlp_bias, lm_head_bias: in the released config.json; the released model ignores
            them (no dropout is applied, the MLP and head have no bias), and so does this one.
    """

    model_type = "phi4flash"
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 200064
    hidden_size: int = 2560
    intermediate_size: int = 10240
    num_hidden_layers: int = 32
    num_attention_heads: int = 40
    num_key_value_heads: int = 20
    hidden_act: str = "silu"
    max_position_embeddings: int = 262144
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-5
    use_cache: bool = True
    pad_token_id: int | None = 199999
    bos_token_id: int | None = 199999
    eos_token_id: int | list[int] | None = 199999
    tie_word_embeddings: bool = True
    sliding_window: int = 512
    attention_dropout: float | int = 0.0
    mb_per_layer: int = 2
    embd_pdrop: float | int = 0.0
    resid_pdrop: float | int = 0.0
    mlp_bias: bool = False
    lm_head_bias: bool = False
    layer_types: list[str] | None = None

    def __post_init__(self, **kwargs):
        check_field_types(self, FIELD_TYPES)  # as SambaConfig checks its own
        self._check_shared_fields()
        for name in FIELD_TYPES["an int"]:
            value = getattr(self, name)  # an int: check_field_types has seen to that
            if value < 1 and name != "mb_per_layer":  # (which must be 2: below)
                fail(f"`{name}` must be a positive integer, got {value!r}.")
        if self.num_hidden_layers % 4:
            fail(
                f"`num_hidden_layers` must be a multiple of 4 (the YOCO split is at L/2), "
                f"got {self.num_hidden_layers}."
            )
        if self.hidden_size % self.num_attention_heads:
            fail(
                f"`hidden_size` ({self.hidden_size}) must be a multiple of `num_attention_heads` "
                f"({self.num_attention_heads}): head_dim = hidden_size / num_attention_heads."
            )
        if self.num_key_value_heads % 2 or self.num_attention_heads % self.num_key_value_heads:
            fail(
                f"`num_key_value_heads` ({self.num_key_value_heads}) must be even (differential attention pairs "
                f"heads) and divide `num_attention_heads` ({self.num_attention_heads})."
            )
        if self.mb_per_layer != 2:
            fail(
                f"`mb_per_layer` must be 2 (Mamba on every second self-decoder layer, as released), got "
                f"{self.mb_per_layer}."
            )
        if self.layer_norm_eps <= 0:
            fail(f"`layer_norm_eps` must be > 0 (the release uses 1e-5), got {self.layer_norm_eps!r}.")
        if self.mamba_dt_rank == "auto":
            self.mamba_dt_rank = math.ceil(self.hidden_size / 16)
        if self.layer_types is None:
            self.layer_types = [CACHE_TYPES[block] for block in self.block_types]
        elif list(self.layer_types) != [CACHE_TYPES[block] for block in self.block_types]:
            fail("`layer_types` is derived from `num_hidden_layers` (the SambaY pattern); leave it unset.")
        # The released config.json asks for flash-attention ("_attn_implementation"); it is not binding here: the
        # attention implementation is chosen as for any transformers model (sdpa unless `attn_implementation=` asks
        # otherwise), so a machine without flash-attn loads the folder too.
        kwargs.pop("_attn_implementation", None)
        super().__post_init__(**kwargs)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    # What Samba's layers read (SambaMLP, `_init_weights`): SambaY's MLPs are SwiGLU, one after every mixer.
    mixer_mlp = property(lambda self: True)
    mlp_gated = property(lambda self: True)
    mlp_hidden_act = property(lambda self: None)
    mamba_version = property(lambda self: 1)

    @property
    def block_types(self) -> list[str]:
        """What each layer computes (see the module docstring)."""
        half = self.num_hidden_layers // 2
        blocks = []
        for i in range(self.num_hidden_layers):
            if i < half:
                blocks.append("mamba" if i % 2 == 0 else "sliding_attention")
            elif i == half:
                blocks.append("memory")
            elif i == half + 1:
                blocks.append("full_attention")
            else:
                blocks.append("gmu" if i % 2 == 0 else "cross_attention")
        return blocks

    @property
    def kv_sharing_modes(self) -> list[str]:
        """transformers' cache reads this: the cross-decoder's GMU and cross-attention layers keep no cache of their
        own (they read layer L/2's memory and layer L/2+1's keys/values)."""
        return ["reuse" if block in ("gmu", "cross_attention") else "own" for block in self.block_types]


# The type of each field, checked by `check_field_types` (shared with SambaConfig).
# fmt: off
FIELD_TYPES = {
    "an int": ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "max_position_embeddings", "sliding_window", "mb_per_layer"),
    "an int or None": ("pad_token_id", "bos_token_id"),
    "a finite number": ("initializer_range", "layer_norm_eps", "attention_dropout", "embd_pdrop", "resid_pdrop"),
    "true or false (a bool)": ("use_cache", "tie_word_embeddings", "mlp_bias", "lm_head_bias"),
}
# fmt: on

# The cache layer each block needs, in transformers' layer-type names (GMU and cross-attention layers get none: see
# `kv_sharing_modes`).
CACHE_TYPES = {
    "mamba": "linear_attention",
    "memory": "linear_attention",
    "sliding_attention": "sliding_attention",
    "full_attention": "full_attention",
    "gmu": "linear_attention",
    "cross_attention": "full_attention",
}

__all__ = ["SambaYConfig"]
