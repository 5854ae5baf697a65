"""The plugin tests' inputs, made in samba-hf's own environment (transformers >= 5.23), where vLLM cannot be installed:

    python vllm_plugin/tests/make_fixtures.py OUT      # then: SAMBA_VLLM_FIXTURES=OUT pytest vllm_plugin/tests

OUT gets one folder per tiny model (a Mamba-2-Hybrid written by samba-hf's `save_pretrained`; a SambaY laid out as
Microsoft's release, and the same weights saved by samba-hf) and `references.json`:
per model, the folder, the prompts (token ids) and what samba-hf's `generate` gives for them greedily, with EOS not
stopping it (as vLLM's `ignore_eos`): the tokens in float32, and in bfloat16 the tokens with the top-5 log-probs of
every step. The embedded default model is referenced where the package ships it.
"""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import samba_hf
from samba_hf import SambaConfig, SambaForCausalLM
from samba_hf.cli import default_model_path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from sambay_reference import random_weights  # noqa: E402  (samba-hf's tests: the release's tensor names)

NEW_TOKENS = 24
TOP_LOGPROBS = 5


def prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def greedy(model, prompt: list[int]) -> dict:
    """Greedy tokens and, per step, the top log-probs, from samba-hf's generate (cached decoding)."""
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    logprobs = []
    for logits in out.logits:
        top = torch.log_softmax(logits[0].float(), -1).topk(TOP_LOGPROBS)
        logprobs.append({str(i): v for i, v in zip(top.indices.tolist(), top.values.tolist())})
    return {"tokens": out.sequences[0, len(prompt) :].tolist(), "logprobs": logprobs}


def references(folder: Path, lengths: list[int], seed: int) -> dict:
    result = {"folder": str(folder.resolve())}
    for dtype in ("float32", "bfloat16"):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
        result.setdefault("prompts", prompts(lengths, model.config.vocab_size, seed))
        result[dtype] = [greedy(model, p) for p in result["prompts"]]
    return result


def mamba2_hybrid(folder: Path) -> None:
    """A tiny Mamba-2-Hybrid as `samba-hf convert megatron` writes one: Mamba-2 (two groups), GELU MLP blocks and
    NoPE full attention (head_dim 64, which vLLM's CPU attention supports), untied head; the default model's
    tokenizer."""
    torch.manual_seed(0)
    config = SambaConfig(
        vocab_size=4096,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        hybrid_override_pattern="M-M*-M-",
        mamba_version=2,
        mamba_d_state=16,
        mamba2_head_dim=32,
        mamba2_n_groups=2,
        mamba2_chunk_size=16,
        use_rope=False,
        sliding_window=None,
        mlp_gated=False,
        mlp_hidden_act="gelu",
        tie_word_embeddings=False,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
    )
    model = SambaForCausalLM(config).eval()
    with torch.no_grad():  # non-trivial norms and steps from 1e-3 to 1, so every part of the layers matters
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            if name.endswith("dt_bias"):
                param.copy_(torch.linspace(-6.0, 0.5, param.numel()))
    model.to(torch.bfloat16).save_pretrained(folder)
    AutoTokenizer.from_pretrained(default_model_path()).save_pretrained(folder)


# Every kind of SambaY layer, tiny: L=8 (self-decoder 0-3, memory 4, full 5, GMU 6, cross 7), GQA 8/4 (whole head
# pairs on each of two ranks), window 64, head_dim 32 (vLLM's CPU attention takes 32, 64, 80, ...).
SAMBAY = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    sliding_window=64,
    layer_norm_eps=1e-5,
    mamba_d_state=16,
    pad_token_id=3,
    bos_token_id=1,
    eos_token_id=2,
)


def sambay_release(folder: Path) -> None:
    """A tiny Phi-4-mini-flash-reasoning laid out as the release: its config.json fields (model_type "phi4flash",
    remote code in auto_map, flash-attention asked for), bf16 tensors under the released names with A_log and the
    lambdas in float32, two shards and an index, no lm_head, no vocabulary files (the tokenizer is given apart)."""
    weights = random_weights(SAMBAY, seed=2)
    config = {
        **SAMBAY,
        "architectures": ["Phi4FlashForCausalLM"],
        "model_type": "phi4flash",
        "mb_per_layer": 2,
        "_attn_implementation": "flash_attention_2",
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": True,
        "auto_map": {
            "AutoConfig": "configuration_phi4flash.Phi4FlashConfig",
            "AutoModelForCausalLM": "modeling_phi4flash.Phi4FlashForCausalLM",
            "AutoTokenizer": "Xenova/gpt-4o",
        },
    }
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    fp32 = ("A_log", "lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")
    stored = {k: (v.float() if k.endswith(fp32) else v.to(torch.bfloat16)).contiguous() for k, v in weights.items()}
    names = sorted(stored)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    for file, keys in shards.items():
        save_file({k: stored[k] for k in keys}, folder / file, metadata={"format": "pt"})
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in stored.values())},
        "weight_map": {k: file for file, keys in shards.items() for k in keys},
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


MARKER = ".samba_vllm_fixtures"  # written first: a folder holding it is this script's to rewrite


def check_output(out: Path) -> None:
    """OUT must be new, empty, or made by this script before (an interrupted run included): nothing else is
    overwritten."""
    if out.exists() and not out.is_dir():
        raise SystemExit(f"make_fixtures.py: error: {out} is a file; give a folder to write the fixtures in")
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).exists():
        raise SystemExit(
            f"make_fixtures.py: error: {out} holds files this script did not write; give a new or empty folder"
        )


def main(out: Path) -> None:
    check_output(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).touch()
    refs = {"samba_hf_version": samba_hf.__version__ if hasattr(samba_hf, "__version__") else "main"}
    refs["default"] = references(Path(default_model_path()), [300, 9, 120, 250, 40, 130], seed=0)
    mamba2_hybrid(out / "mamba2-hybrid")
    refs["mamba2-hybrid"] = references(out / "mamba2-hybrid", [300, 9, 70, 33], seed=1)
    sambay_release(out / "sambay")
    refs["sambay"] = references(out / "sambay", [300, 9, 70, 33], seed=2)
    refs["sambay"]["tokenizer"] = str(Path(default_model_path()).resolve())
    # the same weights as samba-hf writes a SambaY folder (architectures SambaYForCausalLM, its own remote code)
    AutoModelForCausalLM.from_pretrained(out / "sambay").save_pretrained(out / "sambay-saved")
    refs["sambay"]["saved_folder"] = str((out / "sambay-saved").resolve())
    partial = out / "references.json.partial"  # the tests read references.json only once it is whole
    partial.write_text(json.dumps(refs))
    partial.replace(out / "references.json")
    print(f"wrote {out / 'references.json'}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python vllm_plugin/tests/make_fixtures.py OUT")
    main(Path(sys.argv[1]))
