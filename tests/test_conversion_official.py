"""Conversion of the official lit-gpt checkpoints and of FLA's Samba, against a float64 forward written here.

Each test draws a "true" model (plain weights per layer), writes it in the source's exact layout (official: fused
qkv interleaved per key/value group, w1/w2/w3, both tied names; FLA: its key names and config.json), converts it,
and compares the converted model's logits with a float64 forward of the true weights.
"""

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_reference_models import float64_recurrence
from test_save_load import assert_loads_without_the_package

from samba_hf import SambaConfig, SambaForCausalLM
from samba_hf.conversion import ConversionError, convert, export_lit_gpt, lit_gpt, writer

VOCAB, HIDDEN, HEAD, D_STATE, D_CONV = 100, 96, 8, 16, 4


# ---------------------------------------------------------------- the true model and its float64 forward


def true_model(layer_kinds, heads=12, kv_heads=4, mlp=64, hidden=HIDDEN, vocab=128, seed=0, tied=True):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.2):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    inner, rank = 2 * hidden, math.ceil(hidden / 16)
    layers = []
    for kind in layer_kinds:
        layer = {
            "kind": kind,
            "norm1": 1 + rand(hidden),
            "norm2": 1 + rand(hidden),
            "gate": rand(mlp, hidden),
            "up": rand(mlp, hidden),
            "down": rand(hidden, mlp),
        }
        if kind == "mamba":
            layer.update(
                in_proj=rand(2 * inner, hidden),
                conv_w=rand(inner, 1, D_CONV),
                conv_b=rand(inner),
                x_proj=rand(rank + 2 * D_STATE, inner),
                dt_w=rand(inner, rank),
                dt_b=rand(inner) - 3,
                A_log=torch.log(torch.arange(1, D_STATE + 1, dtype=torch.float64)).repeat(inner, 1)
                + rand(inner, D_STATE, scale=0.1),
                D=1 + rand(inner),
                out_proj=rand(hidden, inner),
            )
        else:
            layer.update(
                q=rand(heads * HEAD, hidden),
                k=rand(kv_heads * HEAD, hidden),
                v=rand(kv_heads * HEAD, hidden),
                o=rand(hidden, heads * HEAD),
            )
        layers.append(layer)
    embed = rand(vocab, hidden, scale=0.3)  # logits of a few units: float32 keeps 1e-4 absolute
    return {
        "embed": embed,
        "head": embed if tied else rand(vocab, hidden, scale=0.3),
        "norm": 1 + rand(hidden),
        "layers": layers,
        "heads": heads,
        "kv_heads": kv_heads,
        "tied": tied,
    }


def rms(x, w, eps=1e-5):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def rotate(x, theta=10000.0):
    """RoPE in the rotate-half layout, as complex rotations of the pairs (x_i, x_{i + d/2})."""
    half = x.shape[-1] // 2
    pairs = torch.complex(x[..., :half], x[..., half:])
    angles = torch.arange(x.shape[-2], dtype=torch.float64)[:, None] * theta ** (-torch.arange(half) / half)
    turned = pairs * torch.polar(torch.ones_like(angles), angles)
    return torch.cat([turned.real, turned.imag], dim=-1)


