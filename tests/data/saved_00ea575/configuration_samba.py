"""Samba configuration.

Samba (Ren et al., ICLR 2025) stacks decoder layers, each one mixer and one SwiGLU MLP, both pre-norm with a
residual. The mixer of layer i is chosen by ``layer_types[i]``:

- ``"linear_attention"``: a Mamba (selective state space) mixer,
- ``"sliding_attention"``: attention over the last ``sliding_window`` positions (query included), with RoPE,
- ``"full_attention"``: causal attention over every position, with RoPE (or none: ``use_rope=False``),
- ``"mlp"``: no mixer; the layer is an MLP alone.

The default, Mamba on even and sliding attention on odd layers, is Samba. With other ``layer_types`` (and
``intermediate_size=0`` for "no MLP") the same class describes the paper's baselines: Mamba, Mamba-MLP,
Llama-2-SWA / Mistral, Llama and the full-attention hybrids.

``mamba_version=2`` makes every Mamba layer a Mamba-2 (SSD) mixer (Dao & Gu, 2024): a Samba whose Mamba layers are
Mamba-2, or, with ``"mlp"`` layers, NVIDIA's Mamba-2-Hybrid (Waleffe et al., 2024), whose blocks each hold one
sub-layer. A layout with ``"mlp"`` layers is laid out that way, as Megatron-LM's blocks: its mixer layers carry no
MLP. Without ``"mlp"`` layers every layer is a mixer followed by an MLP (unless ``intermediate_size=0``).
Megatron's pattern string is accepted as an input: ``hybrid_override_pattern="M-M*-"`` ("M" Mamba, "*" attention,
"-" MLP) sets ``layer_types``; ``config.hybrid_pattern`` writes any layout back in those letters.

This file is also the remote code of a saved model: it imports only torch/transformers.
"""

import math

from transformers import PreTrainedConfig
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, RopeParameters

LAYER_TYPES = ("linear_attention", "sliding_attention", "full_attention", "mlp")
MIXER_TYPES = LAYER_TYPES[:3]

# Megatron-LM's hybrid pattern letters (`hybrid_override_pattern`); "S" (sliding attention) is samba-hf's own.
PATTERN_LETTERS = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "S": "sliding_attention"}

# The type each scalar field must have (checked first, so a string from a hand-edited config.json or a float where a
# size is needed fails with the field's name instead of a TypeError further on). A bool is no int; an int is a float.
INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "mamba_d_state", "mamba_d_conv",
              "mamba_expand", "inference_chunk_size", "mamba_version", "mamba2_head_dim", "mamba2_n_groups",
              "mamba2_chunk_size")
OPTIONAL_INT_FIELDS = ("num_hidden_layers", "num_key_value_heads", "head_dim", "sliding_window", "pad_token_id",
                       "bos_token_id", "max_position_embeddings")

# `num_hidden_layers` when neither it nor `hybrid_override_pattern` is given (the default stays None in the field, so an
# explicit value can be told from it).
DEFAULT_NUM_HIDDEN_LAYERS = 12

# `max_position_embeddings` of a layout without full-attention layers, whose length nothing limits: large enough
# that generate does not warn and evaluation tools (lm-eval reads this field) do not cut inputs short.
UNLIMITED_POSITIONS = 2**20
FLOAT_FIELDS = ("initializer_range", "rms_norm_eps", "attention_dropout", "mamba_dt_min", "mamba_dt_max",
                "mamba_dt_init_floor", "mamba_dt_scale")
BOOL_FIELDS = ("use_cache", "tie_word_embeddings", "use_rope", "attention_bias", "mamba_conv_bias", "mamba_proj_bias",
               "mlp_gated")


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_finite_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def fail(message: str):
    raise ValueError(f"SambaConfig: {message}")


# What a field may hold, by the words the error says: SambaConfig and SambaYConfig check their fields with these.
FIELD_KINDS = {
    "an int": is_int,
    "an int or None": lambda value: value is None or is_int(value),
    "a finite number": is_finite_number,
    "true or false (a bool)": lambda value: isinstance(value, bool),
}


def check_field_types(config, fields: dict[str, tuple[str, ...]]):
    """One ValueError that names the field, what it must hold and its default, for the first field (of `fields`: kind
    -> names) whose value has the wrong type; before anything compares, divides or looks the value up."""
    for expected, names in fields.items():
        for name in names:
            value = getattr(config, name)
            if not FIELD_KINDS[expected](value):
                raise ValueError(
                    f"{type(config).__name__}: `{name}` must be {expected}, got {value!r} ({type(value).__name__}); "
                    f"set it to such a value (default: {config.__dataclass_fields__[name].default!r})."
                )


