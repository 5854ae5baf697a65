"""NVIDIA's Megatron-LM Mamba checkpoints (Mamba-2-Hybrid 8B, Mamba-2 8B): reading them without running pickled code,
their layout as a samba-hf config, and the way back.

The Hub folder as downloaded holds `latest_checkpointed_iteration.txt` ("release"),
`release/mp_rank_00/model_optim_rng.pt` (one `torch.save` dict: `model`, `args`, RNG states, ...) and a SentencePiece
`.model`. Block i of the `model` state dict is one sub-layer, told apart by its keys:

    "M"  decoder.layers.{i}.norm.weight (or, in later Megatron, mixer.in_proj.layer_norm_weight),
         mixer.{in_proj.weight, conv1d.weight, conv1d.bias, A_log, D, dt_bias, norm.weight, out_proj.weight}
                                                  -> model.layers.{i}.input_layernorm.weight, mamba.{same names}
    "*"  self_attention.linear_qkv.{layer_norm_weight, weight} (rows interleaved per query group), linear_proj.weight
                                                  -> input_layernorm, self_attn.{q,k,v}_proj, self_attn.o_proj
    "-"  mlp.linear_fc1.{layer_norm_weight, weight}, mlp.linear_fc2.weight
                                                  -> input_layernorm, mlp.up_proj, mlp.down_proj
    embedding.word_embeddings.weight, decoder.final_norm.weight, output_layer.weight
                                                  -> model.embed_tokens, model.norm, lm_head

Transformer-Engine `_extra_state` entries are dropped. The pickle is read by torch's weights-only unpickler with the
few non-tensor globals the release uses (`ALLOWED_GLOBALS`) mapped to inert stand-ins; any other global is refused.
"""

import argparse
import math
import re
from pathlib import Path

import torch

from ..configuration_samba import SambaConfig
from .checkpoint import Checkpoint, ConversionError, check_layout
from .lit_gpt import fuse_qkv, split_qkv
from .writer import expected_tensors

TRACKER = "latest_checkpointed_iteration.txt"
MAMBA_TENSORS = (
    "in_proj.weight",
    "conv1d.weight",
    "conv1d.bias",
    "A_log",
    "D",
    "dt_bias",
    "norm.weight",
    "out_proj.weight",
)
# (n_groups, d_state) of the 2024 releases: Megatron's Mamba defaults then, not recorded in their args.
RELEASE_GROUPS, RELEASE_STATE = 8, 128


class InertStandIn:
    """What an allowed non-tensor global of the checkpoint becomes: it takes any arguments and state and keeps
    nothing, so unpickling it runs no code of its own."""

    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        pass


class ModelTypeStandIn(InertStandIn):
    """Megatron's `ModelType` enum (args.model_type): keeps the member's value."""


# The non-tensor globals of the released files (args, RNG states, Transformer Engine's extra states) and what each
# becomes. argparse.Namespace is kept as itself: it only holds the values of the training arguments.
ALLOWED_GLOBALS = {
    "argparse.Namespace": argparse.Namespace,
    "megatron.core.enums.ModelType": ModelTypeStandIn,
    "megatron.model.enums.ModelType": ModelTypeStandIn,
    "_io.BytesIO": InertStandIn,
    "numpy.core.multiarray._reconstruct": InertStandIn,
    "numpy._core.multiarray._reconstruct": InertStandIn,
    "numpy.ndarray": InertStandIn,
    "numpy.dtype": InertStandIn,
    "numpy.dtypes.UInt32DType": InertStandIn,
}