def float64_forward(model, ids, window=None, rope=True):
    x = model["embed"][ids]
    b, t, _ = x.shape
    for layer in model["layers"]:
        h = rms(x, layer["norm1"])
        if layer["kind"] == "mamba":
            inner, rank = layer["D"].shape[0], layer["dt_w"].shape[1]
            u, z = (h @ layer["in_proj"].T).split(inner, dim=-1)
            u = F.silu(
                F.conv1d(u.transpose(1, 2), layer["conv_w"], layer["conv_b"], padding=D_CONV - 1, groups=inner)[
                    ..., :t
                ].transpose(1, 2)
            )
            dt, B, C = (u @ layer["x_proj"].T).split([rank, D_STATE, D_STATE], dim=-1)
            dt = F.softplus(dt @ layer["dt_w"].T + layer["dt_b"])
            y, _ = float64_recurrence(
                u, dt, -torch.exp(layer["A_log"]), B, C, layer["D"], z, torch.zeros(b, inner, D_STATE)
            )
            h = y @ layer["out_proj"].T
        else:
            q = (h @ layer["q"].T).view(b, t, -1, HEAD).transpose(1, 2)
            k = (h @ layer["k"].T).view(b, t, -1, HEAD).transpose(1, 2)
            v = (h @ layer["v"].T).view(b, t, -1, HEAD).transpose(1, 2)
            if rope:
                q, k = rotate(q), rotate(k)
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # query head j reads key/value head j // rep
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
            i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
            allowed = (j <= i) & (i - j < (window or t))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
            h = out.transpose(1, 2).reshape(b, t, -1) @ layer["o"].T
        x = x + h
        h = rms(x, layer["norm2"])
        x = x + (F.silu(h @ layer["gate"].T) * (h @ layer["up"].T)) @ layer["down"].T
    return rms(x, model["norm"]) @ model["head"].T


# ---------------------------------------------------------------- the two source layouts


def mamba_tensors(layer, prefix):
    """A Mamba mixer's tensors under `prefix`: the same names (mamba-ssm's) in the official code and in FLA."""
    names = {
        "in_proj.weight": "in_proj",
        "conv1d.weight": "conv_w",
        "conv1d.bias": "conv_b",
        "x_proj.weight": "x_proj",
        "dt_proj.weight": "dt_w",
        "dt_proj.bias": "dt_b",
        "A_log": "A_log",
        "D": "D",
        "out_proj.weight": "out_proj",
    }
    return {f"{prefix}.{name}": layer[key] for name, key in names.items()}


def official_state_dict(model):
    """The official layout, built group by group: rows [q heads of group g, k_g, v_g] for each g."""
    sd = {
        "transformer.wte.weight": model["embed"],
        "lm_head.weight": model["head"],
        "transformer.ln_f.weight": model["norm"],
    }
    q_per_kv = model["heads"] // model["kv_heads"]
    for i, layer in enumerate(model["layers"]):
        p = f"transformer.h.{i}"
        sd |= {
            f"{p}.norm_1.weight": layer["norm1"],
            f"{p}.norm_2.weight": layer["norm2"],
            f"{p}.mlp.swiglu.w1.weight": layer["gate"],
            f"{p}.mlp.swiglu.w2.weight": layer["up"],
            f"{p}.mlp.swiglu.w3.weight": layer["down"],
        }
        if layer["kind"] == "mamba":
            sd |= mamba_tensors(layer, f"{p}.attn")
        else:
            rows = []
            for g in range(model["kv_heads"]):
                for j in range(q_per_kv):
                    head = g * q_per_kv + j
                    rows.append(layer["q"][head * HEAD : (head + 1) * HEAD])
                rows += [layer["k"][g * HEAD : (g + 1) * HEAD], layer["v"][g * HEAD : (g + 1) * HEAD]]
            sd[f"{p}.attn.attn.weight"] = torch.cat(rows)
            sd[f"{p}.attn.proj.weight"] = layer["o"]
    return {k: v.float() for k, v in sd.items()}


def official_config(kv_heads=4, window=8, nope=False, layers=4):
    return lit_gpt.config_from_name(
        "Samba_421M",
        n_layer=layers,
        n_embd=HIDDEN,
        n_head=12,
        n_query_groups=kv_heads,
        intermediate_size=64,
        vocab_size=VOCAB,
        local_window=window,
        nope=nope,
    )


def save_official(tmp_path, model, training_checkpoint=True, name="iter-000100-ckpt.pth"):
    sd = official_state_dict(model)
    if model["tied"]:
        sd["lm_head.weight"] = sd["transformer.wte.weight"]  # one tensor under both names, as the official model
    path = tmp_path / name
    torch.save({"model": sd, "optimizer": {"state": {}}, "iter_num": 100} if training_checkpoint else sd, path)
    return path