def check_shared_fields(config):
    """The fields Samba and SambaY share (their Mamba, activation, decoding and dropout settings), checked the same
    way for both, after `check_field_types`."""
    def refuse(message):
        raise ValueError(f"{type(config).__name__}: {message}")

    eos = config.eos_token_id
    if not (eos is None or is_int(eos) or (isinstance(eos, list) and all(is_int(token) for token in eos))):
        refuse(f"`eos_token_id` must be an int, a list of ints or None, got {eos!r}.")
    rank = config.mamba_dt_rank
    if not ((is_int(rank) and rank >= 1) or rank == "auto"):
        refuse(f"`mamba_dt_rank` must be a positive int or \"auto\" (ceil(hidden_size / 16)), got {rank!r}.")
    if not isinstance(config.hidden_act, str) or config.hidden_act not in ACT2FN:
        refuse(f"`hidden_act` must name an activation of transformers' ACT2FN, such as \"silu\" (Samba's) or "
               f"\"gelu\", got {config.hidden_act!r}; known: {sorted(ACT2FN)}.")
    if config.inference_chunk_size < 0:
        refuse(f"`inference_chunk_size` must be an integer >= 0 (0 turns chunking off), got "
               f"{config.inference_chunk_size!r}.")
    if not 0 < config.mamba_dt_min <= config.mamba_dt_max:
        refuse(f"need 0 < `mamba_dt_min` ({config.mamba_dt_min}) <= `mamba_dt_max` ({config.mamba_dt_max}): the "
               "range the Mamba step sizes are initialised in.")
    if not 0 <= config.attention_dropout < 1:
        refuse(f"`attention_dropout` must be in [0, 1) (0.0 turns it off), got {config.attention_dropout}.")
    if config.initializer_range < 0:
        refuse(f"`initializer_range` is a standard deviation: it must be >= 0 (default 0.02), got "
               f"{config.initializer_range}.")

# What NVIDIA's two 8B Mamba-2 models share (their Megatron `args`: hidden 4096, 32 heads in 8 query groups of kv_channels
# 128, ffn 16384, RMSNorm eps 1e-5, position_embedding_type "none", untied output layer, padded vocabulary 256000).
MEGATRON_8B = dict(
    vocab_size=256000, hidden_size=4096, intermediate_size=16384, num_hidden_layers=56, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, use_rope=False, sliding_window=None, tie_word_embeddings=False,
    max_position_embeddings=4096, mamba_version=2, mamba_d_state=128, mamba_d_conv=4, mamba_expand=2,
    mamba2_head_dim=64, mamba2_n_groups=8, mamba2_chunk_size=128, mlp_gated=False, mlp_hidden_act="gelu",
    bos_token_id=None, eos_token_id=None,
)

# Exact shapes of the official checkpoints (microsoft/Samba lit_gpt/config.py: Samba_421M, Samba_1.3B) and of the
# larger models of the paper (Table 12, which counts a mixer and an MLP as two "layers": 1.7B = 24 of our layers).
PRESETS = {
    "samba-421m": dict(
        vocab_size=32000, hidden_size=1536, intermediate_size=4096, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=12, head_dim=128,
    ),
    "samba-1.3b": dict(
        vocab_size=32000, hidden_size=2304, intermediate_size=6144, num_hidden_layers=18,
        num_attention_heads=18, num_key_value_heads=18, head_dim=128,
    ),
    "samba-1.7b": dict(
        vocab_size=50304, hidden_size=2048, intermediate_size=8196, num_hidden_layers=24,
        num_attention_heads=32, num_key_value_heads=4, head_dim=64,
    ),
    "samba-3.8b": dict(
        vocab_size=32064, hidden_size=2816, intermediate_size=9984, num_hidden_layers=32,
        num_attention_heads=11, num_key_value_heads=1, head_dim=256,
    ),
    # NVIDIA's releases with "An Empirical Study of Mamba-based Language Models" (Waleffe et al., 2024), as
    # Megatron-LM builds them (examples/mamba; Mamba geometry: Megatron's 2024 defaults, see `samba-hf convert megatron`):
    # 56 blocks of one sub-layer each, Mamba-2 mixers, attention without position embedding, exact-GELU MLPs.
    "mamba2-hybrid-8b": dict(
        MEGATRON_8B, hybrid_override_pattern="M-M-M--M-M*-M-M-M-M--M*-M-M-M-M-M*--M-M-M-M-M*-M--M-M-M-",
    ),
    "mamba2-8b": dict(MEGATRON_8B, hybrid_override_pattern="M" * 56, intermediate_size=0),
    # A few hundred thousand parameters: for tests and demos, not for quality.
    "tiny": dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=64,
    ),
}