def find_checkpoint(src: Path) -> Path:
    """The model_optim_rng.pt of a Megatron checkpoint folder (the Hub folder as downloaded), or SRC itself."""
    if not src.exists():
        raise ConversionError(f"{src} does not exist; pass the Megatron checkpoint folder (as downloaded) or its .pt.")
    if src.is_file():
        return src
    tracker = src / TRACKER
    if not tracker.is_file():
        raise ConversionError(
            f"{src} is not a Megatron-LM checkpoint folder: it has no {TRACKER} (the Hub folder as downloaded holds "
            "it, release/mp_rank_00/model_optim_rng.pt and the tokenizer's .model). Pass that folder or the .pt file."
        )
    iteration = tracker.read_text(errors="replace").strip()
    name = "release" if iteration == "release" else f"iter_{int(iteration):07d}" if iteration.isdigit() else None
    if name is None:
        raise ConversionError(f"{tracker} holds {iteration[:40]!r}, not 'release' or an iteration number.")
    ranks = sorted(p.name for p in (src / name).glob("mp_rank_*"))
    if len(ranks) > 1:
        raise ConversionError(
            f"{src / name} holds {len(ranks)} model-parallel ranks ({', '.join(ranks[:4])}): samba-hf converts "
            "checkpoints of tensor and pipeline parallel size 1, as released. Merge the ranks first with Megatron's "
            "tools/checkpoint/hybrid_conversion.py --target-tp-size 1 --target-pp-size 1."
        )
    path = src / name / "mp_rank_00" / "model_optim_rng.pt"
    if not path.is_file() and ((src / name / ".metadata").is_file() or any((src / name).glob("*.distcp"))):
        raise ConversionError(
            f"{src / name} is a torch_dist (distributed) checkpoint; samba-hf reads Megatron's legacy torch format, "
            "as released. Save it in that format first (Megatron's --ckpt-format torch, or "
            "tools/checkpoint/convert.py)."
        )
    if not path.is_file():
        raise ConversionError(f"{src} has no {path.relative_to(src)}: the download is incomplete.")
    return path


def find_tokenizer(src: Path) -> Path | None:
    """The SentencePiece model that comes with a Megatron checkpoint: the one *.model file of the folder as
    downloaded (for a .pt inside it, of the folder two levels above), or beside a lone .pt."""
    folder = src if src.is_dir() else src.parent
    if src.is_file() and len(src.parents) > 2 and (src.parents[2] / TRACKER).is_file():
        folder = src.parents[2]
    models = sorted(folder.glob("*.model"))
    if len(models) > 1:
        raise ConversionError(
            f"{folder} holds {len(models)} SentencePiece files ({', '.join(m.name for m in models)}): "
            "pass the model's own with --tokenizer."
        )
    return models[0] if models else None


def load_checkpoint_file(path: Path) -> dict:
    """torch.load with the weights-only unpickler, memory-mapped, with only `ALLOWED_GLOBALS` as stand-ins."""
    if not hasattr(torch.serialization, "get_unsafe_globals_in_checkpoint"):
        raise ConversionError(
            f"reading a Megatron checkpoint without running its pickled code needs a torch with "
            f"torch.serialization.get_unsafe_globals_in_checkpoint and safe_globals (tested with "
            f"2.13); this is torch {torch.__version__}: upgrade it."
        )
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception as error:
        raise ConversionError(
            f"cannot read {path} as a PyTorch checkpoint ({type(error).__name__}: {first_line(error)}). The file may "
            "be truncated (an interrupted download?) or not a checkpoint."
        ) from None
    foreign = sorted(set(names) - set(ALLOWED_GLOBALS))
    if foreign:
        raise ConversionError(
            f"{path} refers to Python objects a Megatron checkpoint does not hold: {', '.join(foreign[:5])}. "
            "samba-hf never runs code from a checkpoint; these are refused. Nothing was loaded."
        )
    stand_ins = [(ALLOWED_GLOBALS[name], name) for name in names]
    try:
        with torch.serialization.safe_globals(stand_ins):
            data = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as error:
        raise ConversionError(
            f"cannot read {path} as a PyTorch checkpoint ({type(error).__name__}: {first_line(error)}). The file may "
            "be truncated or corrupt."
        ) from None
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict):
        raise ConversionError(f"{path} is not a Megatron checkpoint: no 'model' state dict in it.")
    return data


def first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


class MegatronCheckpoint(Checkpoint):
    """The tensors of a Megatron model_optim_rng.pt (memory-mapped; `_extra_state` entries dropped) and its args."""

    def __init__(self, src: str | Path):
        self.source = Path(src)
        self.path = find_checkpoint(self.source)
        self._tensors, self._safetensors, self._shapes, self.hparams = {}, {}, {}, {}
        data = load_checkpoint_file(self.path)
        args = data.get("args")
        self.args = vars(args) if isinstance(args, argparse.Namespace) else {}
        for name, value in data["model"].items():
            if name.endswith("._extra_state"):
                continue
            if not isinstance(value, torch.Tensor):
                raise ConversionError(f"{self.path}: model entry {name} is a {type(value).__name__}, not a tensor.")
            self._tensors[name], self._shapes[name] = value, tuple(value.shape)
        if "embedding.word_embeddings.weight" not in self._shapes:
            raise ConversionError(
                f"{self.path} has no embedding.word_embeddings.weight: not a Megatron GPT/Mamba model checkpoint."
            )