def logits_of(folder, ids):
    model = SambaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(ids).logits.double()


IDS = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(5))

# ---------------------------------------------------------------- lit-gpt


@pytest.mark.parametrize("kv_heads", [12, 6, 3, 1])  # q_per_kv 1, 2, 4, 12
def test_lit_gpt_matches_the_float64_forward_for_every_grouping(tmp_path, kv_heads):
    model = true_model(["mamba", "attn", "mamba", "attn"], kv_heads=kv_heads, seed=kv_heads)
    src = save_official(tmp_path, model)
    result = convert("lit-gpt", src, tmp_path / "out", config=official_config(kv_heads), progress=False)
    assert result["config"].num_key_value_heads == kv_heads and result["config"].tie_word_embeddings
    expected = float64_forward(model, IDS, window=8)
    assert (logits_of(tmp_path / "out", IDS) - expected).abs().max() <= 1e-4
    assert "max |logit difference|" in result["parity"]  # small model: verified by default


@pytest.mark.parametrize("variant", ["nope", "full_attention", "untied", "bare_state_dict"])
def test_lit_gpt_variants(tmp_path, variant):
    model = true_model(["mamba", "attn", "mamba", "attn"], tied=variant != "untied", seed=7)
    config = official_config(nope=variant == "nope", window=-1 if variant == "full_attention" else 8)
    src = save_official(tmp_path, model, training_checkpoint=variant != "bare_state_dict")
    result = convert("lit-gpt", src, tmp_path / "out", config=config, progress=False)
    assert result["config"].tie_word_embeddings == (variant != "untied")
    expected = float64_forward(model, IDS, window=None if variant == "full_attention" else 8, rope=variant != "nope")
    assert (logits_of(tmp_path / "out", IDS) - expected).abs().max() <= 1e-4
    if variant == "full_attention":
        assert set(result["config"].layer_types) == {"linear_attention", "full_attention"}


@pytest.mark.parametrize("present", ["transformer.wte.weight", "lm_head.weight"])
def test_lit_gpt_with_only_one_tied_name(tmp_path, present):
    model = true_model(["mamba", "attn", "mamba", "attn"], seed=8)
    sd = official_state_dict(model)
    sd.pop("lm_head.weight" if present == "transformer.wte.weight" else "transformer.wte.weight")
    torch.save(sd, tmp_path / "ckpt.pth")
    convert("lit-gpt", tmp_path / "ckpt.pth", tmp_path / "out", config=official_config(), progress=False)
    assert (logits_of(tmp_path / "out", IDS) - float64_forward(model, IDS, window=8)).abs().max() <= 1e-4


def test_export_of_a_conversion_is_bit_exact(tmp_path):
    model = true_model(["mamba", "attn", "mamba", "attn"], kv_heads=3, seed=9)
    src = save_official(tmp_path, model)
    convert("lit-gpt", src, tmp_path / "hf", config=official_config(3), progress=False)
    result = export_lit_gpt(tmp_path / "hf", tmp_path / "back.pth")
    original = torch.load(src, weights_only=True)["model"]
    back = torch.load(tmp_path / "back.pth", weights_only=True)["model"]
    assert set(back) == set(original)
    for name in original:
        assert back[name].dtype == original[name].dtype and torch.equal(back[name], original[name]), name
    assert result["official_name"] is None  # a shrunken config: no official name has these sizes


def test_official_configs_have_the_published_sizes():
    config = lit_gpt.config_from_name("Samba_421M")
    shapes = lit_gpt.official_shapes(config)
    assert len(shapes) == 129  # the key count of an official Samba_421M checkpoint, both tied names included
    params = sum(math.prod(s) for name, s in shapes.items() if name != "lm_head.weight")
    assert params == 421_793_280
    assert shapes["transformer.h.1.attn.attn.weight"] == (4608, 1536) and shapes[
        "transformer.h.0.attn.x_proj.weight"
    ] == (128, 3072)
    mqa6 = lit_gpt.config_from_name("Samba_421M_mqa6")
    assert (mqa6.num_attention_heads, mqa6.num_key_value_heads, mqa6.head_dim) == (6, 1, 256)
    assert lit_gpt.config_from_name("Samba_421M_512_window").sliding_window == 512
    assert not lit_gpt.config_from_name("Samba_1.3B_nope").use_rope
    assert lit_gpt.official_name_of(lit_gpt.config_from_name("Samba_1.3B")) == "Samba_1.3B"