class SambaConfig(PreTrainedConfig):
    r"""
    Configuration of a [`SambaModel`] / [`SambaForCausalLM`]. The defaults are the official Samba-421M shapes.

    Args:
        vocab_size (`int`, defaults to 32000): size of the vocabulary.
        hidden_size (`int`, defaults to 1536): width of the residual stream.
        intermediate_size (`int`, defaults to 4096): width of the SwiGLU MLP; `0` means no MLP in any layer.
        num_hidden_layers (`int`, *optional*): number of decoder layers (one mixer + one MLP each). `None` (the
            default) means the length of `hybrid_override_pattern` when one is given, else 12.
        num_attention_heads (`int`, defaults to 12): query heads of the attention layers.
        num_key_value_heads (`int`, defaults to 12): key/value heads (GQA when fewer than the query heads).
        head_dim (`int`, *optional*, defaults to 128): size of one head; `None` means `hidden_size // num_attention_heads`.
        hidden_act (`str`, defaults to `"silu"`): activation of the MLP gate and of the Mamba mixer.
        mlp_hidden_act (`str`, *optional*): activation of the MLP when it differs from `hidden_act` (the Mamba-2-Hybrid's
            is `"gelu"`, the exact erf GELU).
        mlp_gated (`bool`, defaults to `True`): SwiGLU-style `down(act(gate(x)) * up(x))`; `False` is the plain
            `down(act(up(x)))` of Megatron's MLP.
        max_position_embeddings (`int`, *optional*): the longest input the model takes. `None` (the default) means
            2**20 (`UNLIMITED_POSITIONS`) for layouts without full-attention layers, which no length limits (sliding
            windows and Mamba states extrapolate; the value only tells generate and evaluation tools not to cut
            inputs short), and 4096 for layouts with full-attention layers. RoPE scaling types that need an original
            length read it too.
        initializer_range (`float`, defaults to 0.02): std of the embedding init.
        rms_norm_eps (`float`, defaults to 1e-5): epsilon of every RMSNorm.
        use_cache (`bool`, defaults to `True`): return a cache from forward.
        tie_word_embeddings (`bool`, defaults to `True`): share `lm_head` with `embed_tokens` (as the official code).
        rope_parameters (`dict`, *optional*): RoPE settings in transformers' format, default
            `{"rope_type": "default", "rope_theta": 10000.0}`.
        use_rope (`bool`, defaults to `True`): rotate queries and keys with RoPE; `False` is the official `_nope`
            ablation (attention without positional encoding).
        sliding_window (`int`, defaults to 2048): the query plus `sliding_window - 1` earlier positions are visible
            to a `"sliding_attention"` layer (flash-attn's `window_size=(2047, 0)` in the official code).
        attention_dropout (`float`, defaults to 0.0): dropout on attention probabilities while training.
        attention_bias (`bool`, defaults to `False`): bias on q/k/v/o projections.
        layer_types (`list[str]`, *optional*): one of `"linear_attention"` (Mamba), `"sliding_attention"`,
            `"full_attention"`, `"mlp"` (an MLP alone) per layer. Default: Mamba on even layers, sliding attention on
            odd layers. With `"mlp"` layers, mixer layers carry no MLP (Megatron's one-sub-layer blocks).
        hybrid_override_pattern (`str`, *optional*, input only): Megatron-LM's pattern, one letter per layer: "M" Mamba,
            "*" full attention, "-" MLP ("S", sliding attention, is samba-hf's); sets `layer_types` and
            `num_hidden_layers` (a `num_hidden_layers` given with it must equal its length). Not stored:
            `config.hybrid_pattern` gives it back.
        mamba_version (`int`, defaults to 1): 1 for Mamba (selective scan, per-channel A), 2 for Mamba-2 (SSD: one A
            per head, B and C shared by the heads of a group, a gated group RMSNorm before `out_proj`).
        mamba_d_state (`int`, defaults to 16): SSM state size N (per channel for Mamba, per head row for Mamba-2).
        mamba2_head_dim (`int`, defaults to 64): Mamba-2 head size P; heads = `mamba_d_inner // mamba2_head_dim`.
        mamba2_n_groups (`int`, defaults to 1): Mamba-2 groups of heads sharing B and C (and one RMSNorm group each).
        mamba2_chunk_size (`int`, defaults to 128): Mamba-2 SSD chunk length (changes rounding only).
        mamba_d_conv (`int`, defaults to 4): width of the depthwise causal convolution.
        mamba_expand (`int`, defaults to 2): inner width = `mamba_expand * hidden_size`.
        mamba_dt_rank (`int` or `"auto"`, defaults to `"auto"`): rank of the step-size projection;
            `"auto"` = `ceil(hidden_size / 16)`.
        mamba_conv_bias (`bool`, defaults to `True`): bias of the depthwise convolution.
        mamba_proj_bias (`bool`, defaults to `False`): bias of `in_proj` and `out_proj`.
        mamba_dt_min / mamba_dt_max (`float`, defaults to 1e-3 / 0.1): range of the initial step sizes.
        mamba_dt_init_floor (`float`, defaults to 1e-4): smallest initial step size.
        mamba_dt_scale (`float`, defaults to 1.0): scale of the initial `dt_proj` weights.
        inference_chunk_size (`int`, defaults to 4096): without autograd, an unpadded input longer than this goes
            through the layers this many tokens at a time via the cache (same result, faster on CPU at long
            lengths, and memory bounded by the chunk). `0` turns it off.

    Example:

    ```python
    >>> from samba_hf import SambaConfig, SambaForCausalLM
    >>> config = SambaConfig.from_preset("tiny")
    >>> model = SambaForCausalLM(config)
    ```
    """

    model_type = "samba"
    keys_to_ignore_at_inference = ["past_key_values"]
    base_model_tp_plan = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    vocab_size: int = 32000
    hidden_size: int = 1536
    intermediate_size: int = 4096
    num_hidden_layers: int | None = None
    num_attention_heads: int = 12
    num_key_value_heads: int | None = 12
    head_dim: int | None = 128
    hidden_act: str = "silu"
    mlp_hidden_act: str | None = None
    mlp_gated: bool = True
    max_position_embeddings: int | None = None
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-5
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    tie_word_embeddings: bool = True
    rope_parameters: RopeParameters | dict | None = None
    use_rope: bool = True
    sliding_window: int | None = 2048
    attention_dropout: float | int = 0.0
    attention_bias: bool = False
    layer_types: list[str] | None = None
    mamba_d_state: int = 16
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_dt_rank: int | str = "auto"
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    mamba_dt_min: float = 0.001
    mamba_dt_max: float = 0.1
    mamba_dt_init_floor: float = 0.0001
    mamba_dt_scale: float = 1.0
    mamba_version: int = 1
    mamba2_head_dim: int = 64
    mamba2_n_groups: int = 1
    mamba2_chunk_size: int = 128
    inference_chunk_size: int = 4096

    def __post_init__(self, **kwargs):
        pattern = kwargs.pop("hybrid_override_pattern", None)
        self._check_field_types()
        if pattern is not None:
            self._apply_pattern(pattern)
        if self.num_hidden_layers is None:
            self.num_hidden_layers = DEFAULT_NUM_HIDDEN_LAYERS
        if self.head_dim is None:
            if self.num_attention_heads < 1 or self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"SambaConfig: `hidden_size` ({self.hidden_size}) is not divisible by `num_attention_heads` "
                    f"({self.num_attention_heads}); change one of them or set `head_dim` explicitly."
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.layer_types is None:
            self.layer_types = [
                "linear_attention" if i % 2 == 0 else "sliding_attention" for i in range(self.num_hidden_layers)
            ]
        if self.mamba_dt_rank == "auto":
            self.mamba_dt_rank = math.ceil(self.hidden_size / 16)
        if self.max_position_embeddings is None and isinstance(self.layer_types, (list, tuple)):
            self.max_position_embeddings = 4096 if "full_attention" in self.layer_types else UNLIMITED_POSITIONS
        self._check_samba_fields()
        super().__post_init__(**kwargs)
        self._check_rope_parameters()  # once transformers has filled in the defaults

    @property
    def mamba_d_inner(self) -> int:
        return self.mamba_expand * self.hidden_size

    @property
    def mamba2_num_heads(self) -> int:
        return self.mamba_d_inner // self.mamba2_head_dim

    @property
    def mixer_mlp(self) -> bool:
        """Whether a mixer layer is followed by an MLP: yes (Samba) unless the layout has MLP layers of its own
        (Megatron's blocks) or no MLP at all (`intermediate_size == 0`)."""
        return self.intermediate_size > 0 and "mlp" not in self.layer_types

    @property
    def hybrid_pattern(self) -> str:
        """`layer_types` in Megatron's letters ("M" Mamba, "*" full attention, "-" MLP; "S" sliding attention)."""
        letters = {kind: letter for letter, kind in PATTERN_LETTERS.items()}
        return "".join(letters[kind] for kind in self.layer_types)

    def _apply_pattern(self, pattern):
        if not isinstance(pattern, str) or not pattern or set(pattern) - set(PATTERN_LETTERS):
            fail(f"`hybrid_override_pattern` must be a non-empty string of the letters {''.join(PATTERN_LETTERS)} "
                 f"(\"M\" Mamba, \"*\" attention, \"-\" MLP, \"S\" sliding attention), got {pattern!r}.")
        layer_types = [PATTERN_LETTERS[letter] for letter in pattern]
        if self.layer_types is not None and list(self.layer_types) != layer_types:
            fail(f"`hybrid_override_pattern` {pattern!r} and `layer_types` {self.layer_types} disagree; give one.")
        if self.num_hidden_layers not in (None, len(layer_types)):
            fail(f"`hybrid_override_pattern` {pattern!r} has {len(layer_types)} layers but `num_hidden_layers` is "
                 f"{self.num_hidden_layers}: the pattern gives the layer count, so leave `num_hidden_layers` out (or "
                 "make them agree).")
        self.layer_types, self.num_hidden_layers = layer_types, len(layer_types)

    def _check_field_types(self):
        """Raise a ValueError that names the field for a value of the wrong type, before anything compares,
        divides or looks it up."""
        check_field_types(self, {"an int": INT_FIELDS, "an int or None": OPTIONAL_INT_FIELDS,
                                 "a finite number": FLOAT_FIELDS, "true or false (a bool)": BOOL_FIELDS})
        check_shared_fields(self)
        if self.mlp_hidden_act is not None and (not isinstance(self.mlp_hidden_act, str)
                                                or self.mlp_hidden_act not in ACT2FN):
            fail(f"`mlp_hidden_act` must name an activation of transformers' ACT2FN, such as \"gelu\", or be None (the "
                 f"MLP then uses `hidden_act`), got {self.mlp_hidden_act!r}; known: {sorted(ACT2FN)}.")
        if self.rope_parameters is not None and not isinstance(self.rope_parameters, dict):
            fail(f"`rope_parameters` must be a dict such as {{\"rope_type\": \"default\", \"rope_theta\": 10000.0}} "
                 f"or None, got {self.rope_parameters!r}.")
        if self.layer_types is not None and not (
            isinstance(self.layer_types, (list, tuple)) and all(isinstance(t, str) for t in self.layer_types)
        ):
            fail(f"`layer_types` must be a list of strings from {list(LAYER_TYPES)}, got {self.layer_types!r}.")

    def _check_samba_fields(self):
        """Raise a ValueError that names the field and the fix for every combination the model cannot build."""
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "max_position_embeddings", "mamba_d_state",
                     "mamba_d_conv", "mamba_expand", "mamba_dt_rank", "mamba2_head_dim", "mamba2_n_groups",
                     "mamba2_chunk_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                fail(f"`{name}` must be a positive integer, got {value!r}.")
        if not isinstance(self.intermediate_size, int) or self.intermediate_size < 0:
            fail(f"`intermediate_size` must be >= 0 (0 means no MLP), got {self.intermediate_size!r}.")
        if not isinstance(self.layer_types, (list, tuple)):
            fail(f"`layer_types` must be a list of strings, got {type(self.layer_types).__name__}.")
        self.layer_types = list(self.layer_types)
        if len(self.layer_types) != self.num_hidden_layers:
            fail(
                f"`layer_types` has {len(self.layer_types)} entries but `num_hidden_layers` is "
                f"{self.num_hidden_layers}: give exactly one entry per layer, or leave `layer_types` unset for the "
                "Samba default (Mamba on even, sliding attention on odd layers)."
            )
        unknown = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
        if unknown:
            fail(f"`layer_types` contains {unknown}; each entry must be one of {list(LAYER_TYPES)}.")
        if "mlp" in self.layer_types and self.intermediate_size == 0:
            fail("`layer_types` has \"mlp\" layers but `intermediate_size` is 0: give the MLP a width, or remove "
                 "those layers.")
        if self.mamba_version not in (1, 2):
            fail(f"`mamba_version` must be 1 (Mamba) or 2 (Mamba-2), got {self.mamba_version!r}.")
        if self.mamba_version == 2 and "linear_attention" in self.layer_types:
            self._check_mamba2_fields()
        if any(t in ("sliding_attention", "full_attention") for t in self.layer_types):
            if self.num_attention_heads < 1:
                fail(f"`num_attention_heads` must be >= 1 for attention layers, got {self.num_attention_heads}.")
            if self.num_key_value_heads < 1 or self.num_attention_heads % self.num_key_value_heads != 0:
                fail(
                    f"`num_attention_heads` ({self.num_attention_heads}) must be a multiple of "
                    f"`num_key_value_heads` ({self.num_key_value_heads}); pick a divisor for `num_key_value_heads`."
                )
            if self.use_rope and (self.head_dim < 2 or self.head_dim % 2 != 0):
                fail(f"`head_dim` must be even for RoPE, got {self.head_dim}.")
        if "sliding_attention" in self.layer_types:
            if not isinstance(self.sliding_window, int) or self.sliding_window < 1:
                fail(
                    f"`sliding_window` must be a positive integer when `layer_types` has sliding layers, got "
                    f"{self.sliding_window!r}; use 2048 (Samba) or switch those layers to 'full_attention'."
                )
        elif self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            fail(f"`sliding_window` must be a positive integer or None, got {self.sliding_window!r}.")
        if self.rms_norm_eps <= 0:
            fail(f"`rms_norm_eps` must be > 0 (Samba uses 1e-5), got {self.rms_norm_eps}.")

    def validate(self):
        """transformers' checks (run on save), which know no "mlp" layer (NemotronH allows it with a validator of
        its own): with such layers, all but the layer-type one, which `_check_samba_fields` has already made."""
        if "mlp" not in self.layer_types:
            return super().validate()
        for validator in getattr(PreTrainedConfig, "__class_validators__", ()):
            if validator.__name__ != "validate_layer_type":
                validator(self)

    def _check_mamba2_fields(self):
        inner, head_dim, groups = self.mamba_d_inner, self.mamba2_head_dim, self.mamba2_n_groups
        if inner % head_dim:
            fail(f"Mamba-2: the inner width `mamba_expand * hidden_size` ({inner}) must be a multiple of "
                 f"`mamba2_head_dim` ({head_dim}); pick a head size that divides it.")
        if self.mamba2_num_heads % groups:
            fail(f"Mamba-2: the {self.mamba2_num_heads} heads (`mamba_d_inner // mamba2_head_dim`) must split evenly "
                 f"into `mamba2_n_groups` ({groups}) groups; pick a divisor.")

    def _check_rope_parameters(self):
        rope_type = self.rope_parameters.get("rope_type")
        if rope_type not in ("default", *ROPE_INIT_FUNCTIONS):
            fail(
                f"`rope_parameters[\"rope_type\"]` must be \"default\" or one of {sorted(ROPE_INIT_FUNCTIONS)} "
                f"(transformers' RoPE types), got {rope_type!r}."
            )
        theta = self.rope_parameters.get("rope_theta")
        if not is_finite_number(theta) or theta <= 0:
            fail(f"`rope_parameters[\"rope_theta\"]` must be a positive number (Samba uses 10000.0), got {theta!r}.")

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "SambaConfig":
        """A config with the shapes of a named model: one of `SambaConfig.presets()`; keyword arguments override. A
        `hybrid_override_pattern` among them replaces the preset's layer count too (unless `num_hidden_layers` is
        given with it)."""
        if name not in PRESETS:
            raise ValueError(f"Unknown Samba preset {name!r}; choose one of {sorted(PRESETS)}.")
        preset = dict(PRESETS[name])
        if overrides.get("hybrid_override_pattern") is not None:
            preset.pop("num_hidden_layers", None)
        return cls(**{**preset, **overrides})

    @staticmethod
    def presets() -> list[str]:
        return list(PRESETS)


__all__ = ["SambaConfig"]