def block_pattern(checkpoint: MegatronCheckpoint) -> str:
    """One letter per block from its keys: "M" (mixer), "*" (self_attention), "-" (mlp)."""
    kinds: dict[int, set[str]] = {}
    for name in checkpoint.keys():
        match = re.match(r"decoder\.layers\.(\d+)\.(mixer|self_attention|mlp|norm)\.", name)
        if match:
            kinds.setdefault(int(match.group(1)), set()).add(match.group(2))
    letters = []
    for i in range(max(kinds, default=-1) + 1):
        found = kinds.get(i, set()) - {"norm"}
        if len(found) != 1:
            what = "no tensors" if not found else f"both {' and '.join(sorted(found))}"
            raise ConversionError(
                f"{checkpoint.path}: block {i} has {what}; each block of a Megatron Mamba checkpoint is one Mamba "
                "mixer, one attention or one MLP (a missing block means an incomplete file)."
            )
        letters.append({"mixer": "M", "self_attention": "*", "mlp": "-"}[found.pop()])
    if not letters:
        raise ConversionError(f"{checkpoint.path} holds no decoder.layers.*: not a Megatron Mamba checkpoint.")
    return "".join(letters)


def allocate_layers(num_layers: int, attention_ratio: float, mlp_ratio: float) -> str:
    """Megatron's automatic hybrid layout (megatron/core/ssm/mamba_hybrid_layer_allocation.py): attention blocks
    spread evenly between Mamba sections, then MLP blocks spread over the remaining Mamba blocks."""
    kinds = ["M"] * num_layers
    attention = round(num_layers * attention_ratio)
    mamba = num_layers - attention
    section = mamba / (attention + 1)
    budget = section
    for i in range(num_layers):
        if budget < 0.5:
            kinds[i], budget = "*", budget + section
        else:
            budget -= 1
    mlp = round(num_layers * mlp_ratio)
    if mlp > 0:
        spacing = (mamba - mlp) / mlp
        budget = spacing
        for i in range(num_layers):
            if kinds[i] == "M":
                if budget < 0.5:
                    kinds[i], budget = "-", budget + spacing
                else:
                    budget -= 1
    return "".join(kinds)


def check_args(checkpoint: MegatronCheckpoint, pattern: str):
    """What the training arguments say must agree with the blocks, and describe a model samba-hf builds."""
    args = checkpoint.args
    kinds = {
        "num_layers": int,
        "hybrid_attention_ratio": float,
        "hybrid_mlp_ratio": float,
        "norm_epsilon": float,
        "hybrid_override_pattern": str,
        "num_attention_heads": int,
        "num_query_groups": int,
        "kv_channels": int,
        "mamba_num_groups": int,
        "mamba_state_dim": int,
        "max_position_embeddings": int,
        "seq_length": int,
    }
    for name, kind in kinds.items():
        value = args.get(name)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else kind)
        ):
            raise ConversionError(
                f"{checkpoint.path}: args.{name} is {value!r}, not a{'n' if kind is int else ''} "
                f"{kind.__name__}: the checkpoint's args are damaged. Nothing was written."
            )
    problems = []
    if args.get("num_layers") not in (None, len(pattern)):
        problems.append(f"args.num_layers is {args['num_layers']} but the file holds {len(pattern)} blocks")
    declared = args.get("hybrid_override_pattern") or (
        allocate_layers(len(pattern), args.get("hybrid_attention_ratio") or 0.0, args.get("hybrid_mlp_ratio") or 0.0)
        if "hybrid_attention_ratio" in args or "hybrid_mlp_ratio" in args
        else None
    )
    if declared is not None and declared != pattern:
        problems.append(f"the blocks in the file are {pattern} but its args describe {declared}")
    unsupported = {
        "position_embedding_type": ("none", None),
        "normalization": ("RMSNorm", None),
        "swiglu": (False, None),
        "add_bias_linear": (False, None),
        "apply_layernorm_1p": (False, None),
        "add_qkv_bias": (False, None),
        "qk_layernorm": (False, None),
    }
    for name, accepted in unsupported.items():
        if args.get(name) not in accepted:
            problems.append(f"args.{name}={args[name]!r} (samba-hf converts {accepted[0]!r})")
    if problems:
        raise ConversionError(f"{checkpoint.path}: " + "; ".join(problems) + ". Nothing was written.")