def test_bfloat16_output_keeps_a_log_and_d_in_float32(tmp_path):
    src = save_official(tmp_path, true_model(["mamba", "attn"], seed=10))
    convert("lit-gpt", src, tmp_path / "out", config=official_config(layers=2), dtype="bfloat16", progress=False)
    with safe_open(tmp_path / "out" / "model.safetensors", framework="pt") as f:
        assert f.get_tensor("model.layers.0.mamba.A_log").dtype == torch.float32
        assert f.get_tensor("model.layers.0.mamba.D").dtype == torch.float32
        assert f.get_tensor("model.layers.0.mamba.in_proj.weight").dtype == torch.bfloat16
    loaded = SambaForCausalLM.from_pretrained(tmp_path / "out")
    assert loaded.model.layers[0].mamba.A_log.dtype == torch.float32
    assert loaded.model.layers[1].self_attn.q_proj.weight.dtype == torch.bfloat16


def test_small_shards_with_an_index_load_the_same(tmp_path):
    src = save_official(tmp_path, true_model(["mamba", "attn", "mamba", "attn"], seed=11))
    convert("lit-gpt", src, tmp_path / "one", config=official_config(), progress=False)
    convert("lit-gpt", src, tmp_path / "many", config=official_config(), max_shard_size="100KB", progress=False)
    shards = sorted(p.name for p in (tmp_path / "many").glob("model-*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "many" / "model.safetensors.index.json").is_file()
    for shard in shards:
        assert os.path.getsize(tmp_path / "many" / shard) <= 100_000 + 60_000  # one tensor may exceed it alone
    assert torch.equal(logits_of(tmp_path / "one", IDS), logits_of(tmp_path / "many", IDS))


def test_converted_folder_loads_through_its_own_code(tmp_path):
    src = save_official(tmp_path, true_model(["mamba", "attn"], seed=12))
    convert("lit-gpt", src, tmp_path / "out", config=official_config(layers=2), progress=False)
    files = set(os.listdir(tmp_path / "out"))
    umask = writer.current_umask()
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o777 & ~umask  # not mkdtemp's 0700
    assert (tmp_path / "out" / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask
    assert {
        "config.json",
        "generation_config.json",
        "README.md",
        "modeling_samba.py",
        "configuration_samba.py",
        "ssm_samba.py",
        "model.safetensors",
    } <= files
    card = (tmp_path / "out" / "README.md").read_text()
    assert "lit-gpt" in card and "max |logit difference|" in card
    model = SambaForCausalLM.from_pretrained(tmp_path / "out")
    with torch.no_grad():
        torch.save({"ids": IDS, "logits": model(IDS).logits}, tmp_path / "out" / "expected.pt")
    assert_loads_without_the_package(tmp_path / "out")


# ---------------------------------------------------------------- errors leave OUT untouched


def assert_nothing_written(tmp_path, out):
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "a temporary folder was left behind"


def test_wrong_config_name_and_missing_config(tmp_path):
    src = save_official(tmp_path, true_model(["mamba", "attn"], seed=13))
    with pytest.raises(ConversionError, match="'Samba_999M' is neither an official config name \\(Samba_421M"):
        convert("lit-gpt", src, tmp_path / "out", config="Samba_999M")
    with pytest.raises(ConversionError, match="--config"):
        convert("lit-gpt", src, tmp_path / "out")
    assert_nothing_written(tmp_path, tmp_path / "out")


def test_mismatched_config_lists_every_problem_at_once(tmp_path):
    src = save_official(tmp_path, true_model(["mamba", "attn"], seed=14))
    with pytest.raises(ConversionError) as error:
        convert("lit-gpt", src, tmp_path / "out", config="Samba_421M")
    message = str(error.value)
    assert "missing (105)" in message and "wrong shape (24)" in message
    assert "transformer.h.0.attn.in_proj.weight: checkpoint [384, 96], config expects [6144, 1536]" in message
    assert (
        "wrong config name" in message and "The checkpoint has 2 blocks and embeddings of shape [128, 96]" in message
    )
    assert_nothing_written(tmp_path, tmp_path / "out")


def test_missing_and_unexpected_keys_are_named(tmp_path):
    sd = official_state_dict(true_model(["mamba", "attn"], seed=15))
    sd.pop("transformer.h.1.attn.proj.weight")
    sd["transformer.h.0.attn.extra.weight"] = torch.zeros(2)
    torch.save(sd, tmp_path / "ckpt.pth")
    with pytest.raises(
        ConversionError,
        match=r"(?s)missing \(1\): transformer.h.1.attn.proj.weight.*"
        r"unexpected \(1\): transformer.h.0.attn.extra.weight",
    ):
        convert("lit-gpt", tmp_path / "ckpt.pth", tmp_path / "out", config=official_config(layers=2))
    assert_nothing_written(tmp_path, tmp_path / "out")


def test_truncated_and_non_tensor_files(tmp_path):
    src = save_official(tmp_path, true_model(["mamba", "attn"], seed=16))
    data = src.read_bytes()
    (tmp_path / "cut.pth").write_bytes(data[: len(data) // 2])
    with pytest.raises(ConversionError, match="truncated or corrupt"):
        convert("lit-gpt", tmp_path / "cut.pth", tmp_path / "out", config=official_config(layers=2))
    torch.save({"model": {"a": [1, 2]}}, tmp_path / "odd.pth")
    with pytest.raises(ConversionError, match="not a state dict"):
        convert("lit-gpt", tmp_path / "odd.pth", tmp_path / "out", config=official_config(layers=2))
    assert_nothing_written(tmp_path, tmp_path / "out")


def test_pickled_code_is_never_run(tmp_path):
    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    torch.save({"model": Payload()}, tmp_path / "evil.pth")
    with pytest.raises(ConversionError, match="weights_only"):
        convert("lit-gpt", tmp_path / "evil.pth", tmp_path / "out", config=official_config(layers=2))
    assert not (tmp_path / "pwned").exists()


def test_a_llama_checkpoint_passed_as_lit_gpt(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=128,
            hidden_size=96,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=12,
            num_key_value_heads=4,
        )
    )
    torch.save(llama.state_dict(), tmp_path / "llama.pth")
    with pytest.raises(ConversionError, match="not a official lit-gpt.*checkpoint \\(wrong source format\\)"):
        convert("lit-gpt", tmp_path / "llama.pth", tmp_path / "out", config=official_config(layers=2))
    assert_nothing_written(tmp_path, tmp_path / "out")


def test_non_empty_out_needs_force_and_an_interrupted_write_keeps_the_old_folder(tmp_path, monkeypatch):
    src = save_official(tmp_path, true_model(["mamba", "attn"], seed=17))
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ConversionError, match="not empty.*--force"):
        convert("lit-gpt", src, out, config=official_config(layers=2))
    # --force replaces only an earlier samba-hf output, never a folder holding files of the user's
    with pytest.raises(ConversionError, match=r"holds files samba-hf does not write \(keep.txt\).*--force only"):
        convert("lit-gpt", src, out, config=official_config(layers=2), force=True)
    assert sorted(os.listdir(out)) == ["keep.txt"] and (out / "keep.txt").read_text() == "mine"

    out = tmp_path / "earlier"
    convert("lit-gpt", src, out, config=official_config(layers=2), progress=False)
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(writer, "save_file", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert("lit-gpt", src, out, config=official_config(layers=2), force=True, progress=False)
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    monkeypatch.undo()
    convert("lit-gpt", src, out, config=official_config(layers=2), dtype="bfloat16", force=True, progress=False)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


# ---------------------------------------------------------------- FLA


def save_fla(tmp_path, model, attn_layers, window=8, tie=False):
    """FLA's documented layout: backbone.* keys and its own config.json fields."""
    folder = tmp_path / "fla"
    folder.mkdir()
    sd = {"backbone.embeddings.weight": model["embed"], "backbone.norm_f.weight": model["norm"]}
    if not tie:
        sd["lm_head.weight"] = model["head"]
    for i, layer in enumerate(model["layers"]):
        p = f"backbone.layers.{i}"
        sd |= {
            f"{p}.mixer_norm.weight": layer["norm1"],
            f"{p}.mlp_norm.weight": layer["norm2"],
            f"{p}.mlp.gate_proj.weight": layer["gate"],
            f"{p}.mlp.up_proj.weight": layer["up"],
            f"{p}.mlp.down_proj.weight": layer["down"],
        }
        if layer["kind"] == "mamba":
            sd |= mamba_tensors(layer, f"{p}.mixer")
        else:
            sd |= {f"{p}.mixer.{n}_proj.weight": layer[n] for n in "qkvo"}
    save_file({k: v.float().contiguous() for k, v in sd.items()}, folder / "model.safetensors")
    config = {
        "model_type": "samba",
        "architectures": ["SambaForCausalLM"],
        "hidden_size": HIDDEN,
        "state_size": D_STATE,
        "num_hidden_layers": len(model["layers"]),
        "norm_eps": 1e-5,
        "expand": 2,
        "conv_kernel": D_CONV,
        "use_bias": False,
        "use_conv_bias": True,
        "hidden_act": "swish",
        "time_step_rank": "auto",
        "attn": {
            "layers": attn_layers,
            "num_heads": 12,
            "num_kv_heads": model["kv_heads"],
            "qkv_bias": False,
            "window_size": window,
            "rope_theta": 10000.0,
        },
        "hidden_ratio": 1,
        "vocab_size": 128,
        "tie_word_embeddings": tie,
        "fuse_norm": True,
        "fuse_swiglu": True,
        "fuse_cross_entropy": True,
        "max_position_embeddings": 2048,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("tie", [False, True])
def test_fla_matches_the_float64_forward(tmp_path, tie):
    # hidden_ratio 1 with hidden 96: FLA's MLP width is 256 * ceil(int(96 * 2 / 3) / 256) = 256
    model = true_model(["mamba", "attn", "mamba", "attn"], kv_heads=4, mlp=256, tied=tie, seed=20)
    src = save_fla(tmp_path, model, attn_layers=[1, 3], tie=tie)
    result = convert("fla", src, tmp_path / "out", progress=False)
    config = result["config"]
    assert config.layer_types == ["linear_attention", "sliding_attention"] * 2 and config.intermediate_size == 256
    assert config.tie_word_embeddings == tie
    assert (logits_of(tmp_path / "out", IDS) - float64_forward(model, IDS, window=8)).abs().max() <= 1e-4


def test_a_samba_hf_folder_passed_as_fla(tmp_path):
    SambaForCausalLM(SambaConfig.from_preset("tiny")).save_pretrained(tmp_path / "ours")
    with pytest.raises(ConversionError, match="already a samba-hf config"):
        convert("fla", tmp_path / "ours", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_fla_folder_with_a_pytorch_bin_file(tmp_path):
    model = true_model(["mamba", "attn"], kv_heads=4, mlp=256, seed=21)
    src = save_fla(tmp_path, model, attn_layers=[1])
    weights = load_file(src / "model.safetensors")
    (src / "model.safetensors").unlink()
    torch.save(weights, src / "pytorch_model.bin")
    convert("fla", src, tmp_path / "out", progress=False)
    assert (logits_of(tmp_path / "out", IDS) - float64_forward(model, IDS, window=8)).abs().max() <= 1e-4