def tied_embeddings(checkpoint: MegatronCheckpoint) -> bool:
    """Whether the output layer is the embedding matrix: as args.untie_embeddings_and_output_weights says when
    recorded (an output_layer.weight in a tied file is then refused by `plan`'s layout check), else whether the file
    holds no output_layer.weight."""
    untied = checkpoint.args.get("untie_embeddings_and_output_weights")
    if untied is True and "output_layer.weight" not in checkpoint:
        raise ConversionError(
            f"{checkpoint.path} has no output_layer.weight, but its args say the output layer is not the embedding "
            "matrix (untie_embeddings_and_output_weights=True): the file is incomplete or damaged. "
            "Nothing was written."
        )
    if isinstance(untied, bool):
        return not untied
    return "output_layer.weight" not in checkpoint


def config_from_checkpoint(checkpoint: MegatronCheckpoint) -> SambaConfig:
    """The samba-hf config of the checkpoint: the block pattern from its keys (checked against its args), sizes from
    its shapes and args; Mamba-2 groups and state size from args when recorded, else the release's (8, 128)."""
    pattern = block_pattern(checkpoint)
    check_args(checkpoint, pattern)
    args, shape = checkpoint.args, checkpoint.shape
    vocab, hidden = shape("embedding.word_embeddings.weight")
    fields = dict(
        hybrid_override_pattern=pattern,
        vocab_size=vocab,
        hidden_size=hidden,
        use_rope=False,
        sliding_window=None,
        mlp_gated=False,
        mlp_hidden_act="relu2" if args.get("squared_relu") else "gelu",
        rms_norm_eps=float(args.get("norm_epsilon", 1e-5)),
        mamba_version=2,
        intermediate_size=0,
        tie_word_embeddings=tied_embeddings(checkpoint),
        bos_token_id=None,
        eos_token_id=None,
        max_position_embeddings=args.get("max_position_embeddings") or args.get("seq_length") or 4096,
    )
    if "-" in pattern:
        fields["intermediate_size"] = shape(f"decoder.layers.{pattern.index('-')}.mlp.linear_fc1.weight")[0]
    heads = args.get("num_attention_heads")
    if "*" in pattern and not heads:
        raise ConversionError(
            f"{checkpoint.path}: its args do not record num_attention_heads, which the attention blocks need."
        )
    if heads:  # recorded by every Megatron run, attention blocks or not
        groups = args.get("num_query_groups") if args.get("group_query_attention") else heads
        fields.update(
            num_attention_heads=heads, num_key_value_heads=groups, head_dim=args.get("kv_channels") or hidden // heads
        )
    if "M" in pattern:
        first = f"decoder.layers.{pattern.index('M')}.mixer"
        heads, inner = shape(f"{first}.A_log")[0], shape(f"{first}.norm.weight")[0]
        groups = args.get("mamba_num_groups") or RELEASE_GROUPS
        state = args.get("mamba_state_dim") or RELEASE_STATE
        conv_channels, _, kernel = shape(f"{first}.conv1d.weight")
        if inner % hidden or inner % heads or conv_channels != inner + 2 * groups * state:
            raise ConversionError(
                f"{checkpoint.path}: the Mamba-2 shapes do not add up with {groups} groups of state size {state} "
                f"(inner width {inner}, {heads} heads, conv channels {conv_channels}, hidden {hidden}); a checkpoint "
                "of other Mamba-2 sizes must record mamba_num_groups and mamba_state_dim in its args."
            )
        fields.update(
            mamba_expand=inner // hidden,
            mamba2_head_dim=inner // heads,
            mamba2_n_groups=groups,
            mamba_d_state=state,
            mamba_d_conv=kernel,
            mamba2_chunk_size=128,
        )
        if not math.isclose(fields["rms_norm_eps"], 1e-5):
            raise ConversionError(
                f"{checkpoint.path}: args.norm_epsilon is {fields['rms_norm_eps']}, but Megatron's "
                "Mamba-2 gated norm always uses 1e-5 and samba-hf one epsilon for both."
            )
    try:
        return SambaConfig(**fields)
    except ValueError as error:
        raise ConversionError(f"{checkpoint.path}: {first_line(error)}") from None


def megatron_names(config: SambaConfig, fused_norms: bool = False) -> dict[str, str]:
    """samba-hf name -> Megatron name for every tensor but the attention's q/k/v (fused in linear_qkv)."""
    names = {
        "model.embed_tokens.weight": "embedding.word_embeddings.weight",
        "model.norm.weight": "decoder.final_norm.weight",
    }
    if not config.tie_word_embeddings:
        names["lm_head.weight"] = "output_layer.weight"
    for i, kind in enumerate(config.layer_types):
        ours, theirs = f"model.layers.{i}", f"decoder.layers.{i}"
        if kind == "linear_attention":
            norm = "mixer.in_proj.layer_norm_weight" if fused_norms else "norm.weight"
            names[f"{ours}.input_layernorm.weight"] = f"{theirs}.{norm}"
            names.update({f"{ours}.mamba.{name}": f"{theirs}.mixer.{name}" for name in MAMBA_TENSORS})
        elif kind == "full_attention":
            names[f"{ours}.input_layernorm.weight"] = f"{theirs}.self_attention.linear_qkv.layer_norm_weight"
            names[f"{ours}.self_attn.o_proj.weight"] = f"{theirs}.self_attention.linear_proj.weight"
        else:
            names[f"{ours}.input_layernorm.weight"] = f"{theirs}.mlp.linear_fc1.layer_norm_weight"
            names[f"{ours}.mlp.up_proj.weight"] = f"{theirs}.mlp.linear_fc1.weight"
            names[f"{ours}.mlp.down_proj.weight"] = f"{theirs}.mlp.linear_fc2.weight"
    return names


def megatron_shapes(config: SambaConfig, fused_norms: bool = False) -> dict[str, tuple[int, ...]]:
    ours = expected_tensors(config)
    shapes = {theirs: ours[name] for name, theirs in megatron_names(config, fused_norms).items()}
    rows = (config.num_attention_heads + 2 * config.num_key_value_heads) * config.head_dim
    for i, kind in enumerate(config.layer_types):
        if kind == "full_attention":
            shapes[f"decoder.layers.{i}.self_attention.linear_qkv.weight"] = (rows, config.hidden_size)
    return shapes


def plan(checkpoint: MegatronCheckpoint, config: SambaConfig | None = None):
    """Check the checkpoint in full, then return (config, {samba-hf name: producer})."""
    config = config_from_checkpoint(checkpoint)  # (convert refuses a --config for this source)
    fused = any(name.endswith("mixer.in_proj.layer_norm_weight") for name in checkpoint.keys())
    check_layout(
        checkpoint,
        megatron_shapes(config, fused),
        "Megatron-LM Mamba",
        header=(f"{checkpoint.path} does not match the layout its blocks and args imply ({config.hybrid_pattern}):"),
        likely_cause="an incomplete or damaged file.",
    )
    names = megatron_names(config, fused)
    tensors = {ours: (lambda theirs=theirs: checkpoint[theirs]) for ours, theirs in names.items()}
    for i, kind in enumerate(config.layer_types):
        if kind == "full_attention":
            fused_qkv = f"decoder.layers.{i}.self_attention.linear_qkv.weight"
            for part, proj in enumerate(("q_proj", "k_proj", "v_proj")):
                tensors[f"model.layers.{i}.self_attn.{proj}.weight"] = lambda name=fused_qkv, p=part: split_qkv(
                    checkpoint[name], config
                )[p]
    return config, {name: tensors[name] for name in expected_tensors(config)}  # in the model's order


def to_megatron(state_dict: dict[str, torch.Tensor], config: SambaConfig) -> dict[str, torch.Tensor]:
    """A samba-hf state dict of a Megatron layout -> the released Megatron state dict (unfused norms, interleaved
    linear_qkv), in bfloat16 as released."""
    model = {}
    for ours, theirs in megatron_names(config).items():
        model[theirs] = state_dict[ours]
    for i, kind in enumerate(config.layer_types):
        if kind == "full_attention":
            q, k, v = (state_dict[f"model.layers.{i}.self_attn.{p}_proj.weight"] for p in "qkv")
            model[f"decoder.layers.{i}.self_attention.linear_qkv.weight"] = fuse_qkv(q, k, v, config)
    return {name: model[name].to(torch.bfloat16).contiguous() for name in sorted(model, key=released_order)}


# The order of a block's tensors in the released state dict.
BLOCK_ORDER = (
    "norm.weight",
    "mixer.in_proj.layer_norm_weight",
    *(f"mixer.{name}" for name in MAMBA_TENSORS),
    "self_attention.linear_qkv.layer_norm_weight",
    "self_attention.linear_qkv.weight",
    "self_attention.linear_proj.weight",
    "mlp.linear_fc1.layer_norm_weight",
    "mlp.linear_fc1.weight",
    "mlp.linear_fc2.weight",
)


def released_order(name: str) -> tuple:
    """Sort key of the released state dict's order: embedding, the blocks in order, final norm, output layer."""
    block = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
    if block:
        return 1, int(block.group(1)), BLOCK_ORDER.index(block.group(2))
    return (0,) if name.startswith("embedding.") else (2,) if name.startswith("decoder.") else (3,)


def check_exportable(config: SambaConfig, src) -> None:
    """Megatron's Mamba models are the layouts `config_from_checkpoint` produces: Mamba-2, NoPE full attention,
    plain MLPs in blocks of their own."""
    problems = []
    if "linear_attention" in config.layer_types and config.mamba_version != 2:
        problems.append("its Mamba layers are Mamba-1 (Megatron's layout is Mamba-2)")
    if "sliding_attention" in config.layer_types:
        problems.append("it has sliding-window attention layers")
    if config.mixer_mlp:
        problems.append("its mixer layers carry an MLP (Megatron's blocks hold one sub-layer each)")
    if config.use_rope and "full_attention" in config.layer_types:
        problems.append("its attention uses RoPE (the released models have no position embedding)")
    if config.mlp_gated and "mlp" in config.layer_types:
        problems.append("its MLPs are gated")
    if config.mamba_proj_bias or config.attention_bias or not config.mamba_conv_bias:
        problems.append("its biases differ from Megatron's (no linear biases, a conv bias)")
    if "mlp" in config.layer_types and (config.mlp_hidden_act or config.hidden_act) not in ("gelu", "relu2"):
        problems.append(
            f"its MLP activation is {config.mlp_hidden_act or config.hidden_act!r} (Megatron's: gelu, "
            "or relu2 with --squared-relu)"
        )
    if "linear_attention" in config.layer_types and config.hidden_act != "silu":
        problems.append(f"its Mamba activation is {config.hidden_act!r} (Megatron's: silu)")
    if not math.isclose(config.rms_norm_eps, 1e-5):
        problems.append(f"its rms_norm_eps is {config.rms_norm_eps} (Megatron's Mamba-2 gated norm uses 1e-5)")
    if problems:
        raise ConversionError(f"{src} cannot be written in Megatron's Mamba layout: " + "; ".join(problems) + ".")


def megatron_args(config: SambaConfig) -> argparse.Namespace:
    """The training arguments Megatron-LM reads back from a checkpoint (with --use-checkpoint-args), for this
    layout; the Mamba-2 sizes as later Megatron records them."""
    pattern = config.hybrid_pattern
    return argparse.Namespace(
        num_layers=len(pattern),
        hidden_size=config.hidden_size,
        ffn_hidden_size=config.intermediate_size or None,
        num_attention_heads=config.num_attention_heads,
        group_query_attention=True,
        num_query_groups=config.num_key_value_heads,
        kv_channels=config.head_dim,
        norm_epsilon=config.rms_norm_eps,
        normalization="RMSNorm",
        hybrid_override_pattern=pattern,
        hybrid_attention_ratio=pattern.count("*") / len(pattern),
        hybrid_mlp_ratio=pattern.count("-") / len(pattern),
        position_embedding_type="none",
        untie_embeddings_and_output_weights=not config.tie_word_embeddings,
        padded_vocab_size=config.vocab_size,
        seq_length=config.max_position_embeddings,
        max_position_embeddings=config.max_position_embeddings,
        add_bias_linear=False,
        swiglu=False,
        squared_relu=(config.mlp_hidden_act == "relu2"),
        apply_layernorm_1p=False,
        bf16=True,
        fp16=False,
        params_dtype=torch.bfloat16,
        mamba_state_dim=config.mamba_d_state,
        mamba_head_dim=config.mamba2_head_dim,
        mamba_num_groups=config.mamba2_n_groups,
        mamba_num_heads=config.mamba2_num_heads,
        spec=["megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec"],
    )
